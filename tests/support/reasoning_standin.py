"""A timing-controlled reasoning model on 127.0.0.1 that streams its thinking and then its
answer in the three formats the engines document, one server for all three:

- vLLM (OpenAI-compatible server with a reasoning parser, docs/features/reasoning_outputs.md;
  vLLM 0.32's `DeltaMessage`): SSE `data:` chunks whose `choices[0].delta` holds `reasoning`
  while the model thinks and `content` once it answers; the last chunk (stream_options
  include_usage) carries `usage` with `completion_tokens_details.reasoning_tokens`. Selected by
  a request for model `vllm-*` on POST /v1/chat/completions.
- llama.cpp (llama-server with `--reasoning-format deepseek`, tools/server/README.md): the same
  SSE, but the thinking in `delta.reasoning_content`, no reasoning count in `usage`, and the
  server's own `timings` in the last chunk. Selected by any other model on the same path.
- Ollama (docs/api.md, "Chat request (with thinking)": `think: true`): NDJSON on POST /api/chat,
  `message.thinking` while it thinks, `message.content` when it answers, then the final chunk
  with done_reason, prompt_eval_count and eval_count (thinking tokens included).

Every stream: `delay_s` before the first reasoning token, then `reasoning` tokens and `answer`
tokens, one per chunk, `gap_s` apart, the answer held back a further `answer_delay_s`; so time
to first token is `delay_s`, time to first answer token `delay_s + reasoning * gap_s +
answer_delay_s`, on every format alike. `adjustable_reasoning_standin` lets a test change the
script between runs against the same URL (a baseline, then a later answer).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PROMPT_TOKENS = 9
# What GET /v1/models lists: a vLLM-format model and a llama.cpp-format one.
MODELS = [{"id": "vllm-r", "object": "model"}, {"id": "r", "object": "model"}]
# What GET /api/tags lists (docs/api.md, "List Local Models"): the Ollama-format model `r`.
OLLAMA_MODEL = {"name": "r:latest", "model": "r:latest", "size": 1000, "digest": "0" * 64}


@dataclass(frozen=True)
class Script:
    delay_s: float = 0.05
    gap_s: float = 0.01
    reasoning: int = 6
    answer: int = 4
    answer_delay_s: float = 0.0


@dataclass
class LiveScript:
    """The script a running stand-in follows, read afresh for every request."""

    script: Script


def _handler(live: LiveScript) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            body = b'{"status": "ok"}'
            if self.path == "/v1/models":  # the OpenAI models list both servers answer
                body = json.dumps({"object": "list", "data": MODELS}).encode()
            elif self.path == "/api/version":  # Ollama's health check and version
                body = b'{"version": "0.12.0"}'
            elif self.path == "/api/tags":  # Ollama's pulled models
                body = json.dumps({"models": [OLLAMA_MODEL]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            script = live.script
            length = int(self.headers.get("Content-Length") or 0)
            request = json.loads(self.rfile.read(length) or b"{}")
            self.send_response(200)
            ollama = self.path == "/api/chat"
            kind = "application/x-ndjson" if ollama else "text/event-stream"
            self.send_header("Content-Type", kind)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            if ollama:
                lines = self._ollama(script)
            else:
                lines = self._openai(script, str(request.get("model", "")).startswith("vllm"))
            # Each chunk at its own time from the start (sleeps that overran do not add up).
            start = time.monotonic()
            for i, line in enumerate(lines):
                due = (
                    start
                    + script.delay_s
                    + min(i, script.reasoning + script.answer - 1) * script.gap_s
                    + (script.answer_delay_s if i >= script.reasoning else 0.0)
                )
                time.sleep(max(0.0, due - time.monotonic()))
                self._chunk(line)
            self._chunk(b"")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _openai(self, script: Script, vllm: bool) -> Iterator[bytes]:
            thought = "reasoning" if vllm else "reasoning_content"
            deltas = [{thought: f" step{i}"} for i in range(script.reasoning)]
            deltas += [{"content": f" word{i}"} for i in range(script.answer)]
            for index, delta in enumerate(deltas):
                finish = "stop" if index == len(deltas) - 1 else None
                chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            usage: dict[str, Any] = {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": script.reasoning + script.answer,
            }
            last: dict[str, Any] = {"choices": [], "usage": usage}
            if vllm:
                usage["completion_tokens_details"] = {"reasoning_tokens": script.reasoning}
            else:
                last["timings"] = {"prompt_n": PROMPT_TOKENS, "predicted_n": len(deltas)}
            yield b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"

        def _ollama(self, script: Script) -> Iterator[bytes]:
            messages = [
                {"role": "assistant", "content": "", "thinking": f" step{i}"}
                for i in range(script.reasoning)
            ]
            messages += [
                {"role": "assistant", "content": f" word{i}"} for i in range(script.answer)
            ]
            for message in messages:
                yield json.dumps({"model": "r", "message": message, "done": False}).encode() + b"\n"
            done = {
                "model": "r",
                "message": {"role": "assistant", "content": ""},
                "done": True,
                "done_reason": "stop",
                "prompt_eval_count": PROMPT_TOKENS,
                "eval_count": script.reasoning + script.answer,
            }
            yield json.dumps(done).encode() + b"\n"

    return Handler


@contextmanager
def reasoning_standin(script: Script = Script()) -> Iterator[str]:
    """The stand-in's base URL while it runs."""
    with adjustable_reasoning_standin(script) as (base_url, _):
        yield base_url


@contextmanager
def adjustable_reasoning_standin(script: Script = Script()) -> Iterator[tuple[str, LiveScript]]:
    """The stand-in's base URL and the script it follows, which the test may replace."""
    live = LiveScript(script)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(live))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", live
    finally:
        server.shutdown()
        server.server_close()
