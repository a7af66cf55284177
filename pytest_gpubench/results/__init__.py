"""Numbers into verdicts: summaries, baselines, the gate per metric and per load point."""
