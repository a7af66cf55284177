"""What a run is asked to do: options, cells.yaml, prompts.yaml, load profiles, cases, shards."""
