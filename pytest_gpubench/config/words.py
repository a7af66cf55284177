"""The word list synthetic prompts are made of, and the seeded text drawn from it."""

from __future__ import annotations

import random

# Short, common English words: one token each in the tokenizers of the common model families
# (the engine's usage counts in every call record say what it really was).
_WORD_TEXT = (
    "the of and to in is it that was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right "
    "boy old too same tell does set three want air well also play small end put home read "
    "hand port large spell add even"
)
WORDS = tuple(_WORD_TEXT.split())


def seeded_words(seed: int | str, size: int, count: int) -> str:
    """`count` words drawn with (seed, size): the same text on every machine."""
    chooser = random.Random(f"{seed}:{size}")
    return " ".join(chooser.choice(WORDS) for _ in range(count))
