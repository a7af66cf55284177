"""A session's run: the controller, the harness on live cells, guards, progress, load cases."""
