"""Layouts of a run: mesh axes, sharding rules and the checks a layout must pass."""
