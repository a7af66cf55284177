"""The generated tiny model: same bytes every time, a readable GGUF, and replies of exactly max_tokens."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from gguf import GGUFReader, TokenType

from pytest_gpubench.config.prompts import read_prompts
from pytest_gpubench.engines.tinymodel import (
    CHAT_TEMPLATE,
    CONFIG,
    GENERATOR_VERSION,
    SPACE,
    TinyConfig,
    build_vocab,
    ensure_tiny_model,
    tiny_model_path,
    write_tiny_model,
)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def reader(model_file: Path) -> GGUFReader:
    return GGUFReader(model_file)


def _field(reader: GGUFReader, key: str) -> Any:
    found = reader.get_field(key)
    assert found is not None, key
    return found.contents()


def _tensor(reader: GGUFReader, name: str) -> np.ndarray[Any, Any]:
    tensor = next(t for t in reader.tensors if t.name == name)
    return np.asarray(tensor.data)


def test_two_writes_give_the_same_bytes(tmp_path: Path, model_file: Path) -> None:
    again = write_tiny_model(tmp_path / "again.gguf")
    assert again == write_tiny_model(tmp_path / "third.gguf")
    assert (tmp_path / "again.gguf").read_bytes() == model_file.read_bytes()
    assert write_tiny_model(tmp_path / "other-seed.gguf", seed=1) != again


def test_another_config_writes_a_model_of_that_size_with_the_same_vocabulary(
    tmp_path: Path, reader: GGUFReader
) -> None:
    """write_tiny_model(config=...): the load tests' larger model, same tokenizer and template;
    the same config and seed give the same bytes."""
    config = TinyConfig(n_embd=128, n_layer=3, n_head=8, n_head_kv=4, n_ff=384)
    digest = write_tiny_model(tmp_path / "larger.gguf", config=config)
    assert digest == write_tiny_model(tmp_path / "again.gguf", config=config)
    larger = GGUFReader(tmp_path / "larger.gguf")
    assert _field(larger, "llama.embedding_length") == 128
    assert _field(larger, "llama.block_count") == 3
    assert _field(larger, "llama.attention.head_count") == 8
    assert _field(larger, "llama.feed_forward_length") == 384
    tokens = "tokenizer.ggml.tokens"
    assert _field(larger, tokens) == _field(reader, tokens)
    assert _field(larger, "tokenizer.chat_template") == CHAT_TEMPLATE
    assert _tensor(larger, "blk.2.ffn_up.weight").size == 128 * 384


def test_size_is_about_one_megabyte(model_file: Path) -> None:
    assert 500_000 < model_file.stat().st_size < 2_000_000


def test_reads_back_as_a_llama_gguf_with_chat_template(reader: GGUFReader) -> None:
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.embedding_length") == CONFIG.n_embd
    assert _field(reader, "llama.block_count") == CONFIG.n_layer
    assert _field(reader, "llama.context_length") == CONFIG.context_length
    assert _field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE
    assert len(reader.tensors) == 2 + 9 * CONFIG.n_layer + 1


def test_vocabulary_has_specials_bytes_and_word_pieces(reader: GGUFReader) -> None:
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    special_ids = ("unknown", "bos", "eos")
    assert [_field(reader, f"tokenizer.ggml.{name}_token_id") for name in special_ids] == [0, 1, 2]
    bytes_ = [token for token, kind in zip(tokens, types, strict=True) if kind == TokenType.BYTE]
    assert bytes_ == [f"<0x{value:02X}>" for value in range(256)]
    words = [token for token, kind in zip(tokens, types, strict=True) if kind == TokenType.NORMAL]
    assert len(words) > 300 and SPACE + "the" in words


def test_every_generatable_token_streams_as_printable_text() -> None:
    vocab = build_vocab()
    generatable = [p for p, ok in zip(vocab.pieces, vocab.generatable, strict=True) if ok]
    for piece in generatable:
        text = piece.replace(SPACE, " ")
        assert text.strip() and text.isprintable(), piece
    types = [t for t, ok in zip(vocab.types, vocab.generatable, strict=True) if ok]
    assert set(types) == {TokenType.NORMAL}


def test_no_layer_writes_the_constant_dimension(reader: GGUFReader) -> None:
    """Why generation never ends early: see `TinyConfig.constant`."""
    assert np.all(_tensor(reader, "token_embd.weight")[:, -1] == CONFIG.constant)
    for layer in range(CONFIG.n_layer):
        for name in ("attn_output", "ffn_down"):
            assert not _tensor(reader, f"blk.{layer}.{name}.weight")[-1, :].any()
    assert _tensor(reader, "output_norm.weight")[-1] > 0
    output = _tensor(reader, "output.weight")
    never = ~np.asarray(build_vocab().generatable)
    assert np.all(output[never, -1] == -CONFIG.suppression)
    assert not output[~never, -1].any()


SHIPPED_PROMPTS = Path(__file__).resolve().parents[1] / "prompts.yaml"


def _chat_text(prompt: str) -> str:
    """CHAT_TEMPLATE rendered for one user message (the real server checks this below)."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def test_context_holds_every_shipped_prompt_and_its_max_tokens() -> None:
    """Without a server: the tokenizer falls back to one token per byte at worst, plus <s>, so
    bytes + 1 bounds the prompt's tokens in its chat template."""
    prompts = read_prompts(SHIPPED_PROMPTS)
    assert max(p.max_tokens for p in prompts.values()) == 1024
    for prompt_id, prompt in prompts.items():
        bound = len(_chat_text(prompt.prompt).encode()) + 1
        assert bound + prompt.max_tokens <= CONFIG.context_length, prompt_id


def test_ensure_writes_once_under_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUBENCH_CACHE_DIR", str(tmp_path))
    path = ensure_tiny_model()
    assert path == tiny_model_path() == tiny_model_path(tmp_path)
    assert path.parent == tmp_path / "models" and f"-v{GENERATOR_VERSION}-" in path.name
    written = path.stat().st_mtime_ns
    assert ensure_tiny_model() == path and path.stat().st_mtime_ns == written


# The real engine, when one is built (`make engine-build`); never built from here.


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_healthy(base_url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"llama-server exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    pytest.fail(f"llama-server was not healthy within {timeout_s} s")


@pytest.fixture(scope="module")
def tiny_server(
    llama_server: Path, model_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    # The built llama-server (tests/conftest.py: skipped where it is not built, failed on CI,
    # waited for where `make test` builds it beside the suite).
    binary = llama_server
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "llama-server.log"
    # One thread, as every other llama-server in the tests: two threads meet at a barrier each
    # token, and beside the other workers one waits for the other (11 s for P-HARD, 0.9 s alone).
    argv = [str(binary), "-m", str(model_file), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--threads", "1"]
    with log.open("wb") as output:
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base_url, process, timeout_s=60.0)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class StreamedReply:
    contents: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    last_chunk: dict[str, Any] = field(default_factory=dict)


def _stream_chat(base_url: str, body: dict[str, Any]) -> StreamedReply:
    reply = StreamedReply()
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            reply.last_chunk = chunk
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    reply.contents.append(content)
                reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    return reply


@pytest.mark.parametrize(
    ("prompt", "temperature"),
    [
        ("What is the capital of France?", 0.0),
        ("Explain why the sky is blue, step by step, in detail.", 0.8),
        ("</s> <s> <0x00> ünïcode ✓ 12345 ???", 1.5),
        ("Hi", 3.0),
    ],
)
@pytest.mark.engine
def test_real_server_streams_exactly_max_tokens(
    tiny_server: str, prompt: str, temperature: float
) -> None:
    max_tokens = 64
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": temperature,
        # No top-k / top-p / min-p cut: end tokens must lose on the logits alone.
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "stream_options": {"include_usage": True},
    }
    reply = _stream_chat(tiny_server, body)
    assert reply.finish_reason == "length"
    assert reply.last_chunk["usage"]["completion_tokens"] == max_tokens
    assert len(reply.contents) == max_tokens  # one token per chunk
    assert reply.last_chunk["timings"]["predicted_n"] == max_tokens


@pytest.mark.engine
@pytest.mark.parametrize("prompt_id", ["P-EASY", "P-MEDIUM", "P-HARD"])
def test_real_server_serves_each_shipped_prompt_in_full(tiny_server: str, prompt_id: str) -> None:
    """The canonical prompts, in the chat template, plus their max_tokens fit the server's context:
    every one ends by length after exactly max_tokens tokens, one per chunk."""
    prompt = read_prompts(SHIPPED_PROMPTS)[prompt_id]
    props = httpx.get(tiny_server + "/props", timeout=10).json()
    n_ctx = props["default_generation_settings"]["n_ctx"]
    messages = [{"role": "user", "content": prompt.prompt}]
    rendered = httpx.post(tiny_server + "/apply-template", json={"messages": messages}, timeout=10)
    assert rendered.json()["prompt"] == _chat_text(prompt.prompt)
    body = {
        "messages": messages,
        "stream": True,
        "max_tokens": prompt.max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    reply = _stream_chat(tiny_server, body)
    usage = reply.last_chunk["usage"]
    assert reply.finish_reason == "length"
    assert usage["completion_tokens"] == len(reply.contents) == prompt.max_tokens
    assert usage["prompt_tokens"] + prompt.max_tokens <= n_ctx
