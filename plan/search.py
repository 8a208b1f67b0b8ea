"""The layouts of N devices that fit, fastest first.

    found = search(load_config("kimi_k2_1t"), gpus=1024, hardware="h200", top=5)
    [p.layout.describe() for p in found.plans]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from shardfn.core.units import format_bytes
from shardfn.partition.hardware import Hardware, load_hardware
from shardfn.partition.layouts import MESH_AXES, divisors
from shardfn.plan.estimate import make_plan, profile_key, step_time
from shardfn.plan.inventory import Leaf, RankShare, leaf_on_rank, memory_bytes, mesh_leaves, model_facts, stage_shares
from shardfn.plan.layout import Layout, PlanError, check_layout_batch, check_mesh, check_pipeline, inflight
from shardfn.plan.profile import Comm


@dataclass
class SearchResult:
    """What :func:`search` found: the fitting plans, fastest first, and what it left out.

    ``refused`` are layouts that cannot run (``{"layout", "key", "reason"}``); ``too_big`` those
    whose peak memory exceeds the device (``{"layout", "peak_bytes", "bound"}``, ``bound`` True
    when a lower bound already ruled them out without lowering their step: from shapes alone,
    or from the step traced but not lowered); ``not_planned`` how many valid layouts were never
    planned because a lower bound on their step time was slower than the ``top`` fitting plans
    found.

    Example:
        found = search(cfg, gpus=1024); found.plans[0].layout.describe()
    """

    gpus: int
    plans: list
    too_big: list
    refused: list
    not_planned: int
    seconds: float
    traced_profiles: int          # distinct profiles (mesh without pp, microbatch rows, remat) the plans used
    planned: int = 0              # layouts planned
    lowered: int = 0              # steps lowered for their profiles (three per new profile of a large model)
    traced: int = 0               # steps traced but not lowered, for the traced memory bound
    over_budget: int = 0          # of not_planned: left when the time budget was spent
    over_budget_bound: float | None = None  # the least step-time bound among those
    budget_s: float | None = None

    def to_list(self) -> list[dict]:
        """The fitting plans as JSON objects, fastest first (``shardfn plan --search --json``)."""
        return [p.to_dict() for p in self.plans]

    def refused_by_key(self) -> dict[str, int]:
        out: dict = {}
        for r in self.refused:
            out[r["key"]] = out.get(r["key"], 0) + 1
        return out


LONG_SEQUENCE = 8192
"""From this ``train.seq_len`` up the search also splits the sequence (``mesh.cp``), ..."""

MIN_CP_TOKENS = 2048
"""... keeping at least this many tokens of each sequence per context-parallel rank (below
that, the all-gathered K/V outweighs the activations it saves)."""


def cp_options(seq_len: int, ranks: int) -> list[int]:
    """The context-parallel sizes a search tries with ``ranks`` devices left: 1, and for a long
    sequence each divisor ``c`` that leaves every rank ``MIN_CP_TOKENS`` or more in ``2c`` equal chunks.

    Example:
        cp_options(32768, 64)   # [1, 2, 4, 8, 16]
    """
    if seq_len < LONG_SEQUENCE:
        return [1]
    return [c for c in divisors(ranks) if c == 1 or (seq_len % (2 * c) == 0 and seq_len // c >= MIN_CP_TOKENS)]


def _mesh_candidates(cfg, gpus: int, max_tp: int) -> list[dict]:
    from shardfn import models

    moe = "expert" in models.get(cfg.model_name).layout_units(cfg.model)
    out = []
    for pp in divisors(gpus):
        for tp in [d for d in divisors(gpus // pp) if d <= max_tp]:
            for cp in cp_options(cfg.train.seq_len, gpus // pp // tp):
                rest = gpus // pp // tp // cp
                for ep in (divisors(rest) if moe else [1]):
                    for fsdp in divisors(rest // ep):
                        out.append({"pp": pp, "dp": rest // ep // fsdp, "fsdp": fsdp, "ep": ep, "tp": tp,
                                    **({"cp": cp} if cp > 1 else {})})
    return out


def _microbatch_options(cfg, axes: dict) -> list[int]:
    data = axes["dp"] * axes["fsdp"] * axes["ep"]
    if cfg.train.batch_size % data:
        return [1]          # refused by the batch check, with its message
    per_rank = cfg.train.batch_size // data
    first = axes["pp"] if axes["pp"] > 1 else 1
    wanted = {first * 2 ** i for i in range(4)} | ({per_rank} if first <= per_rank <= 8 * first else set())
    return sorted(m for m in wanted if per_rank % m == 0) or [first]


def _static_key(layout: Layout) -> tuple:
    """What a mesh's parameter, gradient and optimizer bytes per pp rank depend on besides it."""
    return layout.stages_per_rank, layout.schedule if layout.stages_per_rank > 1 else ""


def _fsdp_comm(leaves: Sequence[Leaf], share: RankShare, layout: Layout, tied: bool) -> tuple[Comm, Comm]:
    """The least ``fsdp`` traffic of a rank's share: per microbatch, each fsdp-sharded weight
    gathered once (``(bytes, count)``, bytes of the gathered output); per step, its gradient
    reduce-scattered once. Empty without ``fsdp``."""
    if layout.fsdp == 1:
        return {}, {}
    nbytes, count = 0, 0
    for leaf in leaves:
        layers = leaf_on_rank(leaf, share, tied)
        if layers and "fsdp" in leaf.spec.axes():
            nbytes += leaf.local_bytes(layers if leaf.stack else None) * layout.fsdp
            count += 1
    if not count:
        return {}, {}
    return {("all_gather", "fsdp"): (nbytes, count)}, {("reduce_scatter", "fsdp"): (nbytes, count)}


def _lower_bounds(cfg, layout: Layout, hw: Hardware, dtype, facts, static: list[dict],
                  leaves: Sequence[Leaf] = ()) -> tuple[int, float]:
    """``(peak bytes, step seconds)`` that the layout's plan cannot go below: the parameters,
    gradients and optimizer state plus each layer's input held for the in-flight microbatches;
    and the step time with no traced collective but the least ``fsdp`` traffic of ``leaves``
    (each sharded weight gathered once per microbatch, its gradient reduce-scattered once),
    besides compute, the estimated all-to-alls and P2P."""
    from shardfn import models

    model, mcfg = models.get(cfg.model_name), cfg.model
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = cfg.train.batch_size // layout.data_size // layout.microbatches
    tokens_mb = rows * cfg.train.seq_len // layout.cp
    stages = stage_shares(model, cfg, layout)  # the plan's split (fp32 master weights)
    held_layers, _, _ = inflight(layout, [sum(s.counts.values()) for s in stages])
    input_bytes = tokens_mb * model.embed_dim(mcfg) * itemsize
    peak = max(s["params"] + s["grads"] + s["opt_state"] + h * input_bytes for s, h in zip(static, held_layers))
    tied = model.ties_embeddings(mcfg)
    fsdp = [_fsdp_comm(leaves, share, layout, tied) for share in stages]
    t = step_time(cfg, layout, hw, facts, stages, [mb for mb, _ in fsdp], [step for _, step in fsdp] or [{}],
                   tokens_mb, tokens_mb * facts.top_k * model.embed_dim(mcfg) * itemsize, input_bytes, dtype, p2p=False)
    return peak, t["step_s"]


def _traced_peak_bound(cfg, layout: Layout, dtype, static: list[dict], leaves: Sequence[Leaf], cache: dict) -> int:
    """A lower bound on the layout's peak memory from its step traced but not lowered
    (:func:`~shardfn.plan.profile.saved_profile`): each stage saves at least its share of the
    global program's saved activations over the stage mesh's ranks (and at least each layer's
    input, as :func:`_lower_bounds` counts), held for the schedule's in-flight microbatches,
    plus one layer's working set as the plan counts it (its activations so bounded, its
    weights gathered over ``fsdp``). ``cache`` keeps the traced programs' numbers."""
    from shardfn import models
    from shardfn.plan.estimate import FULL_TRACE_MAX_LAYERS, _transient, run_config
    from shardfn.plan.inventory import rank_shares
    from shardfn.plan.profile import saved_profile

    model, mcfg = models.get(cfg.model_name), cfg.model
    run = run_config(cfg, dtype, layout.checkpointing)
    rows = cfg.train.batch_size // layout.data_size // layout.microbatches
    itemsize = torch.empty((), dtype=dtype).element_size()
    input_bytes = rows * cfg.train.seq_len // layout.cp * model.embed_dim(mcfg) * itemsize
    full = layout.pp == 1 and model.layer_count(mcfg) <= FULL_TRACE_MAX_LAYERS  # as make_plan traces it
    ranks = layout.world_size // layout.pp
    low = saved_profile(run, layout.axes(include_pp=False), rows, full=full, cache=cache)
    stages = stage_shares(model, cfg, layout)
    if low.full:
        stage_low = [low.base // ranks]
        layer_low = {k: low.base // model.layer_count(mcfg) // ranks for k, _ in model.stacks(mcfg)}
    else:
        layer_low = {k: max(0, b) // ranks for k, b in low.per_layer.items()}
        stage_low = [sum(n * layer_low[k] for k, n in s.counts.items()) + (max(0, low.base) // ranks if s.last else 0)
                     for s in stages]
    stage_low = [max(lo, sum(s.counts.values()) * input_bytes) for lo, s in zip(stage_low, stages)]
    held, _, _ = inflight(layout, stage_low)
    tied = model.ties_embeddings(mcfg)
    peak = max(st["params"] + st["grads"] + st["opt_state"] + h + _transient(leaves, share, layer_low, layout, tied)
               for st, h, share in zip(static, held, rank_shares(model, cfg, layout)))
    return peak


def search(cfg, gpus: int, *, hardware: str | Hardware = "h200", dtype: torch.dtype = torch.float32,
           schedules: Sequence[str] = ("1f1b", "interleaved_1f1b", "zbh1", "dualpipev"),
           microbatches: Sequence[int] | None = None, checkpointing: Sequence[bool] = (False, True),
           max_tp: int | None = None, top: int = 10, progress: Callable[[str], Any] | None = None,
           budget_s: float | None = None,
           profiles: dict | None = None) -> SearchResult:
    """Layouts of ``cfg`` on ``gpus`` devices that fit, ranked by estimated step time.

    Every ``(pp, dp, fsdp, ep, tp)`` whose product is ``gpus`` (``tp`` up to ``max_tp``, default
    the hardware's ``gpus_per_node``) is combined with microbatch counts (``microbatches``, or
    ``pp x 1, 2, 4, 8``, and one row per microbatch when that is within that range), ``schedules`` (``1f1b`` alone when
    ``pp == 1``) and ``checkpointing``. Invalid layouts are refused with the key to change.
    The valid ones are ordered by a lower bound on their step time and planned in that order,
    skipping any whose lower bound on peak memory already exceeds the device, until ``top``
    fitting plans are found that no unplanned layout can beat. Layouts that share the mesh
    without ``pp``, the microbatch rows and checkpointing share one traced profile (``profiles``,
    a dict the caller may keep between searches), so pipeline depths and schedules cost no
    lowering of their own. ``progress`` (e.g. ``print``) hears what is bounded, planned and
    lowered, and how long each took. ``budget_s`` bounds the search's time: once it is spent no
    new mesh is lowered (layouts whose profile is already traced are still planned, a fraction of
    a second each), and the result says how many layouts were left and the least step-time bound
    among them (``None``: plan until the ``top`` plans are proven best).

    Example:
        found = search(load_config("kimi_k2_1t"), gpus=1024, hardware="h200", top=5)
        [p.layout.describe() for p in found.plans]
    """
    from shardfn import models

    tic = time.perf_counter()
    say = progress or (lambda line: None)
    profiles = {} if profiles is None else profiles  # one traced profile per mesh, microbatch rows and remat
    known = set(profiles)
    hw = load_hardware(hardware)
    model = models.get(cfg.model_name)
    max_tp = max_tp or hw.gpus_per_node
    capacity = int(cfg.partition.memory_budget or hw.hbm_bytes)
    facts = model_facts(model, cfg.model, mesh_leaves(model, cfg.model, {a: 1 for a in MESH_AXES}, cfg.rules, dtype))
    refused, too_big, candidates = [], [], []
    statics: dict = {}       # (mesh, stages per rank and schedule) -> memory_bytes per pp rank
    fsdp_leaves: dict = {}   # mesh -> its leaves, when it has fsdp (the bounds' least fsdp traffic)
    meshes = _mesh_candidates(cfg, gpus, max_tp)
    say(f"search: {len(meshes)} meshes of {gpus} devices; bounding the step time and memory of their layouts")
    last_said = time.perf_counter()
    for i, axes in enumerate(meshes):
        if time.perf_counter() - last_said > 2:
            say(f"  bounds: {i}/{len(meshes)} meshes, {len(candidates)} layouts ({time.perf_counter() - tic:.0f} s)")
            last_said = time.perf_counter()
        mesh_layout = Layout(**axes)
        try:
            check_mesh(cfg, mesh_layout)
        except PlanError as e:
            refused.append({"layout": mesh_layout.describe(), "key": e.key, "reason": str(e)})
            continue
        mesh = tuple(mesh_layout.axes().items())
        fsdp_leaves[mesh] = mesh_leaves(model, cfg.model, axes, cfg.rules, dtype) if axes["fsdp"] > 1 else ()
        for m in (microbatches or _microbatch_options(cfg, axes)):
            for sched in (schedules if axes["pp"] > 1 else ("1f1b",)):
                for ckpt in checkpointing:
                    layout = Layout(**axes, microbatches=m, schedule=sched, checkpointing=ckpt)
                    try:
                        check_pipeline(cfg, layout)
                        check_layout_batch(cfg, layout)
                    except PlanError as e:
                        refused.append({"layout": layout.describe(), "key": e.key, "reason": str(e)})
                        continue
                    skey = (mesh, _static_key(layout))
                    if skey not in statics:
                        statics[skey] = memory_bytes(cfg, layout)  # fp32 master weights and state
                    peak, step = _lower_bounds(cfg, layout, hw, dtype, facts, statics[skey], fsdp_leaves[mesh])
                    if peak > capacity:
                        too_big.append({"layout": layout.describe(), "peak_bytes": peak, "bound": True})
                    else:
                        candidates.append((step, layout))
    candidates.sort(key=lambda c: (c[0], c[1].describe()))
    say(f"search: {len(candidates)} layouts to plan in order of their step-time bound, {len(too_big)} whose "
        f"memory bound exceeds {format_bytes(capacity)}, {len(refused)} refused ({time.perf_counter() - tic:.1f} s)")
    plans, planned, used, skipped, saved = [], 0, set(), 0, {}
    pending, over_budget = list(candidates), []
    while pending:
        if top and len(plans) >= top:  # what cannot beat the top plans is not planned
            pending = [c for c in pending if c[0] < plans[top - 1].time["step_s"]]
            if not pending:
                break
        # a layout whose profile another layout already lowered costs a fraction of a second to
        # plan: those go first, so the top plans fill (and prune the rest) before a new lowering
        pick = next((c for c in pending if profile_key(cfg, c[1], dtype) in profiles), None)
        if pick is None:
            if budget_s is not None and time.perf_counter() - tic > budget_s:
                over_budget = pending
                say(f"search: the {budget_s:.0f} s budget is spent; {len(pending)} layouts (step >= "
                    f"{min(c[0] for c in pending):.3g} s) would need a new lowering and are not planned")
                break
            pick = pending[0]
        pending.remove(pick)
        bound, layout = pick
        started = time.perf_counter()
        mesh = tuple(layout.axes().items())
        peak = _traced_peak_bound(cfg, layout, dtype, statics[mesh, _static_key(layout)], fsdp_leaves[mesh], saved)
        if peak > capacity:
            skipped += 1
            too_big.append({"layout": layout.describe(), "peak_bytes": peak, "bound": True})
            say(f"[{planned + skipped}] {layout.describe()}: peak >= {format_bytes(peak)} by its traced step, "
                f"over {format_bytes(capacity)} ({time.perf_counter() - started:.1f} s)")
            continue
        say(f"[{planned + skipped + 1}] planning {layout.describe()} (step >= {bound:.3g} s)")
        plan = make_plan(cfg, layout, hardware=hw, dtype=dtype, full_trace=False if layout.pp > 1 else None,
                         profiles=profiles, progress=say)
        planned += 1
        used.add((tuple(plan.trace["mesh"].items()), plan.trace["rows"], plan.remat))
        say(f"  step {plan.time['step_s']:.3g} s, {format_bytes(plan.per_rank['peak_bytes'])} per rank: "
            f"{'fits' if plan.fits else 'does not fit'} ({time.perf_counter() - started:.1f} s)")
        if plan.fits:
            plans.append(plan)
            plans.sort(key=lambda p: p.time["step_s"])
        else:
            too_big.append({"layout": layout.describe(), "peak_bytes": plan.per_rank["peak_bytes"], "bound": False})
    lowered = sum(len(profiles[k].traces) for k in set(profiles) - known)
    return SearchResult(gpus, plans[:top] if top else plans, too_big, refused, len(candidates) - planned - skipped,
                        time.perf_counter() - tic, len(used), planned, lowered, sum(v.traces for v in saved.values()),
                        len(over_budget), min((c[0] for c in over_budget), default=None), budget_s)
