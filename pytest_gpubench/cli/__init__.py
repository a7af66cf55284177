"""The gpubench command and its starter files."""
