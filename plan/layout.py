"""A layout to plan: mesh axis sizes, microbatches, schedule and checkpointing, and its checks.

The checks are the ones a run makes (``partition.layouts.axes``, ``partition.pipeline.schedules``), so a layout
the planner accepts is one the runtime accepts, and each refusal names the same config key.

    layout = Layout(pp=16, ep=64, microbatches=32)
    check_layout(cfg, layout, gpus=1024)      # PlanError (a LayoutError) naming mesh.ep, ...
    rank_stages(layout)[0]                    # the stages pipeline rank 0 holds
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from shardfn.partition.cost.model import intra_node_dims
from shardfn.partition.errors import LayoutError
from shardfn.partition.layouts.axes import (
    AXIS_ORDER,
    DATA_AXES,
    MESH_AXES,
    check_batch,
    check_context,
    check_model,
    check_stages,
    resolve_rules,
)
from shardfn.partition.pipeline.schedules import SCHEDULES, canonical_name, get_schedule, simulate, stages_per_rank

PlanError = LayoutError
"""A layout that cannot run; ``key`` is the config key to change (``"mesh.ep"``)."""

PLACEMENT_ORDER = tuple(reversed(AXIS_ORDER))
"""Mesh axes onto nodes, innermost (fastest links) first: ``tp, ep, cp, fsdp, dp, pp``."""


@dataclass(frozen=True)
class Layout:
    """One way to lay a run out: mesh axis sizes, microbatches, pipeline schedule, checkpointing.

    ``virtual`` is the number of stages per pipeline rank (``None``: the schedule's default,
    ``partition.pipeline.schedules.stages_per_rank``). ``cp`` splits the sequence (context parallelism);
    it is listed with the axes only when > 1, as a run's mesh lists it.

    Example:
        Layout(pp=16, ep=64, microbatches=32).world_size      # 1024
        Layout.from_config(cfg, checkpointing=True).describe()
    """

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    ep: int = 1
    tp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    checkpointing: bool = False
    virtual: int | None = None
    cp: int = 1

    @classmethod
    def from_config(cls, cfg, *, checkpointing: bool = False) -> "Layout":
        """The layout a run config asks for (``mesh`` and ``pipeline`` sections).

        Raises:
            PlanError: ``pipeline.stages`` does not fit ``mesh.pp`` and the schedule.
        """
        mesh, pipe = cfg.mesh, cfg.pipeline
        virtual = None
        if pipe.stages is not None:
            virtual = stages_per_rank(pipe.schedule, mesh.pp, pipe.stages)
        return cls(mesh.pp, mesh.dp, mesh.fsdp, mesh.ep, mesh.tp, pipe.microbatches, canonical_name(pipe.schedule),
                   checkpointing, virtual, mesh.cp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.cp * self.ep * self.tp

    @property
    def data_size(self) -> int:
        """How many ways the global batch is split (``dp * fsdp * ep``)."""
        return self.dp * self.fsdp * self.ep

    @property
    def stages_per_rank(self) -> int:
        if self.pp == 1:
            return 1
        return self.virtual if self.virtual is not None else stages_per_rank(self.schedule, self.pp)

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def axes(self, *, include_pp: bool = True) -> dict[str, int]:
        """``{"pp": .., "dp": .., "fsdp": .., "ep": .., "tp": ..}`` (``cp`` too when > 1), major to minor."""
        return {a: getattr(self, a) for a in _listed(self) if include_pp or a != "pp"}

    def describe(self) -> str:
        axes = " ".join(f"{a}={getattr(self, a)}" for a in _listed(self))
        virtual = f"x{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return f"{axes} mb={self.microbatches} {self.schedule}{virtual}{' ckpt' if self.checkpointing else ''}"

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """The layout :meth:`describe` prints: axis sizes ``pp=8 fsdp=2 ep=32``, ``mb=8``, a
        schedule name (``interleaved_1f1b``, with ``x2`` for two stages per rank) and ``ckpt``.

        Example:
            Layout.parse("pp=8 fsdp=2 ep=32 mb=8 interleaved_1f1b ckpt").world_size   # 512

        Raises:
            ValueError: a word that is none of those.
        """
        fields: dict = {}
        for word in text.replace(",", " ").split():
            name, _, value = word.partition("=")
            if value and name in ("pp", "dp", "fsdp", "ep", "tp", "cp", "mb", "microbatches"):
                fields["microbatches" if name in ("mb", "microbatches") else name] = int(value)
            elif word == "ckpt":
                fields["checkpointing"] = True
            elif canonical_name(word.rsplit("x", 1)[0] if word[-1].isdigit() and "x" in word else word) in SCHEDULES:
                base, _, virtual = word.rpartition("x") if word[-1].isdigit() and "x" in word else (word, "", "")
                fields["schedule"] = canonical_name(base)
                if virtual:
                    fields["virtual"] = int(virtual)
            else:
                raise ValueError(f"layout: {word!r} is not an axis size (pp=8), mb=N, a schedule "
                                 f"({', '.join(SCHEDULES)}) or ckpt")
        return cls(**fields)

    def overrides(self, remat: str = "none") -> list[str]:
        """The run-config overrides that ask for this layout (what ``shardfn train --search``
        runs): every mesh axis, the pipeline's microbatches, schedule and stages, and
        ``train.remat`` (``remat`` when checkpointing, else ``none``; ``full`` for ``none``).

        Example:
            Layout(fsdp=2, ep=2).overrides()[:3]   # ['mesh.pp=1', 'mesh.dp=1', 'mesh.fsdp=2']
        """
        stages = self.n_stages if self.pp > 1 and self.stages_per_rank > 1 else "null"
        kept = (remat if remat != "none" else "full") if self.checkpointing else "none"
        return [*(f"mesh.{a}={getattr(self, a)}" for a in ("pp", "dp", "fsdp", "ep", "tp", "cp")),
                f"pipeline.microbatches={self.microbatches}", f"pipeline.schedule={self.schedule}",
                f"pipeline.stages={stages}", f"train.remat={kept}"]

    def to_dict(self) -> dict:
        return {**self.axes(), "microbatches": self.microbatches, "schedule": self.schedule,
                "stages_per_rank": self.stages_per_rank, "checkpointing": self.checkpointing,
                "world_size": self.world_size}


def intra_node(layout: Layout, hw) -> dict[str, bool]:
    """Per axis: does its group stay inside a node of ``hw`` (axes placed innermost first)?

        intra_node(Layout(fsdp=8, dp=4), load_hardware("h100"))["dp"]   # False: 32 > 8 per node
    """
    flags = intra_node_dims([getattr(layout, a) for a in AXIS_ORDER], hw.gpus_per_node)  # major to minor
    return dict(zip(PLACEMENT_ORDER, reversed(flags)))


def _listed(layout: Layout) -> tuple[str, ...]:
    return tuple(a for a in AXIS_ORDER if a in MESH_AXES or getattr(layout, a) > 1)


# ============================================================================ checks


def check_layout(cfg, layout: Layout, *, gpus: int | None = None) -> None:
    """Raise :class:`PlanError` naming the config key when ``layout`` cannot run ``cfg``.

    Checks, in order: axis sizes, the world size against ``gpus``, the mesh against the model
    (``partition.layouts.axes.check_model``: ``pp`` against the layers, ``ep`` divides the experts,
    ``tp`` the heads, every parameter dim the axes it is split over), the pipeline (stages,
    schedule, microbatches) and the batch against the data axes.

    Example:
        check_layout(cfg, Layout(ep=7))   # PlanError: mesh.ep: 7 does not divide model.n_experts = 384 ...
    """
    for a in AXIS_ORDER:
        if getattr(layout, a) < 1:
            raise PlanError(f"mesh.{a}", f"must be >= 1, got {getattr(layout, a)}")
    if gpus is not None and layout.world_size != gpus:
        raise PlanError("mesh", _world_message(layout, gpus))
    check_mesh(cfg, layout)
    check_pipeline(cfg, layout)
    check_layout_batch(cfg, layout)


def check_mesh(cfg, layout: Layout) -> None:
    """The checks that depend on the mesh axes alone (and, for ``cp``, the sequence length)."""
    from shardfn import models

    model = models.get(cfg.model_name)
    check_model(model, cfg.model, layout.axes(), cfg.rules)
    axes = layout.axes()
    check_context(model, cfg, axes, resolve_rules(cfg.rules, axes))  # cp: the sequence, pp, mtp


def check_pipeline(cfg, layout: Layout) -> None:
    """The stages fit the layers, and the schedule exists and runs these microbatches."""
    if layout.schedule not in SCHEDULES:
        raise PlanError("pipeline.schedule", f"unknown schedule {layout.schedule!r}; valid: {', '.join(SCHEDULES)}")
    from shardfn import models

    check_stages(models.get(cfg.model_name).layer_count(cfg.model), layout.pp, layout.n_stages)
    if layout.microbatches < 1:
        raise PlanError("pipeline.microbatches", f"must be >= 1, got {layout.microbatches}")
    if layout.pp > 1:
        try:
            schedule_of(layout, communication=False)
        except ValueError as e:
            raise PlanError(
                "pipeline.microbatches" if "microbatch" in str(e) else "pipeline.schedule", str(e)
            ) from None


def check_layout_batch(cfg, layout: Layout) -> None:
    """The global batch splits over ``dp * fsdp * ep`` ranks and then into the microbatches."""
    check_batch(cfg.train.batch_size, layout.data_size, layout.microbatches, data_axes=DATA_AXES)


def _world_message(layout: Layout, gpus: int) -> str:
    rest = layout.world_size // layout.dp
    hint = f"; set mesh.dp={gpus // rest}" if gpus % rest == 0 else ""
    names = _listed(layout)
    return (f"the mesh {'*'.join(names)} = {'*'.join(str(getattr(layout, a)) for a in names)} = "
            f"{layout.world_size} devices but --gpus is {gpus}{hint}")


# ============================================================================ the schedule


def schedule_of(layout: Layout, *, communication: bool = True):
    """The layout's pipeline schedule (``partition.pipeline.schedules.get_schedule``), cached; without
    its P2P actions when ``communication`` is False (the compute order, the same makespan and
    in-flight counts, built in a fraction of the time)."""
    return _schedule_for(layout.schedule, layout.pp, layout.microbatches, layout.stages_per_rank, communication)


@functools.lru_cache(maxsize=512)
def _schedule_for(name: str, pp: int, microbatches: int, virtual: int, communication: bool = True):
    return get_schedule(name, pp, microbatches, n_virtual=virtual, communication=communication)


def rank_stages(layout: Layout) -> list[tuple[int, ...]]:
    """The stages each pipeline rank holds (the schedule's stage map).

    Example:
        rank_stages(Layout(pp=2, schedule="interleaved_1f1b", microbatches=4))   # [(0, 2), (1, 3)]
    """
    if layout.pp == 1:
        return [(0,)]
    sched = schedule_of(layout)
    return [sched.stages_of(r) for r in range(layout.pp)]


def inflight(layout: Layout, stage_act: Sequence[int], *, sends: bool = True
             ) -> tuple[list[int], list[int], list[dict]]:
    """Per pipeline rank: the most activation bytes held at once, the most microbatches held,
    and the P2P sends per step (from the schedule's actions; ``sends=False``: not counted, and
    the schedule built without its P2P actions)."""
    return _inflight_for(layout.pp, layout.microbatches, layout.schedule, layout.virtual, tuple(stage_act), sends)


@functools.lru_cache(maxsize=4096)
def _inflight_for(p: int, m: int, schedule: str, virtual: int | None, stage_act: tuple, communication: bool = True):
    layout = Layout(pp=p, microbatches=m, schedule=schedule, virtual=virtual)
    if p == 1:
        return [stage_act[0]], [1], [{}]
    peak_bytes, peak_mb, sends = [], [], []
    for actions in schedule_of(layout, communication=communication).actions:
        held = held_mb = top = top_mb = 0
        count = {"SEND_F": 0, "SEND_B": 0}
        for a in actions:
            if a.kind == "F":
                held, held_mb = held + stage_act[a.stage], held_mb + 1
                top, top_mb = max(top, held), max(top_mb, held_mb)
            elif a.kind in ("B", "I"):
                held, held_mb = held - stage_act[a.stage], held_mb - 1
            elif a.kind in count:
                count[a.kind] += 1
        peak_bytes.append(top)
        peak_mb.append(top_mb)
        sends.append(count)
    return peak_bytes, peak_mb, sends


def makespan_units(layout: Layout, costs: dict, comm_units: float) -> tuple[float, float]:
    """``(makespan, bubble)`` of the schedule in units of one stage forward."""
    p, m = layout.pp, layout.microbatches
    if p == 1:
        return m * (costs["F"] + costs["B"]), 0.0
    # the P2P delay to two significant digits: layouts that differ below that share one simulation
    return _simulate_for(layout.schedule, p, m, layout.stages_per_rank, tuple(sorted(costs.items())),
                         float(f"{comm_units:.2g}"))


@functools.lru_cache(maxsize=4096)
def _simulate_for(name: str, pp: int, microbatches: int, virtual: int, costs: tuple, comm: float):
    sim = simulate(_schedule_for(name, pp, microbatches, virtual, False), costs=dict(costs), comm=comm)
    return sim.makespan, sim.bubble
