"""The layouts of N devices that fit, fastest first.

    found = search(load_config("kimi_k2_1t"), gpus=1024, hardware="h200", top=5)
    [p.layout.describe() for p in found.plans]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from shardfn.partition.hardware import Hardware, load_hardware
from shardfn.partition.layouts import MESH_AXES, divisors
from shardfn.plan.estimate import make_plan, step_time
from shardfn.plan.inventory import Leaf, RankShare, leaf_on_rank, memory_bytes, mesh_leaves, model_facts, stage_shares
from shardfn.plan.layout import Layout, PlanError, check_layout_batch, check_mesh, check_pipeline, inflight
from shardfn.plan.profile import Comm


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
    from shardfn import models

    moe = "expert" in models.get(cfg.model_name).layout_units(cfg.model)
    out = []
    for pp in divisors(gpus):
        for tp in [d for d in divisors(gpus // pp) if d <= max_tp]:
            for ep in (divisors(gpus // pp // tp) if moe else [1]):
                for fsdp in divisors(gpus // pp // tp // ep):
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
    tokens_mb = rows * cfg.train.seq_len
    stages = stage_shares(model, cfg, layout, dtype)
    held_layers, _, _ = inflight(layout, [sum(s.counts.values()) for s in stages])
    input_bytes = tokens_mb * mcfg.dim * itemsize
    peak = max(s["params"] + s["grads"] + s["opt_state"] + h * input_bytes for s, h in zip(static, held_layers))
    tied = mcfg.tie_embeddings
    fsdp = [_fsdp_comm(leaves, share, layout, tied) for share in stages]
    t = step_time(cfg, layout, hw, facts, stages, [mb for mb, _ in fsdp], [step for _, step in fsdp] or [{}],
                   tokens_mb, tokens_mb * facts.top_k * mcfg.dim * itemsize, input_bytes, dtype, p2p=False)
    return peak, t["step_s"]


def search(cfg, gpus: int, *, hardware: str | Hardware = "h200", dtype: torch.dtype = torch.float32,
           schedules: Sequence[str] = ("1f1b", "interleaved_1f1b", "zbh1", "dualpipev"),
           microbatches: Sequence[int] | None = None, checkpointing: Sequence[bool] = (False, True),
           max_tp: int | None = None, top: int = 10, progress: Callable[[str], Any] | None = None,
           profiles: dict | None = None) -> SearchResult:
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
    profiles = {} if profiles is None else profiles  # one traced profile per mesh and microbatch size
    hw = load_hardware(hardware)
    model = models.get(cfg.model_name)
    max_tp = max_tp or hw.gpus_per_node
    capacity = int(cfg.partition.memory_budget or hw.hbm_bytes)
    facts = model_facts(model, cfg.model, mesh_leaves(model, cfg.model, {a: 1 for a in MESH_AXES}, cfg.rules, dtype))
    refused, too_big, candidates = [], [], []
    for axes in _mesh_candidates(cfg, gpus, max_tp):
        mesh_layout = Layout(**axes)
        try:
            check_mesh(cfg, mesh_layout)
        except PlanError as e:
            refused.append({"layout": mesh_layout.describe(), "key": e.key, "reason": str(e)})
            continue
        static_cache: dict = {}
        fsdp_leaves = mesh_leaves(model, cfg.model, mesh_layout.axes(), cfg.rules, dtype) if axes["fsdp"] > 1 else ()
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
                    skey = (layout.stages_per_rank, sched if layout.stages_per_rank > 1 else "")
                    if skey not in static_cache:
                        static_cache[skey] = memory_bytes(cfg, layout)  # fp32 master weights and state
                    peak, step = _lower_bounds(cfg, layout, hw, dtype, facts, static_cache[skey], fsdp_leaves)
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
