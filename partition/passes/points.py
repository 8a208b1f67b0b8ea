"""The pass pipeline: which graph passes run at which point of the flow, defaults first.

trace -> ``after_trace`` -> propagate -> ``after_propagate`` -> lower -> ``after_lower`` ->
compile. At each point the default passes a step asks for run first, then the user's
(``sf.jit(passes={point: [...]})``), in order:

- ``after_trace`` (the global graph): ``remat_pass(remat)``, a run's ``train.remat``;
- ``after_propagate`` (the global graph with ``meta["sf_placements"]``): the user's only;
- ``after_lower`` (the per-rank program): ``read_grouped_heads`` (every program), then
  ``bucket_collectives`` (``bucket_bytes``), then ``overlap_pass`` (a run's ``partition.overlap``).

``sf.jit``, its ``AUTO`` path, the pipeline's stage programs and the runtime's mesh step all
build their passes here, so one lowering runs the same passes whichever of them asked for it.

    passes = PassPipeline.of({"after_lower": [my_pass]}, bucket_bytes=25 * 2**20)
    gm = passes.run("after_lower", traced, lowered.graph_module)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from shardfn.partition.passes.bucket import bucket_pass, check_bucket_bytes
from shardfn.partition.passes.grouped_heads import read_grouped_heads
from shardfn.partition.passes.overlap import overlap_pass
from shardfn.partition.passes.remat import check_policy, remat_pass
from shardfn.partition.spmd.trace import Traced

PASS_POINTS = ("after_trace", "after_propagate", "after_lower")
"""Where ``sf.jit(..., passes=)`` runs graph passes, in the order of the flow."""


def check_passes(passes: Mapping[str, Sequence[Callable]] | None) -> dict[str, list[Callable]]:
    """``passes`` as ``{point: [pass, ...]}``, refusing an unknown point or a pass that is not callable."""
    out: dict[str, list[Callable]] = {}
    for point, fns in (passes or {}).items():
        if point not in PASS_POINTS:
            raise ValueError(f"sf.jit passes: unknown point {point!r}; passes run at {', '.join(PASS_POINTS)}")
        fns = [fns] if callable(fns) else list(fns)
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"sf.jit passes[{point!r}]: {fn!r} is not a function GraphModule -> GraphModule")
        out[point] = fns
    return out


def run_passes(passes: dict[str, list[Callable]], point: str, traced: Traced, gm: torch.fx.GraphModule | None = None):
    """Run the passes at ``point`` on ``traced``'s global graph (or on ``gm``, a per-rank program,
    which is then returned); each must return a GraphModule with the same inputs and outputs."""
    target = traced.graph_module if gm is None else gm
    for fn in passes.get(point, ()):
        out = fn(target)
        if not isinstance(out, torch.fx.GraphModule):
            raise TypeError(f"sf.jit pass {getattr(fn, '__name__', fn)!r} at {point} returned "
                            f"{type(out).__name__}; a pass returns the GraphModule it was given or a new one")
        target = out
    if gm is not None:
        return target
    return dataclasses.replace(traced, graph_module=target)


@dataclass(frozen=True)
class PassPipeline:
    """Every pass of one lowering: the defaults' settings and the user's passes by point.

        passes = PassPipeline(remat="selective", bucket_bytes=25 * 2**20, overlap=True)
        traced = passes.run("after_trace", traced)
    """

    user: Mapping[str, list[Callable]] = field(default_factory=dict)  # checked by check_passes
    remat: str = "none"               # after_trace: remat_pass(remat) unless "none"
    bucket_bytes: int | None = None   # after_lower: bucket_collectives; None or 0: one collective per tensor
    overlap: bool = False             # after_lower: overlap_pass(overlap_bytes)
    overlap_bytes: int | None = None

    @classmethod
    def of(cls, passes: Mapping[str, Sequence[Callable]] | PassPipeline | None = None, *,
           bucket_bytes: int | None = None) -> PassPipeline:
        """``sf.jit``'s ``passes`` (a ``{point: [pass, ...]}`` mapping, or a ``PassPipeline``)
        with its ``bucket_bytes`` keyword, checked.

            PassPipeline.of({"after_trace": remat_pass("full")}, bucket_bytes=1 << 20)
        """
        if bucket_bytes is not None:
            check_bucket_bytes(bucket_bytes)
        if isinstance(passes, PassPipeline):
            check_policy(passes.remat)
            pipeline = dataclasses.replace(passes, user=check_passes(passes.user))
            return pipeline if bucket_bytes is None else dataclasses.replace(pipeline, bucket_bytes=bucket_bytes)
        return cls(user=check_passes(passes), bucket_bytes=bucket_bytes)

    def defaults(self, point: str) -> list[Callable]:
        """The default passes at ``point``, in the order they run.

            PassPipeline(bucket_bytes=1 << 20).defaults("after_lower")   # [read_grouped_heads, bucket]
        """
        if point == "after_trace":
            return [remat_pass(self.remat)] if self.remat != "none" else []
        if point == "after_lower":
            out: list[Callable] = [read_grouped_heads]  # fused attention reads key/value groups unrepeated
            if self.bucket_bytes:  # before the user's after_lower passes, which see the buckets
                out.append(bucket_pass(self.bucket_bytes))
            if self.overlap:
                out.append(overlap_pass(self.overlap_bytes))
            return out
        return []

    def at(self, point: str) -> list[Callable]:
        """Every pass at ``point``: the defaults, then the user's."""
        return [*self.defaults(point), *self.user.get(point, ())]

    def run(self, point: str, traced: Traced, gm: torch.fx.GraphModule | None = None):
        """Run the passes at ``point`` (:func:`run_passes`): on ``traced``'s global graph, returning
        a new ``Traced``, or on ``gm``, a per-rank program, returning the program.

            lowered.graph_module = passes.run("after_lower", traced, lowered.graph_module)
        """
        return run_passes({point: self.at(point)}, point, traced, gm)
