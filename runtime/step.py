"""``Step``: the training step of one layout, with everything the loop needs from it.

:func:`shardfn.runtime.build.build_step` makes one for any layout -- one device, an SPMD mesh, or
a pipeline of partitioned stages -- and the loop, checkpoints and tests use only these members:

    step = build_step(cfg, model)
    params, opt_state = step.place(params)                 # the full tree, in the step's layout
    params, opt_state, metrics = step(params, opt_state, batch)
    save_checkpoint(d, n, *step.to_checkpoint(params, opt_state))

The state's layout is the step's business: plain tensors on one device, DTensors of
``specs`` on a mesh, this rank's stages' slices in a pipeline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shardfn.core import optim
from shardfn.core.pytree import PyTree

State = tuple[PyTree, Any]
"""``(params, opt_state)`` in a step's layout."""


@dataclass(frozen=True)
class Step:
    """One layout's training step.

    Attributes:
        layout: ``"device"``, ``"mesh"`` or ``"pipeline"``.
        run: ``(params, opt_state, batch) -> (params, opt_state, metrics)``; the batch is the
            global batch, ``metrics`` 0-d tensors (``loss``, ``grad_norm``, ``lr`` and the model's
            aux metrics), the same on every rank.
        optimizer: the run's optimizer (clipping by the norm this layout needs).
        place: ``params -> (params, opt_state)``: the parameters in this layout, with a fresh
            optimizer state, from a full tree (every rank holds it) or a source of regions
            (``runtime.param_source``: each rank builds only its own blocks).
        to_checkpoint: ``(params, opt_state) -> (params, opt_state)`` as a checkpoint writes them
            and a load fills them in place (tensors, DTensors, or ``checkpoint_blocks.Blocks``).
        from_checkpoint: the inverse of ``to_checkpoint`` after a load.
        full_params: ``params -> the full tree``, gathered on every rank.
        specs: ``{"params", "opt_state", "batch", "rules"}`` on a mesh, else None.
        mesh: the ``sf.Mesh`` the step runs on (None on one device).
        jitted: the ``sf.jit`` program of a mesh step (its ``lower(...)`` gives the reports).
        write_trace: pipelines: ``path -> Path | None`` writes the last step's action timings
            (every rank calls it; rank 0 writes); None where there is no schedule to trace.
        comm_report: ``() -> rows``: the collectives of one step on this rank, ``{op, axis,
            bytes, count}`` (None on one device).
        memory_report: ``() -> dict``: bytes this rank holds (``params``, ``grads``,
            ``opt_state``, ...; None on one device).
    """

    layout: str
    run: Callable[[PyTree, Any, dict], tuple[PyTree, Any, dict]]
    optimizer: optim.GradientTransformation
    place: Callable[[PyTree], State]
    to_checkpoint: Callable[[PyTree, Any], State]
    from_checkpoint: Callable[[PyTree, Any], State]
    full_params: Callable[[PyTree], PyTree]
    specs: dict | None = None
    mesh: Any = None
    jitted: Any = None
    write_trace: Callable[[str | os.PathLike], Path | None] | None = None
    comm_report: Callable[[], list[dict]] | None = None
    memory_report: Callable[[], dict] | None = None

    def __call__(self, params: PyTree, opt_state: Any, batch: dict) -> tuple[PyTree, Any, dict]:
        return self.run(params, opt_state, batch)


def identity_state(params: PyTree, opt_state: Any) -> State:
    """``to_checkpoint``/``from_checkpoint`` of a layout whose state a checkpoint holds as it is."""
    return params, opt_state
