"""The JSONL ledger: the writer, the records it holds, what became of each cell, merged shards."""
