"""Planning at scale: bytes, collectives, step time and fit per rank for a run config on a
simulated mesh of any size, without allocating a parameter; and a search over layouts.

    cfg = load_config("kimi_k2_1t", ["mesh.pp=16", "mesh.ep=64", "train.batch_size=1024", "train.seq_len=4096"])
    plan = make_plan(cfg, hardware="h200")
    plan.fits, plan.per_rank["peak_bytes"], plan.time["step_s"]
    print(format_plan(plan)); json.dumps(plan.to_dict())
    found = search(cfg, gpus=1024, hardware="h200")        # fitting layouts, fastest first

Where each number comes from:

- **Parameters, gradients, optimizer state** are exact, for the full model, from shapes and
  specs alone: every parameter's spec on the mesh (``model.param_axes`` + the config's rules,
  as ``runtime.partitioned`` lays out a run) gives its local shard, ``numel x element size``;
  a pipeline rank holds its stages' slices of the stacked layers (:func:`stage_layers`), the
  embedding on the first stage and the final norm and output head on the last. The optimizer
  state is the real optimizer's ``init`` on meta tensors (AdamW: two moments like the
  parameters plus 0-d counters), sharded as the parameters. Gradients are the parameters' size.
- **Activations and collectives** come from lowering the real train step
  (``runtime.train.make_train_step`` under ``runtime.partitioned``'s specs) with fake tensors
  on a fake mesh of the layout's axes (``pp`` left out: stages own it), for one microbatch.
  A model of more than :data:`FULL_TRACE_MAX_LAYERS` layers (or any model under ``pp > 1``) is
  traced *reduced*: one layer of each kind (``dense_layers``, ``moe_layers``; ``layers`` for
  Llama), then each kind once more. The differences are exact per-layer quantities (every
  layer of a kind lowers to the same program), and a stage's numbers are
  ``base + sum(layers of kind k on the stage * per-layer_k)``. What is not a layer (embedding,
  final norm, output head, loss) is charged to the last stage.
  *Activation bytes* are the forward values the backward reads (saved for backward); with
  activation checkpointing a layer keeps only its input ``[mb, seq, dim]`` and one layer is
  recomputed at a time. Collectives of the forward and backward run once per microbatch; the
  gradient reductions (the constraints ``runtime.partitioned`` puts on the gradients) and the
  optimizer's run once per step, after gradients are accumulated over microbatches. Each
  gradient reduction belongs to one parameter, so a stage counts those of its own slices.
- **Expert-parallel all-to-alls** depend on routing and run in the runtime
  (``runtime.moe_dispatch``), so they are *estimated* for uniform routing: per MoE layer and
  microbatch, dispatch and combine each send ``tokens x top_k x dim x bytes x (ep-1)/ep`` off
  the rank, forward and again backward (four exchanges). **P2P** between pipeline stages is the
  ``[mb, seq, dim]`` activation forward and its gradient backward, per microbatch and boundary
  (counted from the schedule's send actions).
- **In-flight microbatches** per pipeline rank come from the schedule's action lists
  (``runtime.schedules``): the most forwards whose backward has not run, weighted by each
  stage's activation bytes. Without that module: 1F1B, ``min(m, pp - rank)``.
- **Step time** (an estimate, nothing overlapped): compute is ``6 x active params x tokens``
  plus causal attention (``3 x seq x heads x (qk + v head dims)`` per token and layer), split
  over the ranks and divided by the hardware's peak for the dtype (x 4/3 with checkpointing:
  the forward runs again). Each collective costs the alpha-beta ring model of
  ``partition.hardware``, with mesh axes placed on nodes innermost first (``tp, ep, fsdp, dp,
  pp``): an axis is intra-node when its size times the sizes inside it fit ``gpus_per_node``.
  A microbatch on a stage takes its compute plus its collectives; the schedule's simulator
  (F = 1, B = 2 units, or B = 3 with checkpointing; zero-bubble I = W = 1) turns that into a
  makespan with P2P as its communication delay; the per-step collectives (gradient reductions)
  are added after it. MFU is model FLOPs / (step time x ranks x peak).
- **Fit**: the binding rank's peak (parameters + gradients + optimizer state + in-flight
  activations + one layer's transient working set: its recomputed activations or activation
  gradients, and its gathered weights under ``fsdp``) against ``partition.memory_budget`` or
  the hardware's memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import optree
import torch

from shardfn.core.pytree import flatten_with_paths
from shardfn.partition.hardware import Hardware, load_hardware
from shardfn.partition.layouts import param_specs, resolve_rules
from shardfn.partition.spec import P, shard_shape

__all__ = [
    "MESH_ORDER", "PLACEMENT_ORDER", "FULL_TRACE_MAX_LAYERS", "SCHEDULE_NAMES",
    "Layout", "PlanError", "Plan", "Profile", "SearchResult",
    "check_layout", "stage_layers", "rank_stages", "state_bytes", "memory_bytes",
    "lower_step", "measure", "saved_bytes", "profile", "make_plan", "search", "format_plan", "format_search",
]

MESH_ORDER = ("pp", "dp", "fsdp", "ep", "tp")
"""Mesh axes major to minor (as ``runtime.partitioned`` builds the mesh)."""

PLACEMENT_ORDER = ("tp", "ep", "fsdp", "dp", "pp")
"""Axes onto nodes, innermost (fastest links) first."""

FULL_TRACE_MAX_LAYERS = 4
"""Models with at most this many layers are traced whole (no per-layer scaling) when ``pp == 1``."""

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved_1f1b", "zbh1", "dualpipev")
"""Schedules the planner knows how to place; the simulator in ``runtime.schedules`` times them."""

_STACKS = ("layers", "dense_layers", "moe_layers")
"""Stacked-layer subtrees of the parameter tree, in network order."""

_COMM_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")


class PlanError(ValueError):
    """A layout that cannot run; ``key`` is the config key to change (``"mesh.ep"``)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


# ============================================================================ layouts


@dataclass(frozen=True)
class Layout:
    """One way to lay a run out: mesh axis sizes, microbatches, pipeline schedule, checkpointing.

    ``virtual`` is the number of stages per pipeline rank (``None``: the schedule's default, 2
    for ``interleaved_1f1b`` and ``dualpipev``, else 1).

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

    @classmethod
    def from_config(cls, cfg, *, checkpointing: bool = False) -> "Layout":
        """The layout a run config asks for (``mesh`` and ``pipeline`` sections).

        Raises:
            PlanError: ``pipeline.stages`` is not a multiple of ``mesh.pp``.
        """
        mesh, pipe = cfg.mesh, cfg.pipeline
        virtual = None
        if pipe.stages is not None:
            if pipe.stages % mesh.pp:
                raise PlanError("pipeline.stages", f"{pipe.stages} is not a multiple of mesh.pp = {mesh.pp}; use "
                                                   f"{mesh.pp * max(1, pipe.stages // mesh.pp)} or null (one stage per rank)")
            virtual = pipe.stages // mesh.pp
        return cls(mesh.pp, mesh.dp, mesh.fsdp, mesh.ep, mesh.tp, pipe.microbatches,
                   pipe.schedule.lower().replace("-", "_"), checkpointing, virtual)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.ep * self.tp

    @property
    def data_size(self) -> int:
        """How many ways the global batch is split (``dp * fsdp * ep``)."""
        return self.dp * self.fsdp * self.ep

    @property
    def stages_per_rank(self) -> int:
        if self.pp == 1:
            return 1
        if self.virtual is not None:
            return self.virtual
        return 2 if self.schedule in ("interleaved_1f1b", "dualpipev") else 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def axes(self, *, include_pp: bool = True) -> dict[str, int]:
        """``{"pp": .., "dp": .., "fsdp": .., "ep": .., "tp": ..}``, major to minor."""
        return {a: getattr(self, a) for a in MESH_ORDER if include_pp or a != "pp"}

    def describe(self) -> str:
        axes = " ".join(f"{a}={getattr(self, a)}" for a in MESH_ORDER)
        virtual = f"x{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return f"{axes} mb={self.microbatches} {self.schedule}{virtual}{' ckpt' if self.checkpointing else ''}"

    def to_dict(self) -> dict:
        return {**self.axes(), "microbatches": self.microbatches, "schedule": self.schedule,
                "stages_per_rank": self.stages_per_rank, "checkpointing": self.checkpointing,
                "world_size": self.world_size}


class _AxisSizes:
    """The part of a mesh that specs need (axis names and sizes): no process group."""

    def __init__(self, axes: Mapping[str, int]):
        self.axes = dict(axes)
        self.names = tuple(self.axes)


# ============================================================================ the model's shapes


@dataclass(frozen=True)
class _Leaf:
    path: str                # "moe_layers.experts.w1"
    shape: tuple[int, ...]   # global
    spec: P
    local: tuple[int, ...]   # per rank (the stacked dim whole)
    itemsize: int
    stack: str | None        # "moe_layers" for a stacked leaf

    def local_bytes(self, n_layers: int | None = None) -> int:
        """Bytes on one rank; for a stacked leaf, of ``n_layers`` of its layers."""
        dims = list(self.local)
        if self.stack is not None:
            dims[0] = n_layers if n_layers is not None else dims[0]
        return math.prod(dims) * self.itemsize


def _stacks(model_cfg) -> list[tuple[str, int]]:
    """``[(stack key, layers), ...]`` in network order (empty stacks left out)."""
    if hasattr(model_cfg, "first_k_dense"):
        out = [("dense_layers", model_cfg.first_k_dense), ("moe_layers", model_cfg.n_layers - model_cfg.first_k_dense)]
        return [(k, n) for k, n in out if n > 0]
    return [("layers", model_cfg.n_layers)]


def _with_layers(model_cfg, counts: Mapping[str, int]):
    """``model_cfg`` with ``counts[stack]`` layers in each stack (a reduced, representative model)."""
    if hasattr(model_cfg, "first_k_dense"):
        dense = counts.get("dense_layers", 0)
        return dataclasses.replace(model_cfg, first_k_dense=dense, n_layers=dense + counts.get("moe_layers", 0))
    return dataclasses.replace(model_cfg, n_layers=counts["layers"])


def _meta_params(model, model_cfg, dtype: torch.dtype):
    return model.init(model_cfg, 0, device="meta", dtype=dtype)


def _leaves(model, model_cfg, axes: Mapping[str, int], rules: dict | None, dtype: torch.dtype) -> list[_Leaf]:
    """Every parameter with its spec and local shape on a mesh of ``axes`` (nothing allocated)."""
    mesh = _AxisSizes({a: s for a, s in axes.items() if a != "pp"})
    specs = param_specs(model.param_axes(model_cfg), resolve_rules(rules, mesh), mesh)
    params = _meta_params(model, model_cfg, dtype)
    spec_leaves = optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P), none_is_leaf=False)
    out = []
    for (path, x), spec in zip(flatten_with_paths(params), spec_leaves):
        stack = path.split(".")[0] if path.split(".")[0] in _STACKS else None
        out.append(_Leaf(path, tuple(x.shape), spec, tuple(shard_shape(x.shape, spec, mesh.axes)), x.element_size(),
                         stack))
    return out


# ============================================================================ checks


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(cfg, layout: Layout, *, gpus: int | None = None) -> None:
    """Raise :class:`PlanError` naming the config key when ``layout`` cannot run ``cfg``.

    Checks, in order: axis sizes, the world size against ``gpus``, the mesh (``pp`` against
    the layers, ``ep`` divides the experts, ``tp`` divides the heads, every parameter dim
    against the mesh axes it is split over), the pipeline (stages, schedule, microbatches) and
    the batch against the data axes.

    Example:
        check_layout(cfg, Layout(ep=7))   # PlanError: mesh.ep: 7 does not divide model.n_experts = 384 ...
    """
    for a in MESH_ORDER:
        if getattr(layout, a) < 1:
            raise PlanError(f"mesh.{a}", f"must be >= 1, got {getattr(layout, a)}")
    if gpus is not None and layout.world_size != gpus:
        raise PlanError("mesh", _world_message(layout, gpus))
    _check_mesh(cfg, layout)
    _check_pipeline(cfg, layout)
    _check_batch(cfg, layout)


def _check_mesh(cfg, layout: Layout) -> None:
    """The checks that depend on the mesh axes alone."""
    m = cfg.model
    if layout.pp > m.n_layers:
        raise PlanError("mesh.pp", f"{layout.pp} pipeline stages for model.n_layers = {m.n_layers} layers; "
                                   f"use at most {m.n_layers}")
    n_experts = getattr(m, "n_experts", None)
    if n_experts is not None and n_experts % layout.ep:
        near = sorted(_divisors(n_experts), key=lambda d: abs(d - layout.ep))[:3]
        raise PlanError("mesh.ep", f"{layout.ep} does not divide model.n_experts = {n_experts}; "
                                   f"pick a divisor of the expert count, e.g. {sorted(near)}")
    if m.n_heads % layout.tp:
        raise PlanError("mesh.tp", f"{layout.tp} does not divide model.n_heads = {m.n_heads}; "
                                   f"tensor parallelism splits whole heads, use one of {_divisors(m.n_heads)}")
    kv = getattr(m, "n_kv_heads", None)
    if kv is not None and getattr(m, "attention", "gqa") == "gqa" and kv % layout.tp:
        raise PlanError("mesh.tp", f"{layout.tp} does not divide model.n_kv_heads = {kv}; use one of {_divisors(kv)}")
    _check_param_dims(cfg, layout)


def _world_message(layout: Layout, gpus: int) -> str:
    rest = layout.world_size // layout.dp
    hint = f"; set mesh.dp={gpus // rest}" if gpus % rest == 0 else ""
    return (f"the mesh pp*dp*fsdp*ep*tp = {'*'.join(str(getattr(layout, a)) for a in MESH_ORDER)} = "
            f"{layout.world_size} devices but --gpus is {gpus}{hint}")


def _check_pipeline(cfg, layout: Layout) -> None:
    n_layers = cfg.model.n_layers
    if layout.n_stages > n_layers:
        raise PlanError("mesh.pp", f"{layout.pp} ranks x {layout.stages_per_rank} stages each = {layout.n_stages} "
                                   f"stages for {n_layers} layers; use mesh.pp <= {n_layers // layout.stages_per_rank}")
    if layout.schedule not in SCHEDULE_NAMES:
        raise PlanError("pipeline.schedule", f"unknown schedule {layout.schedule!r}; valid: {', '.join(SCHEDULE_NAMES)}")
    if layout.microbatches < 1:
        raise PlanError("pipeline.microbatches", f"must be >= 1, got {layout.microbatches}")
    if layout.pp > 1:
        try:
            _schedule(layout)
        except ImportError:
            pass
        except ValueError as e:
            raise PlanError("pipeline.microbatches" if "microbatch" in str(e) else "pipeline.schedule", str(e)) from None


def _check_param_dims(cfg, layout: Layout) -> None:
    from shardfn import models

    model = models.get(cfg.model_name)
    for leaf in _leaves(model, cfg.model, layout.axes(), cfg.rules, torch.float32):
        for dim, entry in enumerate(leaf.spec):
            names = [entry] if isinstance(entry, str) else list(entry or ())
            n = math.prod(getattr(layout, a) for a in names)
            if n > 1 and leaf.shape[dim] % n:
                axis = names[0] if len(names) == 1 else names[-1]
                raise PlanError(f"mesh.{axis}", f"{n} does not divide dim {dim} (size {leaf.shape[dim]}) of "
                                                f"parameter {leaf.path} {list(leaf.shape)}, split over {tuple(names)}; "
                                                f"pick a size that divides it, or change its rule")


def _check_batch(cfg, layout: Layout) -> None:
    b = cfg.train.batch_size
    if b % layout.data_size:
        raise PlanError("train.batch_size", f"{b} is not divisible by the data-parallel size dp*fsdp*ep = "
                                            f"{layout.data_size}; use a multiple of {layout.data_size}")
    per_rank = b // layout.data_size
    if per_rank % layout.microbatches:
        raise PlanError("pipeline.microbatches", f"{layout.microbatches} does not divide the per-rank batch "
                                                 f"train.batch_size / (dp*fsdp*ep) = {per_rank}; use one of "
                                                 f"{_divisors(per_rank)}")


# ============================================================================ stages


def stage_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges of ``n_stages`` stages, as even as possible
    (the first ``n_layers % n_stages`` stages get one layer more).

    Example:
        stage_layers(61, 16)[:2], stage_layers(61, 16)[-1]   # [(0, 4), (4, 8)], (58, 61)
    """
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out


def _schedule(layout: Layout):
    """The layout's schedule from ``runtime.schedules`` (ImportError when that module is absent)."""
    virtual = layout.stages_per_rank if layout.schedule == "interleaved_1f1b" else layout.virtual
    return _schedule_for(layout.schedule, layout.pp, layout.microbatches, virtual)


@functools.lru_cache(maxsize=512)
def _schedule_for(name: str, pp: int, microbatches: int, virtual: int | None):
    from shardfn.runtime.schedules import get_schedule

    return get_schedule(name, pp, microbatches, n_virtual=virtual)


@functools.lru_cache(maxsize=4096)
def _simulate_for(name: str, pp: int, microbatches: int, virtual: int | None, costs: tuple, comm: float):
    from shardfn.runtime.schedules import simulate

    sim = simulate(_schedule_for(name, pp, microbatches, virtual), costs=dict(costs), comm=comm)
    return sim.makespan, sim.bubble


def rank_stages(layout: Layout) -> list[tuple[int, ...]]:
    """The stages each pipeline rank holds (from the schedule's stage map when available).

    Example:
        rank_stages(Layout(pp=2, schedule="interleaved_1f1b", microbatches=4))   # [(0, 2), (1, 3)]
    """
    if layout.pp == 1:
        return [(0,)]
    try:
        sched = _schedule(layout)
        return [sched.stages_of(r) for r in range(layout.pp)]
    except ImportError:
        v = layout.stages_per_rank
        return [tuple(r + i * layout.pp for i in range(v)) for r in range(layout.pp)]


@dataclass(frozen=True)
class _RankShare:
    """What one pipeline rank holds: layers per stack, and the non-layer parameters."""

    counts: dict              # stack -> layers on this rank
    first: bool               # holds the embedding
    last: bool                # holds the final norm, output head and loss
    layer_ranges: tuple       # ((start, end), ...) of its stages


def _rank_shares(model_cfg, layout: Layout) -> list[_RankShare]:
    stacks = _stacks(model_cfg)
    ranges = stage_layers(model_cfg.n_layers, layout.n_stages)
    n_stages = layout.n_stages
    bounds, start = {}, 0
    for key, n in stacks:
        bounds[key] = (start, start + n)
        start += n
    shares = []
    for stages in rank_stages(layout):
        counts = {key: 0 for key, _ in stacks}
        for s in stages:
            lo, hi = ranges[s]
            for key, (a, b) in bounds.items():
                counts[key] += max(0, min(hi, b) - max(lo, a))
        shares.append(_RankShare(counts, 0 in stages, n_stages - 1 in stages, tuple(ranges[s] for s in stages)))
    return shares


def _leaf_on_rank(leaf: _Leaf, share: _RankShare, tied: bool) -> int:
    """Layers of a stacked leaf on this rank; for a non-layer leaf, 1 if the rank holds it."""
    if leaf.stack is not None:
        return share.counts.get(leaf.stack, 0)
    if leaf.path.split(".")[0] == "embed":
        return int(share.first or (tied and share.last))
    return int(share.last)


def _local_numel(leaf: _Leaf, share: _RankShare, tied: bool) -> int:
    """Elements of ``leaf`` on one rank of this pipeline rank's share."""
    n = _leaf_on_rank(leaf, share, tied)
    per = math.prod(leaf.local[1:]) if leaf.stack is not None else math.prod(leaf.local)
    return per * n


def state_bytes(state: Any, params: Any, local_bytes: Callable[[str, int], int]) -> int:
    """Bytes of an optimizer state on one rank: every subtree shaped like ``params`` is sharded
    as the parameters (``local_bytes(path, itemsize)``), every other leaf is replicated.

    Example:
        state_bytes(opt.init(meta_params), meta_params, lambda path, size: numel[path] * size)
    """
    params_def = optree.tree_structure(params, none_is_leaf=False)
    like_params = lambda x: optree.tree_structure(x, none_is_leaf=False) == params_def  # noqa: E731
    paths = [p for p, _ in flatten_with_paths(params)]
    total = 0
    for sub in optree.tree_leaves(state, is_leaf=like_params, none_is_leaf=False):
        if like_params(sub):
            total += sum(local_bytes(p, x.element_size()) for p, x in zip(paths, optree.tree_leaves(sub)))
        else:
            total += sub.numel() * sub.element_size()
    return total


def memory_bytes(cfg, layout: Layout, *, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Exact ``{"params", "grads", "opt_state"}`` bytes on each pipeline rank, for the full model.

    Nothing is allocated: shapes from ``model.init(..., device="meta")``, specs from the rules,
    and the optimizer state from ``make_optimizer(cfg.train).init`` on the meta parameters.

    Example:
        memory_bytes(cfg, Layout(ep=64, dp=16))[0]["params"]
    """
    from shardfn import models
    from shardfn.runtime.train import make_optimizer

    model = models.get(cfg.model_name)
    leaves = _leaves(model, cfg.model, layout.axes(), cfg.rules, dtype)
    by_path = {leaf.path: leaf for leaf in leaves}
    tied = bool(getattr(cfg.model, "tie_embeddings", False))
    params = _meta_params(model, cfg.model, dtype)
    state = make_optimizer(cfg.train).init(params)
    out = []
    for share in _rank_shares(cfg.model, layout):
        p = sum(_local_numel(leaf, share, tied) * leaf.itemsize for leaf in leaves)
        opt = state_bytes(state, params, lambda path, size, s=share: _local_numel(by_path[path], s, tied) * size)
        out.append({"params": p, "grads": p, "opt_state": opt})
    return out


# ============================================================================ tracing a representative step

Comm = dict
"""``{(op, axis): (bytes, count)}``: collectives per rank, summed by op and mesh axis."""


def _comm_add(a: Comm, b: Comm, scale: float = 1) -> Comm:
    out = dict(a)
    for key, (nbytes, count) in b.items():
        b0, c0 = out.get(key, (0, 0))
        out[key] = (b0 + scale * nbytes, c0 + scale * count)
    return out


def _comm_round(c: Comm) -> Comm:
    return {k: (int(round(b)), int(round(n))) for k, (b, n) in c.items() if round(n) or round(b)}


@dataclass(frozen=True)
class _Measure:
    """What one lowered step measures on one rank, for one microbatch."""

    saved_bytes: int                 # forward values the backward reads
    mb_comm: Comm                    # collectives of the forward and backward
    leaf_comm: dict                  # parameter path -> its gradient reduction (per step)
    shared_comm: Comm                # the other per-step collectives (optimizer, outputs)
    peak_temporary_bytes: int        # report.peak_temporary_bytes of the whole program
    nodes: int


@dataclass(frozen=True)
class Profile:
    """Per-microbatch quantities of a layout's mesh (``pp`` left out) at one microbatch size,
    from lowering representative steps: ``base`` (what is not a layer) plus ``per_layer[stack]``
    per layer of each stack, each ``(saved activation bytes, collectives)``; the gradient
    reductions per parameter (``leaf_comm``, as traced with ``traced_layers`` layers) and the
    other per-step collectives (``shared_comm``).

    Example:
        prof = profile(cfg, {"dp": 16, "fsdp": 1, "ep": 64, "tp": 1}, rows=1)
        prof.per_layer["moe_layers"][0]      # saved bytes of one MoE layer, per microbatch
    """

    axes: dict
    rows: int
    base: tuple
    per_layer: dict
    leaf_comm: dict
    traced_layers: dict
    shared_comm: Comm
    full: bool
    traces: tuple                      # ({"layers": {...}, "seconds": s, "nodes": n}, ...)

    @property
    def seconds(self) -> float:
        return sum(t["seconds"] for t in self.traces)


@contextlib.contextmanager
def _quiet_dtensor():
    """DTensor warns once per multi-axis reduction; a plan prints its own summary instead."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _representative(cfg, model_cfg, axes: Mapping[str, int], rows: int):
    """``cfg`` with a reduced model, the mesh ``axes`` (no pp), one microbatch of ``rows`` rows per rank."""
    data = axes.get("dp", 1) * axes.get("fsdp", 1) * axes.get("ep", 1)
    mesh = dataclasses.replace(cfg.mesh, pp=1, **{a: axes.get(a, 1) for a in ("dp", "fsdp", "ep", "tp")})
    train = dataclasses.replace(cfg.train, batch_size=rows * data, compile=False)
    pipeline = dataclasses.replace(cfg.pipeline, microbatches=1, stages=None)
    return dataclasses.replace(cfg, model=model_cfg, mesh=mesh, train=train, pipeline=pipeline)


def lower_step(cfg, *, dtype: torch.dtype = torch.float32):
    """The run's train step lowered on a fake mesh of ``cfg.mesh`` (pp left out), with fake
    parameters, optimizer state and batch: nothing is allocated or run.

    Example:
        lowered = lower_step(load_config("llama_tiny", ["mesh.dp=2", "mesh.tp=2"]))
        lowered.comm_report(), lowered.memory_report()
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardfn import models
    from shardfn.runtime.partitioned import mesh_axes, partitioned_step
    from shardfn.runtime.train import make_optimizer

    model = models.get(cfg.model_name)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = model.init(cfg.model, 0, dtype=dtype)
        optimizer = make_optimizer(cfg.train)
        state = optimizer.init(params)
        batch = {"inputs": torch.zeros(b, s, dtype=torch.long), "targets": torch.zeros(b, s, dtype=torch.long)}
    mesh = _fake_mesh(mesh_axes(cfg))
    step = partitioned_step(cfg, model, optimizer, params, state, mesh, backend=None)
    with _quiet_dtensor():
        return step.jitted.lower(params, state, batch)


_MESHES: dict = {"world": None, "meshes": {}}


def _fake_mesh(axes: Mapping[str, int]):
    """A mesh of ``axes`` on torch's fake process group, one per shape while that group lives.

    DTensor caches sharding decisions keyed by meshes that compare equal, so a second mesh of a
    shape already seen would get collectives on the first one's process groups; the planner
    reuses its mesh, and clears that cache when the fake group is rebuilt (another world size).
    """
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # the one private torch API here

    from shardfn.partition.mesh import Mesh

    key = tuple(axes.items())
    alive = dist.is_initialized() and dist.group.WORLD is _MESHES["world"]
    if alive and key in _MESHES["meshes"]:
        return _MESHES["meshes"][key]
    mesh = Mesh(dict(axes), fake=True)
    if dist.group.WORLD is not _MESHES["world"]:
        _clear_sharding_prop_cache()
        _MESHES.update(world=dist.group.WORLD, meshes={})
    _MESHES["meshes"][key] = mesh
    return mesh


def _reachable(roots: Iterable[torch.fx.Node], neighbours: Callable[[torch.fx.Node], Iterable]) -> set:
    """The nodes reachable from ``roots`` (included) by following ``neighbours``."""
    seen, todo = set(), list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(neighbours(n))
    return seen


def _ancestors(roots: Iterable[torch.fx.Node]) -> set:
    return _reachable(roots, lambda n: n.all_input_nodes)


def _descendants(roots: Iterable[torch.fx.Node]) -> set:
    return _reachable(roots, lambda n: n.users)


def _output_index(traced, path: tuple) -> int:
    tree = optree.tree_unflatten(traced.out_treedef, list(range(len(traced.out_meta))))
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    for p, leaf in zip(paths, leaves):
        if tuple(p) == path:
            return leaf
    raise KeyError(f"the train step returns no output at {path}")


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return 0


def saved_bytes(gm: torch.fx.GraphModule, loss: torch.fx.Node) -> int:
    """Bytes of the forward values the backward reads: values ``loss`` depends on that a node
    outside the forward also uses (views count as their base; inputs are not counted).

    Example:
        saved_bytes(lowered.graph_module, loss_node)
    """
    from shardfn.partition.report import _is_view

    forward = _ancestors([loss])
    bases = set()
    for n in forward:
        if n.op != "call_function" or all(u in forward for u in n.users):
            continue
        base = n
        while _is_view(base) and base.args and isinstance(base.args[0], torch.fx.Node):
            base = base.args[0]
        if base.op == "call_function":
            bases.add(base)
    return sum(_nbytes(b.meta.get("val")) for b in bases)


def _gradient_reductions(global_gm: torch.fx.GraphModule) -> tuple[list, set]:
    """The constraints on the gradients (constrain nodes with no constraint after them) and
    the names of every node from them on (the per-step part of the program)."""
    constrain = torch.ops.shardfn.constrain.default
    nodes = list(global_gm.graph.nodes)
    later: dict = {}
    for n in reversed(nodes):
        later[n] = any(u.target is constrain or later[u] for u in n.users)
    sinks = [n for n in nodes if n.op == "call_function" and n.target is constrain and not later[n]]
    return sinks, {n.name for n in _descendants(sinks)}


def measure(lowered) -> _Measure:
    """Saved activation bytes and collectives of a lowered train step, split into the
    per-microbatch part (forward and backward), the gradient reduction of each parameter and
    the rest of the per-step part.

    Example:
        m = measure(lower_step(cfg)); m.saved_bytes, m.mb_comm
    """
    from shardfn.partition.report import collectives, peak_temporary_bytes

    gm, traced = lowered.graph_module, lowered.traced
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    loss = outputs[_output_index(traced, (2, "loss"))]
    sinks, step_nodes = _gradient_reductions(traced.graph_module)
    params = [(p.partition(".")[2], m) for p, m in zip(traced.in_paths, traced.in_meta) if p.startswith("0.")]
    leaf_of = _match_leaves(sinks, params)
    mb, shared, leaf = {}, {}, {}
    for row in collectives(gm, lowered.mesh):
        key, one = (row["op"], row["axis"]), {(row["op"], row["axis"]): (row["bytes"], 1)}
        if row["node"] in leaf_of:
            path = leaf_of[row["node"]]
            leaf[path] = _comm_add(leaf.get(path, {}), one)
        elif row["node"] in step_nodes or row["node"] == "output":
            shared = _comm_add(shared, one)
        else:
            mb = _comm_add(mb, one)
    return _Measure(saved_bytes(gm, loss), mb, leaf, shared, peak_temporary_bytes(gm), len(gm.graph.nodes))


def _match_leaves(sinks: list, params: list) -> dict:
    """Gradient-constraint node name -> parameter path: in order, when shapes agree."""
    if len(sinks) != len(params):
        return {}
    out = {}
    for node, (path, meta) in zip(sinks, params):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or tuple(val.shape) != tuple(meta.shape):
            return {}
        out[node.name] = path
    return out


def _trace(cfg, counts: Mapping[str, int], axes, rows, dtype) -> tuple[_Measure, dict]:
    rep = _representative(cfg, _with_layers(cfg.model, counts), axes, rows)
    tic = time.perf_counter()
    m = measure(lower_step(rep, dtype=dtype))
    return m, {"layers": dict(counts), "seconds": round(time.perf_counter() - tic, 3), "nodes": m.nodes}


_PROFILES: dict = {}


def profile(cfg, axes: Mapping[str, int], rows: int, *, dtype: torch.dtype = torch.float32,
            full: bool | None = None, cache: dict | None = _PROFILES) -> Profile:
    """The per-microbatch :class:`Profile` of ``cfg``'s model on a mesh of ``axes`` at ``rows``
    rows per rank and microbatch (cached per model, rules, axes, rows, dtype and sequence).

    ``full=None`` traces the whole model when it has at most :data:`FULL_TRACE_MAX_LAYERS`
    layers; otherwise one layer per stack, then each stack once more, and the differences.

    Example:
        prof = profile(cfg, {"dp": 2, "fsdp": 1, "ep": 1, "tp": 2}, rows=4)
    """
    axes = {a: axes.get(a, 1) for a in MESH_ORDER if a != "pp"}
    stacks = _stacks(cfg.model)
    if full is None:
        full = cfg.model.n_layers <= FULL_TRACE_MAX_LAYERS
    key = (repr(cfg.model), repr(sorted((k, repr(v)) for k, v in cfg.rules.items())), tuple(axes.items()), rows,
           str(dtype), cfg.train.seq_len, repr(cfg.train), full)
    if cache is not None and key in cache:
        return cache[key]
    if full:
        counts = dict(stacks)
        m, info = _trace(cfg, counts, axes, rows, dtype)
        prof = Profile(axes, rows, (m.saved_bytes, m.mb_comm), {}, m.leaf_comm, counts, m.shared_comm, True, (info,))
    else:
        base_counts = {k: 1 for k, _ in stacks}
        base, info = _trace(cfg, base_counts, axes, rows, dtype)
        infos, per_layer = [info], {}
        for k, _ in stacks:
            more, info = _trace(cfg, {**base_counts, k: 2}, axes, rows, dtype)
            infos.append(info)
            per_layer[k] = (more.saved_bytes - base.saved_bytes, _comm_round(_comm_add(more.mb_comm, base.mb_comm, -1)))
        const_saved = base.saved_bytes - sum(s for s, _ in per_layer.values())
        const_comm = base.mb_comm
        for _, c in per_layer.values():
            const_comm = _comm_add(const_comm, c, -1)
        prof = Profile(axes, rows, (const_saved, _comm_round(const_comm)), per_layer, base.leaf_comm, base_counts,
                       base.shared_comm, False, tuple(infos))
    if cache is not None:
        cache[key] = prof
    return prof


# ============================================================================ the plan


@dataclass
class Plan:
    """A layout's numbers per rank (see the module docstring for where each comes from).

    ``per_rank`` is the binding pipeline rank (the largest peak memory); ``ranks`` has every
    pipeline rank; ``comm`` lists the binding rank's collectives per step
    (``{op, axis, bytes, count, source}``, ``source`` one of ``trace``, ``estimate``, ``schedule``).
    :meth:`to_dict` is the JSON form (keys in docs/plan.md).

    Example:
        plan = make_plan(cfg); plan.fits, plan.time["step_s"], plan.to_dict()["per_rank"]
    """

    model: str
    config: str | None
    hardware: str
    dtype: str
    layout: Layout
    batch: dict
    params: dict
    per_rank: dict
    ranks: list
    comm: list
    time: dict
    capacity_bytes: int
    fits: bool
    trace: dict
    notes: list = field(default_factory=list)

    @property
    def comm_by_axis(self) -> dict:
        """Bytes per step per mesh axis of the binding rank."""
        return _by_axis(self.comm)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "config": self.config, "hardware": self.hardware, "dtype": self.dtype,
            "layout": self.layout.to_dict(), "batch": dict(self.batch), "params": dict(self.params),
            "per_rank": dict(self.per_rank), "ranks": [dict(r) for r in self.ranks],
            "comm": [dict(r) for r in self.comm], "comm_by_axis": self.comm_by_axis, "time": dict(self.time),
            "memory_capacity_bytes": self.capacity_bytes, "fits": self.fits,
            "headroom_bytes": self.capacity_bytes - self.per_rank["peak_bytes"],
            "trace": dict(self.trace), "notes": list(self.notes),
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _intra_node(layout: Layout, hw: Hardware) -> dict[str, bool]:
    """Per axis: does its group stay inside a node (axes placed innermost first)?"""
    out, inner = {}, 1
    for a in PLACEMENT_ORDER:
        inner *= getattr(layout, a)
        out[a] = inner <= hw.gpus_per_node
    return out


def _collective_s(hw: Hardware, layout: Layout, intra: dict, op: str, axis: str, nbytes: float, count: float) -> float:
    if count <= 0:
        return 0.0
    size = getattr(layout, axis)
    if op == "p2p":
        bw, alpha = hw.link(intra["pp"])
        return count * (nbytes / count / bw + alpha)
    return count * hw.collective_time(op, nbytes / count, size, intra[axis])


@dataclass(frozen=True)
class _ModelFacts:
    """Per-layer parameter counts and attention sizes, for the FLOP estimate."""

    layer_params: dict      # stack -> params of one layer
    layer_active: dict      # stack -> params one token uses in one layer
    embed: int
    head: int               # final norm and output head
    attn_per_token_layer: float   # causal attention FLOPs (fwd + bwd) per token per layer / seq
    dim: int
    top_k: int


def _model_facts(model_cfg, leaves: Sequence[_Leaf]) -> _ModelFacts:
    stacks = dict(_stacks(model_cfg))
    params, active = {k: 0 for k in stacks}, {k: 0 for k in stacks}
    embed = head = 0
    n_experts, top_k = getattr(model_cfg, "n_experts", 1), getattr(model_cfg, "top_k", 1)
    for leaf in leaves:
        n = math.prod(leaf.shape)
        if leaf.stack is None:
            if leaf.path.split(".")[0] == "embed":
                embed += n
            else:
                head += n
            continue
        per_layer = n // leaf.shape[0]
        params[leaf.stack] += per_layer
        active[leaf.stack] += per_layer * top_k // n_experts if ".experts." in f".{leaf.path}." else per_layer
    if getattr(model_cfg, "attention", "gqa") == "mla":
        qk, v = model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim, model_cfg.v_head_dim
    else:
        qk = v = model_cfg.dim // model_cfg.n_heads
    # forward QK^T and AV: 2 * S * H * (qk + v) per token, halved for the causal mask; x3 with backward
    attn = 3.0 * model_cfg.n_heads * (qk + v)
    return _ModelFacts(params, active, embed, head, attn, model_cfg.dim, top_k)


def _stage_counts(model_cfg, layout: Layout) -> list[_RankShare]:
    """One share per stage (not per rank), for per-stage activations and compute."""
    out, stacks = [], _stacks(model_cfg)
    ranges = stage_layers(model_cfg.n_layers, layout.n_stages)
    for s, (lo, hi) in enumerate(ranges):
        counts, start = {}, 0
        for key, n in stacks:
            counts[key] = max(0, min(hi, start + n) - max(lo, start))
            start += n
        out.append(_RankShare(counts, s == 0, s == len(ranges) - 1, ((lo, hi),)))
    return out


def _stage_mb(prof: Profile, share: _RankShare) -> tuple[int, Comm]:
    """Saved activation bytes and collectives of one microbatch through one stage."""
    saved, comm = (prof.base if share.last else (0, {}))
    if prof.full:
        return saved, comm
    for key, n in share.counts.items():
        s, c = prof.per_layer[key]
        saved += n * s
        comm = _comm_add(comm, c, n)
    return saved, _comm_round(comm)


def _step_comm(prof: Profile, share: _RankShare, leaves: Sequence[_Leaf], tied: bool) -> Comm:
    """Per-step collectives of a rank: its parameters' gradient reductions and the shared rest."""
    comm = dict(prof.shared_comm)
    for leaf in leaves:
        c = prof.leaf_comm.get(leaf.path)
        if not c:
            continue
        n = _leaf_on_rank(leaf, share, tied)
        if leaf.stack is not None:
            traced = prof.traced_layers.get(leaf.stack, 1)
            c = {k: (b * n // traced, cnt if n else 0) for k, (b, cnt) in c.items()}
        elif not n:
            continue
        comm = _comm_add(comm, c)
    return _comm_round(comm)


def _inflight(layout: Layout, stage_act: Sequence[int]) -> tuple[list[int], list[int], list[dict]]:
    """Per pipeline rank: the most activation bytes held at once, the most microbatches held,
    and the P2P sends per step (from the schedule's actions; 1F1B when it is unavailable)."""
    return _inflight_for(layout.pp, layout.microbatches, layout.schedule, layout.virtual, tuple(stage_act))


@functools.lru_cache(maxsize=4096)
def _inflight_for(p: int, m: int, schedule: str, virtual: int | None, stage_act: tuple):
    layout = Layout(pp=p, microbatches=m, schedule=schedule, virtual=virtual)
    if p == 1:
        return [stage_act[0]], [1], [{}]
    try:
        sched = _schedule(layout)
    except ImportError:
        held = [min(m, p - r) for r in range(p)]
        sends = [{"SEND_F": m if r < p - 1 else 0, "SEND_B": m if r > 0 else 0} for r in range(p)]
        return [h * stage_act[r] for r, h in enumerate(held)], held, sends
    peak_bytes, peak_mb, sends = [], [], []
    for actions in sched.actions:
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


def _makespan_units(layout: Layout, costs: dict, comm_units: float) -> tuple[float, float]:
    """``(makespan, bubble)`` of the schedule in units of one stage forward."""
    p, m = layout.pp, layout.microbatches
    per_mb = costs["F"] + costs["B"]
    if p == 1:
        return m * per_mb, 0.0
    try:
        virtual = layout.stages_per_rank if layout.schedule == "interleaved_1f1b" else layout.virtual
        return _simulate_for(layout.schedule, p, m, virtual, tuple(sorted(costs.items())), comm_units)
    except ImportError:
        span = (m + p - 1) * per_mb + 2 * (p - 1) * comm_units
        return span, 1 - m * per_mb / span


def make_plan(cfg, layout: Layout | None = None, *, hardware: str | Hardware = "h200",
              dtype: torch.dtype = torch.float32, checkpointing: bool | None = None, gpus: int | None = None,
              full_trace: bool | None = None, profiles: dict | None = _PROFILES) -> Plan:
    """Plan ``cfg`` under ``layout`` (default: the config's own mesh and pipeline) on ``hardware``.

    Args:
        cfg: a run config (``shardfn.core.config.load_config``).
        layout: the layout to plan; default ``Layout.from_config(cfg)``.
        hardware: a profile name (``"h200"``) or ``Hardware``.
        dtype: parameter and compute dtype (the train step runs in the parameters' dtype).
        checkpointing: activation checkpointing on/off (overrides ``layout.checkpointing``).
        gpus: if given, the layout's world size must equal it.
        full_trace: trace the whole model (True), reduced and scaled (False), or by size (None).
        profiles: a cache of traced profiles shared between plans (``None``: no cache).

    Raises:
        PlanError: the layout cannot run; ``key`` names the config key (``mesh.ep``).

    Example:
        plan = make_plan(load_config("kimi_k2_1t"), hardware="h200")
        plan.per_rank["peak_bytes"] / 2**30, plan.fits
    """
    from shardfn import models

    layout = layout or Layout.from_config(cfg)
    if checkpointing is not None:
        layout = dataclasses.replace(layout, checkpointing=checkpointing)
    check_layout(cfg, layout, gpus=gpus)
    hw = load_hardware(hardware)
    model, mcfg = models.get(cfg.model_name), cfg.model
    tied = bool(getattr(mcfg, "tie_embeddings", False))
    leaves = _leaves(model, mcfg, layout.axes(), cfg.rules, dtype)
    facts = _model_facts(mcfg, leaves)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = cfg.train.batch_size // layout.data_size // layout.microbatches
    tokens_mb = rows * cfg.train.seq_len                    # tokens of one microbatch on one rank
    input_bytes = tokens_mb * mcfg.dim * itemsize           # one [mb, seq, dim] activation
    ep_bytes = tokens_mb * facts.top_k * mcfg.dim * itemsize  # one exchange's buffer

    if full_trace is None:
        full_trace = layout.pp == 1 and mcfg.n_layers <= FULL_TRACE_MAX_LAYERS
    if full_trace and layout.pp > 1:
        raise PlanError("mesh.pp", "a whole-model trace has no stages; plan pp > 1 with full_trace=False")
    prof = profile(cfg, layout.axes(include_pp=False), rows, dtype=dtype, full=full_trace, cache=profiles)
    stages = _stage_counts(mcfg, layout)
    stage_saved, stage_comm = zip(*[_stage_mb(prof, s) for s in stages])
    n_layers = [sum(s.counts.values()) for s in stages]
    if prof.full:  # the base holds every layer; checkpointing keeps each layer's input only
        layer_saved = {k: prof.base[0] // mcfg.n_layers for k, _ in _stacks(mcfg)}
        ckpt_saved = [n * input_bytes for n in n_layers]
    else:
        layer_saved = {k: s for k, (s, _) in prof.per_layer.items()}
        ckpt_saved = [n * input_bytes + (prof.base[0] if s.last else 0) for n, s in zip(n_layers, stages)]
    held, held_mb, sends = _inflight(layout, ckpt_saved if layout.checkpointing else list(stage_saved))

    memory = memory_bytes(cfg, layout, dtype=dtype)
    ranks, rank_comm = [], []
    for r, (share, owned) in enumerate(zip(_rank_shares(mcfg, layout), rank_stages(layout))):
        mb_comm = {}
        for s in owned:
            mb_comm = _comm_add(mb_comm, stage_comm[s])
        step_comm = _step_comm(prof, share, leaves, tied)
        rows_out = _comm_rows(mb_comm, layout.microbatches, step_comm)
        rows_out += _estimated_rows(layout, share, ep_bytes, input_bytes, sends[r])
        transient = _transient(leaves, share, layer_saved, layout, tied)
        mem = memory[r]
        ranks.append({
            "pp_rank": r, "stages": list(owned), "layers": [list(x) for x in share.layer_ranges],
            "layer_counts": dict(share.counts),
            "params_bytes": mem["params"], "grads_bytes": mem["grads"], "opt_state_bytes": mem["opt_state"],
            "activation_bytes_per_microbatch": sum(stage_saved[s] for s in owned),
            "activation_bytes_per_microbatch_checkpointed": sum(ckpt_saved[s] for s in owned),
            "inflight_microbatches": held_mb[r], "activation_bytes": held[r], "transient_bytes": transient,
            "peak_bytes": mem["params"] + mem["grads"] + mem["opt_state"] + held[r] + transient,
            "comm_bytes": _by_axis(rows_out),
        })
        rank_comm.append((rows_out, step_comm))

    hw_time = _step_time(cfg, layout, hw, facts, stages, stage_comm, [c for _, c in rank_comm], tokens_mb,
                         ep_bytes, input_bytes, dtype)
    b = max(range(len(ranks)), key=lambda i: ranks[i]["peak_bytes"])
    per_rank = {k: v for k, v in ranks[b].items() if k != "comm_bytes"}
    capacity = int(cfg.partition.memory_budget or hw.hbm_bytes)
    counts = model.param_counts(mcfg)
    notes = []
    if layout.ep > 1 and any(s.counts.get("moe_layers") for s in stages):
        notes.append("all_to_all over ep is estimated for uniform routing; the runtime records the real bytes")
    if not prof.full:
        notes.append("embedding, final norm, output head and loss are charged to the last stage")
    if layout.pp > 1 and any(getattr(layout, a) > 1 for a in ("fsdp", "tp")):
        notes.append("planned only: the pipeline executor composes mesh.pp with mesh.dp and mesh.ep so far")
    return Plan(
        model=cfg.model_name, config=cfg.source, hardware=hw.name, dtype=_dtype_name(dtype), layout=layout,
        batch={"global_rows": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
               "tokens_per_step": cfg.train.batch_size * cfg.train.seq_len, "microbatch_rows": rows,
               "tokens_per_microbatch_per_rank": tokens_mb},
        params={"total": int(counts["total"]), "active": int(counts["active"])},
        per_rank=per_rank, ranks=ranks, comm=rank_comm[b][0], time=hw_time, capacity_bytes=capacity,
        fits=per_rank["peak_bytes"] <= capacity,
        trace={"mode": "full" if prof.full else "scaled", "mesh": dict(prof.axes), "rows": prof.rows,
               "lowered": [dict(t) for t in prof.traces], "seconds": round(prof.seconds, 3)},
        notes=notes,
    )


def _by_axis(rows: Iterable[dict]) -> dict:
    out: dict = {}
    for row in rows:
        out[row["axis"]] = out.get(row["axis"], 0) + row["bytes"]
    return out


def _comm_rows(mb_comm: Comm, microbatches: int, step_comm: Comm) -> list[dict]:
    """Traced collectives per step: the per-microbatch ones ``microbatches`` times, then the rest."""
    total = _comm_add(step_comm, mb_comm, microbatches)
    order = {op: i for i, op in enumerate(_COMM_OPS)}
    rows = [{"op": op, "axis": axis, "bytes": int(b), "count": int(c), "source": "trace"}
            for (op, axis), (b, c) in total.items() if c]
    return sorted(rows, key=lambda r: (order.get(r["op"], 99), MESH_ORDER.index(r["axis"])))


def _estimated_rows(layout: Layout, share: _RankShare, ep_bytes: int, input_bytes: int, sends: dict) -> list[dict]:
    """The expert-parallel all-to-alls (uniform routing) and the P2P sends of one rank, per step."""
    out, m = [], layout.microbatches
    n_moe = share.counts.get("moe_layers", 0)
    if layout.ep > 1 and n_moe:
        off_rank = ep_bytes * (layout.ep - 1) // layout.ep
        out.append({"op": "all_to_all", "axis": "ep", "bytes": 4 * n_moe * m * off_rank, "count": 4 * n_moe * m,
                    "source": "estimate"})
    n = sum(sends.values())
    if n:
        out.append({"op": "p2p", "axis": "pp", "bytes": n * input_bytes, "count": n, "source": "schedule"})
    return out


def _transient(leaves: Sequence[_Leaf], share: _RankShare, layer_saved: dict, layout: Layout, tied: bool) -> int:
    """One layer's working set on top of what is held: its activations (recomputed, or their
    gradients during its backward) and, under fsdp, its parameters gathered for use."""
    gathered: dict = {}
    for leaf in leaves:
        if layout.fsdp == 1 or "fsdp" not in leaf.spec.axes() or not _leaf_on_rank(leaf, share, tied):
            continue
        key = leaf.stack or leaf.path
        gathered[key] = gathered.get(key, 0) + leaf.local_bytes(1 if leaf.stack else None) * layout.fsdp
    layers = [layer_saved.get(k, 0) + gathered.get(k, 0) for k, n in share.counts.items() if n]
    others = [v for k, v in gathered.items() if k not in share.counts]
    return max([0, *layers, *others])


def _step_time(cfg, layout: Layout, hw: Hardware, facts: _ModelFacts, stages, stage_comm, step_comms, tokens_mb,
               ep_bytes, input_bytes, dtype, *, p2p: bool = True) -> dict:
    """Seconds per step: the schedule's makespan over per-stage microbatch times, then the
    per-step collectives of the slowest rank (see the module docstring). ``p2p=False`` leaves
    the P2P delay out (a lower bound)."""
    mcfg, seq, m = cfg.model, cfg.train.seq_len, layout.microbatches
    intra = _intra_node(layout, hw)
    peak = hw.peak_flops(dtype)
    recompute = 8.0 / 6.0 if layout.checkpointing else 1.0

    def seconds(comm: Comm) -> float:
        return sum(_collective_s(hw, layout, intra, op, axis, b, c) for (op, axis), (b, c) in comm.items())

    compute, comm = [], []
    for share, c in zip(stages, stage_comm):
        params = sum(n * facts.layer_active[k] for k, n in share.counts.items())
        params += facts.embed * share.first + facts.head * share.last
        attn = sum(share.counts.values()) * facts.attn_per_token_layer * seq
        compute.append((6.0 * params + attn) * tokens_mb / layout.tp * recompute / peak)
        a2a = 4 * share.counts.get("moe_layers", 0) * hw.collective_time("all_to_all", ep_bytes, layout.ep, intra["ep"])
        comm.append(seconds(c) + a2a)
    per_mb = max(x + y for x, y in zip(compute, comm))       # the slowest stage sets the pace
    costs = {"F": 1.0, "B": 3.0 if layout.checkpointing else 2.0, "I": 2.0 if layout.checkpointing else 1.0, "W": 1.0}
    unit = per_mb / (costs["F"] + costs["B"])
    p2p_s = _collective_s(hw, layout, intra, "p2p", "pp", input_bytes, 1) if layout.pp > 1 and p2p else 0.0
    makespan, bubble = _makespan_units(layout, costs, p2p_s / unit if unit else 0.0)
    pipeline_s = makespan * unit
    step_comm_s = max(seconds(c) for c in step_comms)
    step_s = pipeline_s + step_comm_s
    tokens = cfg.train.batch_size * seq
    layers = sum(n for _, n in _stacks(mcfg))
    active = sum(n * facts.layer_active[k] for k, n in _stacks(mcfg)) + facts.embed + facts.head
    model_flops = (6.0 * active + layers * facts.attn_per_token_layer * seq) * tokens
    per_rank_stages = layout.stages_per_rank
    return {
        "compute_s": m * per_rank_stages * max(compute), "microbatch_comm_s": m * per_rank_stages * max(comm),
        "pipeline_s": pipeline_s, "bubble": bubble, "p2p_s": p2p_s, "step_comm_s": step_comm_s, "step_s": step_s,
        "tokens_per_s": tokens / step_s if step_s else None, "model_flops_per_step": model_flops,
        "peak_flops": peak, "mfu": model_flops / (step_s * layout.world_size * peak) if step_s else None,
        "intra_node": intra,
    }


# ============================================================================ search


@dataclass
class SearchResult:
    """What :func:`search` found: the fitting plans, fastest first, and what it left out.

    ``refused`` are layouts that cannot run (``{"layout", "key", "reason"}``); ``too_big`` those
    whose peak memory exceeds the device (``{"layout", "peak_bytes", "bound"}``, ``bound`` True
    when a lower bound already ruled them out without tracing); ``not_planned`` how many valid
    layouts were never planned because a lower bound on their step time was slower than the
    ``top`` fitting plans found.

    Example:
        found = search(cfg, gpus=1024); found.plans[0].layout.describe()
    """

    gpus: int
    plans: list
    too_big: list
    refused: list
    not_planned: int
    seconds: float
    traced_profiles: int

    def to_list(self) -> list[dict]:
        """The fitting plans as JSON objects, fastest first (``shardfn plan --search --json``)."""
        return [p.to_dict() for p in self.plans]

    def refused_by_key(self) -> dict[str, int]:
        out: dict = {}
        for r in self.refused:
            out[r["key"]] = out.get(r["key"], 0) + 1
        return out


def _mesh_candidates(cfg, gpus: int, max_tp: int) -> list[dict]:
    moe = hasattr(cfg.model, "n_experts")
    out = []
    for pp in _divisors(gpus):
        for tp in [d for d in _divisors(gpus // pp) if d <= max_tp]:
            for ep in (_divisors(gpus // pp // tp) if moe else [1]):
                for fsdp in _divisors(gpus // pp // tp // ep):
                    out.append({"pp": pp, "dp": gpus // pp // tp // ep // fsdp, "fsdp": fsdp, "ep": ep, "tp": tp})
    return out


def _microbatch_options(cfg, axes: dict) -> list[int]:
    data = axes["dp"] * axes["fsdp"] * axes["ep"]
    if cfg.train.batch_size % data:
        return [1]          # refused by the batch check, with its message
    per_rank = cfg.train.batch_size // data
    first = axes["pp"] if axes["pp"] > 1 else 1
    wanted = {first * 2 ** i for i in range(4)} | ({per_rank} if first <= per_rank <= 8 * first else set())
    return sorted(m for m in wanted if per_rank % m == 0) or [first]


def _fsdp_comm(leaves: Sequence[_Leaf], share: _RankShare, layout: Layout, tied: bool) -> tuple[Comm, Comm]:
    """The least ``fsdp`` traffic of a rank's share: per microbatch, each fsdp-sharded weight
    gathered once (``(bytes, count)``, bytes of the gathered output); per step, its gradient
    reduce-scattered once. Empty without ``fsdp``."""
    if layout.fsdp == 1:
        return {}, {}
    nbytes, count = 0, 0
    for leaf in leaves:
        layers = _leaf_on_rank(leaf, share, tied)
        if layers and "fsdp" in leaf.spec.axes():
            nbytes += leaf.local_bytes(layers if leaf.stack else None) * layout.fsdp
            count += 1
    if not count:
        return {}, {}
    return {("all_gather", "fsdp"): (nbytes, count)}, {("reduce_scatter", "fsdp"): (nbytes, count)}


def _lower_bounds(cfg, layout: Layout, hw: Hardware, dtype, facts, static: list[dict],
                  leaves: Sequence[_Leaf] = ()) -> tuple[int, float]:
    """``(peak bytes, step seconds)`` that the layout's plan cannot go below: the parameters,
    gradients and optimizer state plus each layer's input held for the in-flight microbatches;
    and the step time with no traced collective but the least ``fsdp`` traffic of ``leaves``
    (each sharded weight gathered once per microbatch, its gradient reduce-scattered once),
    besides compute, the estimated all-to-alls and P2P."""
    mcfg = cfg.model
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = cfg.train.batch_size // layout.data_size // layout.microbatches
    tokens_mb = rows * cfg.train.seq_len
    stages = _stage_counts(mcfg, layout)
    held_layers, _, _ = _inflight(layout, [sum(s.counts.values()) for s in stages])
    input_bytes = tokens_mb * mcfg.dim * itemsize
    peak = max(s["params"] + s["grads"] + s["opt_state"] + h * input_bytes for s, h in zip(static, held_layers))
    tied = bool(getattr(mcfg, "tie_embeddings", False))
    fsdp = [_fsdp_comm(leaves, share, layout, tied) for share in stages]
    t = _step_time(cfg, layout, hw, facts, stages, [mb for mb, _ in fsdp], [step for _, step in fsdp] or [{}],
                   tokens_mb, tokens_mb * facts.top_k * mcfg.dim * itemsize, input_bytes, dtype, p2p=False)
    return peak, t["step_s"]


def search(cfg, gpus: int, *, hardware: str | Hardware = "h200", dtype: torch.dtype = torch.float32,
           schedules: Sequence[str] = ("1f1b", "interleaved_1f1b", "zbh1", "dualpipev"),
           microbatches: Sequence[int] | None = None, checkpointing: Sequence[bool] = (False, True),
           max_tp: int | None = None, top: int = 10, progress: Callable[[str], Any] | None = None,
           profiles: dict | None = _PROFILES) -> SearchResult:
    """Layouts of ``cfg`` on ``gpus`` devices that fit, ranked by estimated step time.

    Every ``(pp, dp, fsdp, ep, tp)`` whose product is ``gpus`` (``tp`` up to ``max_tp``, default
    the hardware's ``gpus_per_node``) is combined with microbatch counts (``microbatches``, or
    ``pp x 1, 2, 4, 8``, and one row per microbatch when that is within that range), ``schedules`` (``1f1b`` alone when
    ``pp == 1``) and ``checkpointing``. Invalid layouts are refused with the key to change.
    The valid ones are ordered by a lower bound on their step time and planned in that order
    (one traced profile per distinct mesh and microbatch size), skipping any whose lower bound
    on peak memory already exceeds the device, until ``top`` fitting plans are found that no
    unplanned layout can beat.

    Example:
        found = search(load_config("kimi_k2_1t"), gpus=1024, hardware="h200", top=5)
        [p.layout.describe() for p in found.plans]
    """
    from shardfn import models

    tic = time.perf_counter()
    hw = load_hardware(hardware)
    model = models.get(cfg.model_name)
    max_tp = max_tp or hw.gpus_per_node
    capacity = int(cfg.partition.memory_budget or hw.hbm_bytes)
    facts = _model_facts(cfg.model, _leaves(model, cfg.model, {a: 1 for a in MESH_ORDER}, cfg.rules, dtype))
    refused, too_big, candidates = [], [], []
    for axes in _mesh_candidates(cfg, gpus, max_tp):
        mesh_layout = Layout(**axes)
        try:
            _check_mesh(cfg, mesh_layout)
        except PlanError as e:
            refused.append({"layout": mesh_layout.describe(), "key": e.key, "reason": str(e)})
            continue
        static_cache: dict = {}
        mesh_leaves = _leaves(model, cfg.model, mesh_layout.axes(), cfg.rules, dtype) if axes["fsdp"] > 1 else ()
        for m in (microbatches or _microbatch_options(cfg, axes)):
            for sched in (schedules if axes["pp"] > 1 else ("1f1b",)):
                for ckpt in checkpointing:
                    layout = Layout(**axes, microbatches=m, schedule=sched, checkpointing=ckpt)
                    try:
                        _check_pipeline(cfg, layout)
                        _check_batch(cfg, layout)
                    except PlanError as e:
                        refused.append({"layout": layout.describe(), "key": e.key, "reason": str(e)})
                        continue
                    skey = (layout.stages_per_rank, sched if layout.stages_per_rank > 1 else "")
                    if skey not in static_cache:
                        static_cache[skey] = memory_bytes(cfg, layout, dtype=dtype)
                    peak, step = _lower_bounds(cfg, layout, hw, dtype, facts, static_cache[skey], mesh_leaves)
                    if peak > capacity:
                        too_big.append({"layout": layout.describe(), "peak_bytes": peak, "bound": True})
                    else:
                        candidates.append((step, layout))
    candidates.sort(key=lambda c: (c[0], c[1].describe()))
    plans, planned, meshes = [], 0, set()
    for bound, layout in candidates:
        if len(plans) >= top and bound >= plans[top - 1].time["step_s"]:
            break
        if progress:
            progress(f"planning {layout.describe()} (bound {bound:.3g} s)")
        plan = make_plan(cfg, layout, hardware=hw, dtype=dtype, full_trace=False if layout.pp > 1 else None,
                         profiles=profiles)
        planned += 1
        meshes.add((tuple(layout.axes(include_pp=False).items()), plan.batch["microbatch_rows"]))
        if plan.fits:
            plans.append(plan)
            plans.sort(key=lambda p: p.time["step_s"])
        else:
            too_big.append({"layout": layout.describe(), "peak_bytes": plan.per_rank["peak_bytes"], "bound": False})
    return SearchResult(gpus, plans[:top] if top else plans, too_big, refused, len(candidates) - planned,
                        time.perf_counter() - tic, len(meshes))


# ============================================================================ text


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (``1.50 GiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def format_plan(plan: Plan) -> str:
    """A plan as the text ``shardfn plan`` prints.

    Example:
        print(format_plan(make_plan(cfg)))
    """
    lay, b, r, t = plan.layout, plan.batch, plan.per_rank, plan.time
    layers = ", ".join(f"{lo}-{hi - 1}" for lo, hi in r["layers"])
    lines = [
        f"plan: {plan.model} ({plan.config or 'config'}) on {lay.world_size} x {plan.hardware}, {plan.dtype}",
        f"layout: {lay.describe()}",
        f"batch: {b['global_rows']:,} x {b['seq_len']:,} = {_count(b['tokens_per_step'])} tokens per step; "
        f"microbatch {b['microbatch_rows']} rows ({b['tokens_per_microbatch_per_rank']:,} tokens) per rank",
        f"params: {_count(plan.params['total'])} total, {_count(plan.params['active'])} active per token",
        "",
        f"memory per rank (pp rank {r['pp_rank']} of {lay.pp}, layers {layers}; the largest peak)",
        f"  parameters        {_gib(r['params_bytes']):>14}",
        f"  gradients         {_gib(r['grads_bytes']):>14}",
        f"  optimizer state   {_gib(r['opt_state_bytes']):>14}",
        f"  activations       {_gib(r['activation_bytes']):>14}   at most {r['inflight_microbatches']} (stage, microbatch) "
        f"held{' with checkpointing' if lay.checkpointing else ''}; one microbatch through this rank saves "
        f"{_gib(r['activation_bytes_per_microbatch'])}, {_gib(r['activation_bytes_per_microbatch_checkpointed'])} "
        f"checkpointed",
        f"  transient         {_gib(r['transient_bytes']):>14}   one layer's working set",
        f"  peak              {_gib(r['peak_bytes']):>14}   of {_gib(plan.capacity_bytes)}: "
        f"{'fits' if plan.fits else 'DOES NOT FIT'}",
        "",
        f"collectives per step (pp rank {r['pp_rank']})",
    ]
    for row in plan.comm:
        tag = {"estimate": "  (estimate: uniform routing)", "schedule": "  (from the schedule)"}.get(row["source"], "")
        lines.append(f"  {row['op']:<15}{row['axis']:<6}{row['count']:>8,} x {_gib(row['bytes']):>14}{tag}")
    lines += [
        "",
        "step time (estimate; compute and communication not overlapped)",
        f"  compute {t['compute_s']:.3f} s + microbatch collectives {t['microbatch_comm_s']:.3f} s, "
        f"pipeline {t['pipeline_s']:.3f} s (bubble {t['bubble']:.1%}), gradient reductions {t['step_comm_s']:.3f} s",
        f"  step {t['step_s']:.3f} s, {t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%} "
        f"(peak {t['peak_flops'] / 1e12:,.0f} TFLOP/s per device)",
        "",
        f"traced: {plan.trace['mode']}, {len(plan.trace['lowered'])} lowered step(s) on mesh "
        f"{' '.join(f'{a}={n}' for a, n in plan.trace['mesh'].items() if n > 1) or '1 device'} "
        f"in {plan.trace['seconds']:.1f} s",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def format_search(result: SearchResult) -> str:
    """A search result as the table ``shardfn plan --search`` prints.

    Example:
        print(format_search(search(cfg, gpus=64)))
    """
    head = f"{'#':>3}  {'layout':<58}{'peak':>12}{'step s':>11}{'MFU':>8}{'tokens/s':>14}"
    lines = [f"layouts on {result.gpus} devices that fit, fastest first", head]
    for i, p in enumerate(result.plans, 1):
        lines.append(f"{i:>3}  {p.layout.describe():<58}{_gib(p.per_rank['peak_bytes']):>12}"
                     f"{p.time['step_s']:>11.4g}{p.time['mfu']:>8.1%}{p.time['tokens_per_s']:>14,.0f}")
    if not result.plans:
        lines.append("  (none: every valid layout exceeds the device memory)")
    lines.append("")
    lines.append(f"{len(result.too_big)} layouts do not fit, {result.not_planned} were not planned "
                 f"(a lower bound on their step time is slower than the layouts above); "
                 f"{result.traced_profiles} profiles (mesh, microbatch size) planned in {result.seconds:.1f} s")
    for key, n in sorted(result.refused_by_key().items()):
        example = next(r["reason"] for r in result.refused if r["key"] == key)
        lines.append(f"refused {n} layouts on {key}, e.g. {example}")
    return "\n".join(lines)
