"""Dataset prompt sources (config/datasets.py): the four formats read into conversations, the
length filters and the seeded sample, the frozen hash, and bad input as one line naming the
file and key."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest

from pytest_gpubench.config.datasets import Dataset, dataset_sha256, sample_dataset
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.config.prompts import read_prompt_file
from pytest_gpubench.core.errors import GpubenchError

SAMPLE = (
    Path(__file__).parent.parent / "pytest_gpubench" / "config" / "samples" / "chat_sample.jsonl"
)


def test_the_shipped_sharegpt_sample_is_sampled_the_same_way_each_time() -> None:
    dataset = Dataset(path=str(SAMPLE), format="sharegpt", seed=3, count=5)
    first = sample_dataset(dataset, "here")
    assert [p.index for p in first] == [p.index for p in sample_dataset(dataset, "here")]
    assert len(first) == 5 and len({p.index for p in first}) == 5
    for prompt in first:
        assert prompt.messages[-1][0] == "user"
        # max_tokens from the reference answer's length in words (vLLM's ShareGPT sampling).
        line = json.loads(SAMPLE.read_text().splitlines()[prompt.index - 1])
        answer = line["conversations"][-1]["value"]
        assert prompt.max_tokens == len(answer.split())
    other = sample_dataset(dataset.model_copy(update={"seed": 4}), "here")
    assert [p.index for p in other] != [p.index for p in first]
    # A system turn travels with the prompt.
    with_system = [p for p in sample_dataset(dataset.model_copy(update={"count": 24}), "x")]
    assert any(p.messages[0] == ("system", "You are a concise assistant.") for p in with_system)


def test_length_filters_keep_only_entries_within_them() -> None:
    dataset = Dataset(
        path=str(SAMPLE), format="sharegpt", count=3, max_input_words=6, min_output_words=10
    )
    for prompt in sample_dataset(dataset, "here"):
        assert len(prompt.prompt.split()) <= 6 and prompt.max_tokens >= 10


def test_openai_text_and_csv_formats(tmp_path: Path) -> None:
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi there"}]})
        + "\n\n"
        + json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "name a colour"},
                    {"role": "assistant", "content": "blue is one"},
                ]
            }
        )
        + "\n"
    )
    got = sample_dataset(Dataset(path=str(chat), format="openai", count=2), "x")
    assert [p.messages for p in got] == [
        (("user", "hi there"),),
        (("system", "be brief"), ("user", "name a colour")),
    ]
    assert [p.max_tokens for p in got] == [128, 3]
    lines = tmp_path / "lines.txt"
    lines.write_text("one two\n\nthree four five\n")
    text = sample_dataset(Dataset(path=str(lines), format="text", count=2, output_tokens=7), "x")
    assert [(p.prompt, p.max_tokens) for p in text] == [("one two", 7), ("three four five", 7)]
    table = tmp_path / "t.csv"
    table.write_text('id,question\n1,"why, then?"\n2,how\n')
    rows = sample_dataset(Dataset(path=str(table), format="csv", column="question", count=2), "x")
    assert [p.prompt for p in rows] == ["why, then?", "how"]


def test_the_hash_covers_what_is_sent(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("alpha beta\ngamma\n")
    dataset = Dataset(path=str(path), format="text", count=2)
    before = dataset_sha256(sample_dataset(dataset, "x"))
    path.write_text("alpha beta\ngamma delta\n")
    assert dataset_sha256(sample_dataset(dataset, "x")) != before


def test_a_prompts_yaml_dataset_entry_stands_for_its_sampled_prompts(tmp_path: Path) -> None:
    (tmp_path / "prompts.yaml").write_text(
        "prompts:\n"
        "  P-ONE: {intent: one, prompt: hi, max_tokens: 4}\n"
        f"  chat: {{intent: support chat, dataset: {{path: '{SAMPLE}', format: sharegpt,"
        " count: 3, seed: 1}}\n"
    )
    prompts, groups = read_prompt_file(tmp_path / "prompts.yaml")
    assert next(iter(prompts)) == "P-ONE" and len(groups["chat"]) == 3
    assert all(pid.startswith("chat#") and pid in prompts for pid in groups["chat"])
    (tmp_path / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\ncells:\n"
        "  - {node: local, engine: llamacpp, model: tiny, prompts: [chat]}\n"
    )
    matrix = read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
    assert matrix.cells[0].prompt_ids == groups["chat"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "{path: nowhere.jsonl, format: sharegpt}",
            "prompts.chat.dataset.path: *nowhere.jsonl: file not found",
        ),
        (
            "{path: d.txt, format: parquet}",
            "prompts.chat.dataset.format: Input should be 'sharegpt'*",
        ),
        (
            "{path: d.txt, format: text, count: 9}",
            "prompts.chat.dataset.count: 9 asked, but only 2 *",
        ),
        (
            "{path: d.txt, format: csv}",
            "prompts.chat.dataset: Value error, format csv needs `column:`*",
        ),
        ("{path: d.txt, format: text, colour: red}", "prompts.chat.dataset.colour: unknown key*"),
        (
            "{path: bad.jsonl, format: sharegpt}",
            "prompts.chat.dataset.path: *bad.jsonl: line 2: malformed JSON*",
        ),
        (
            "{path: d.txt, format: sharegpt}",
            "prompts.chat.dataset.path: *d.txt: line 1: malformed JSON*",
        ),
    ],
)
def test_bad_dataset_input_is_one_line_naming_the_file_and_key(
    tmp_path: Path, entry: str, message: str
) -> None:
    (tmp_path / "d.txt").write_text("alpha\nbeta\n")
    good = {"conversations": [{"from": "human", "value": "hi"}]}
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n{oops\n")
    (tmp_path / "prompts.yaml").write_text(f"prompts:\n  chat: {{dataset: {entry}}}\n")
    with pytest.raises(GpubenchError) as caught:
        read_prompt_file(tmp_path / "prompts.yaml")
    text = str(caught.value)
    assert "\n" not in text and text.startswith(str(tmp_path / "prompts.yaml"))
    assert fnmatch.fnmatch(text, f"*{message}"), text


def test_a_load_dataset_with_a_bad_file_names_the_cell_and_key(tmp_path: Path) -> None:
    (tmp_path / "prompts.yaml").write_text(
        "prompts:\n  P: {intent: p, prompt: hi, max_tokens: 4}\n"
    )
    (tmp_path / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\ncells:\n"
        "  - {node: local, engine: llamacpp, model: tiny,"
        " load: {concurrency: [2], requests: 4, dataset: {path: gone.jsonl, format: openai}}}\n"
    )
    with pytest.raises(
        GpubenchError,
        match=r"cells\[0\] \(local:llamacpp:tiny\): load\.dataset\.path: .*gone\.jsonl: file not found",
    ):
        read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
