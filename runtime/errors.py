"""Errors a run reports as a mistake in its inputs rather than as a failure of the code.

A :class:`RunError` is raised while a run is under way -- a checkpoint of another model, a
loss that is NaN -- when the fix is a change to the config or the data. ``shardfn train`` prints
its message alone (exit code 2), naming the rank when it came from one; any other exception is
a failure (exit code 1), with its traceback under ``shardfn --debug``.

    raise RunError("checkpoint runs/x/step_00000010 was saved with model.n_layers=2, this run has 1; ...")
"""

from __future__ import annotations


class RunError(ValueError):
    """A mistake in the run's config or data found while running; the message says how to fix it."""


class NonFiniteError(RunError, FloatingPointError):
    """A step's loss or gradient norm is NaN or Inf (``train.nonfinite=raise``)."""
