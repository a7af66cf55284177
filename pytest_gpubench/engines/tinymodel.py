"""The embedded default model: a tiny random-weight llama GGUF, generated in code, byte for byte."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from gguf import GGUFWriter, LlamaFileType, TokenType

from pytest_gpubench.core.cache import cache_dir as default_cache_dir
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.files import atomic_file, file_sha256

# Bump when the bytes written for the same arguments change; the cached file name follows it.
GENERATOR_VERSION = 1
MODEL_NAME = "gpubench-tiny"

Matrix = npt.NDArray[np.float32]


@dataclass(frozen=True)
class TinyConfig:
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    context_length: int = 2048
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0
    # The last residual dimension holds this value for every token and no layer writes to it,
    # so after the final RMSNorm it is always clearly positive (see `_output_weights`).
    constant: float = 8.0
    # Logit per unit of the normalized constant dimension for tokens that must never be sampled:
    # a few thousand below any reachable word logit, so no temperature or sampler picks them.
    suppression: float = 1000.0


CONFIG = TinyConfig()

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Common English words; every '▁'-prefixed prefix of each becomes a piece, so SentencePiece's
# pairwise merges can reach the whole word from single characters.
WORD_TEXT = """
the of and to in is it you that he was for on are with as his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her
long make thing see him two has look more day could go come did number sound no most people my
over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give our
under name very through just form sentence great think say help low line differ turn cause much
mean before move right boy old too same tell does set three want air well also play small end
put home read hand port large spell add even land here must big high such follow act why ask
men change went light kind off need house picture try us again animal point mother world near
build self earth father head stand own page should country found answer school grow study still
learn plant cover food sun four between state keep eye never last let thought city tree cross
farm hard start might story saw far sea draw left late run while press close night real life
few north open seem together next white children begin got walk example ease paper group always
music those both mark often letter until mile river car feet care second book carry took science
eat room friend began idea fish mountain stop once base hear horse cut sure watch color face
wood main enough plain girl usual young ready above ever red list though feel talk bird soon
body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass since
top whole king space heard best hour better true during hundred five remember step early hold
west ground interest reach fast verb sing listen six table travel less morning ten simple
several vowel toward war lay against pattern slow center love person money serve appear road
map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark
machine note wait plan figure star box noun field rest correct able pound done beauty drive
stood contain front teach week final gave green quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay wheel full
force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat
snow tire bring yes distant fill east paint language among
"""
WORDS = tuple(WORD_TEXT.split())

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
DIGITS = "0123456789"
# No '<', '[' or '{': a reply must never look like the start of a tag or tool call that the
# server's chat parser would hold back, or a streamed chunk would carry more than one token.
PUNCTUATION = ".,;:!?'-()"
SPACE = "\u2581"


@dataclass(frozen=True)
class Vocab:
    """Pieces with their SentencePiece scores and token types, and which ones may be generated."""

    pieces: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]
    generatable: tuple[bool, ...]

    def index(self, piece: str) -> int:
        return self.pieces.index(piece)


def _word_pieces() -> list[str]:
    pieces = [SPACE, *LETTERS, *DIGITS, *PUNCTUATION]
    pieces += [SPACE + char for char in LETTERS + DIGITS + PUNCTUATION]
    for word in WORDS:
        pieces += [SPACE + word[:end] for end in range(2, len(word) + 1)]
    return list(dict.fromkeys(pieces))


def build_vocab() -> Vocab:
    """<unk>, <s>, </s>, the 256 byte tokens, ChatML markers, then the word pieces."""
    pieces: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    pieces += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [TokenType.BYTE] * 256
    pieces += ["<|im_start|>", "<|im_end|>"]
    types += [TokenType.CONTROL] * 2
    scores = [0.0] * len(pieces)
    words = _word_pieces()
    pieces += words
    types += [TokenType.NORMAL] * len(words)
    # Longer pieces score higher so merges prefer whole words.
    scores += [float(len(word)) for word in words]
    # A bare '▁' streams as a lone space, which a chat parser may trim to an empty chunk.
    generatable = [
        kind == TokenType.NORMAL and piece != SPACE
        for piece, kind in zip(pieces, types, strict=True)
    ]
    return Vocab(tuple(pieces), tuple(scores), tuple(int(t) for t in types), tuple(generatable))


class UniformSource:
    """Uniform weights from PCG64's raw bit stream, which NumPy keeps stable across releases
    (its distribution methods may change), so the same seed gives the same file everywhere."""

    def __init__(self, seed: int) -> None:
        self._bits = np.random.Generator(np.random.PCG64(seed)).bit_generator

    def uniform(self, shape: tuple[int, ...], scale: float) -> Matrix:
        raw = np.asarray(self._bits.random_raw(int(np.prod(shape))), dtype=np.uint64)
        unit = (raw >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)
        return ((unit * 2.0 - 1.0) * scale).astype(np.float32).reshape(shape)


def _embeddings(source: UniformSource, config: TinyConfig, n_vocab: int) -> Matrix:
    table = source.uniform((n_vocab, config.n_embd), 1.0)
    table[:, -1] = config.constant
    return table


def _output_weights(source: UniformSource, config: TinyConfig, vocab: Vocab) -> Matrix:
    weights = source.uniform((len(vocab.pieces), config.n_embd), 1.0)
    weights[:, -1] = 0.0
    never = ~np.asarray(vocab.generatable)
    weights[never, :] = 0.0
    weights[never, -1] = -config.suppression
    return weights


def _norm_weights(config: TinyConfig) -> Matrix:
    # The layers read only the varying dimensions; the constant one would drown them out.
    weights = np.ones(config.n_embd, dtype=np.float32)
    weights[-1] = 0.0
    return weights


def _layer_tensors(source: UniformSource, config: TinyConfig, layer: int) -> dict[str, Matrix]:
    head_dim = config.n_embd // config.n_head
    n_embd_kv = head_dim * config.n_head_kv
    embd_scale = 1.0 / np.sqrt(config.n_embd)
    ff_scale = 1.0 / np.sqrt(config.n_ff)
    # GGUF's [in, out] is NumPy's (out, in): rows are output dimensions.
    attn_output = source.uniform((config.n_embd, config.n_embd), embd_scale)
    ffn_down = source.uniform((config.n_embd, config.n_ff), ff_scale)
    # No layer may write the constant dimension.
    attn_output[-1, :] = 0.0
    ffn_down[-1, :] = 0.0
    prefix = f"blk.{layer}"
    return {
        f"{prefix}.attn_norm.weight": _norm_weights(config),
        f"{prefix}.attn_q.weight": source.uniform((config.n_embd, config.n_embd), embd_scale),
        f"{prefix}.attn_k.weight": source.uniform((n_embd_kv, config.n_embd), embd_scale),
        f"{prefix}.attn_v.weight": source.uniform((n_embd_kv, config.n_embd), embd_scale),
        f"{prefix}.attn_output.weight": attn_output,
        f"{prefix}.ffn_norm.weight": _norm_weights(config),
        f"{prefix}.ffn_gate.weight": source.uniform((config.n_ff, config.n_embd), embd_scale),
        f"{prefix}.ffn_up.weight": source.uniform((config.n_ff, config.n_embd), embd_scale),
        f"{prefix}.ffn_down.weight": ffn_down,
    }


def build_tensors(config: TinyConfig, vocab: Vocab, seed: int) -> dict[str, Matrix]:
    """All weights, in the order they are written."""
    source = UniformSource(seed)
    tensors = {"token_embd.weight": _embeddings(source, config, len(vocab.pieces))}
    for layer in range(config.n_layer):
        tensors.update(_layer_tensors(source, config, layer))
    output_norm = np.ones(config.n_embd, dtype=np.float32)
    tensors["output_norm.weight"] = output_norm
    tensors["output.weight"] = _output_weights(source, config, vocab)
    return tensors


def _add_metadata(writer: GGUFWriter, config: TinyConfig, vocab: Vocab) -> None:
    writer.add_name(MODEL_NAME)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.n_ff)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_head_kv)
    writer.add_rope_dimension_count(config.n_embd // config.n_head)
    writer.add_rope_freq_base(config.rope_freq_base)
    writer.add_layer_norm_rms_eps(config.rms_eps)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(vocab.pieces))
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(vocab.index("<unk>"))
    writer.add_bos_token_id(vocab.index("<s>"))
    writer.add_eos_token_id(vocab.index("</s>"))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _write_out(writer: GGUFWriter) -> None:
    """Header, metadata and tensors, in the order GGUF lays them out; the file closed after."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _write_gguf(path: Path, seed: int, config: TinyConfig) -> None:
    vocab = build_vocab()
    writer = GGUFWriter(path, arch="llama")
    _add_metadata(writer, config, vocab)
    for name, tensor in build_tensors(config, vocab, seed).items():
        writer.add_tensor(name, tensor)
    _write_out(writer)


def write_tiny_model(path: Path, *, seed: int = 0, config: TinyConfig = CONFIG) -> str:
    """Write the tiny GGUF to `path` (atomically) and return its sha256 hex digest. Another
    `config` gives a model of that size with the same vocabulary and weight generator (a larger
    one where batching pays, for load tests); the default is the tiny model itself."""
    path = Path(path)
    try:
        # Concurrent workers never see a half-written model; a lost one is written again.
        with atomic_file(path, durable=False) as partial:
            _write_gguf(partial, seed, config)
            digest = file_sha256(partial)
    except OSError as exc:
        raise GpubenchError(f"cannot write the tiny model to {path}: {exc}") from exc
    return digest


def parameters_key(seed: int = 0) -> str:
    """A short hash of everything that decides the file's bytes."""
    vocab = build_vocab()
    parameters = {
        "generator_version": GENERATOR_VERSION,
        "config": asdict(CONFIG),
        "seed": seed,
        "vocab": hashlib.sha256("\n".join(vocab.pieces).encode()).hexdigest(),
        "chat_template": CHAT_TEMPLATE,
    }
    encoded = json.dumps(parameters, sort_keys=True).encode()
    return hashlib.sha256(encoded).hexdigest()[:12]


def tiny_model_path(cache_dir: Path | None = None) -> Path:
    """Where the cached tiny model lives (it may not exist yet)."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    return root / "models" / f"{MODEL_NAME}-v{GENERATOR_VERSION}-{parameters_key()}.gguf"


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """The cached tiny model, written first if it is missing."""
    path = tiny_model_path(cache_dir)
    if not path.is_file():
        write_tiny_model(path)
    return path


# A generated LoRA adapter for the tiny model is named `tiny-lora-<seed>` in cells.yaml.
TINY_LORA_PREFIX = "tiny-lora-"
LORA_RANK = 4
# The scale of its B matrices: strong enough that two seeds answer differently from the first
# tokens on (the base model's weights are uniform in ±1/sqrt(n_embd)).
LORA_B_SCALE = 4.0


def tiny_lora_seed(name: str) -> int | None:
    """The seed of a generated adapter's name (`tiny-lora-1`: 1), None for any other name."""
    if not name.startswith(TINY_LORA_PREFIX):
        return None
    seed = name[len(TINY_LORA_PREFIX) :]
    return int(seed) if seed.isdigit() and len(seed) <= 9 else None


def _write_lora(path: Path, seed: int, config: TinyConfig) -> None:
    """llama.cpp's LoRA GGUF (convert_lora_to_gguf.py): general.type `adapter`, adapter.type
    `lora`, adapter.lora.alpha, and per adapted weight `<name>.lora_a` (rank × in) and
    `<name>.lora_b` (out × rank). It adapts the feed-forward gate and up projections only: their
    outputs stay inside the layer, so the constant dimension that keeps the control tokens from
    being sampled is left alone (see `_output_weights`)."""
    source = UniformSource(seed)
    writer = GGUFWriter(path, arch="llama")
    writer.add_name(f"{MODEL_NAME}-lora-{seed}")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(LORA_RANK))
    for layer in range(config.n_layer):
        for name in ("ffn_gate", "ffn_up"):
            down = source.uniform((LORA_RANK, config.n_embd), 1.0 / np.sqrt(config.n_embd))
            up = source.uniform((config.n_ff, LORA_RANK), LORA_B_SCALE)
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_a", down)
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_b", up)
    _write_out(writer)


def ensure_tiny_lora(seed: int, cache_dir: Path | None = None) -> Path:
    """The cached LoRA adapter of the tiny model made from `seed`, written first if missing."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    path = (
        root / "models" / f"{MODEL_NAME}-lora-{seed}-v{GENERATOR_VERSION}-{parameters_key()}.gguf"
    )
    if not path.is_file():
        try:
            with atomic_file(path, durable=False) as partial:
                _write_lora(partial, seed, CONFIG)
        except OSError as exc:
            raise GpubenchError(f"cannot write the tiny LoRA adapter to {path}: {exc}") from exc
    return path
