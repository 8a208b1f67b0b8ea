"""The layouts of N devices that fit, fastest first, by the one estimate.

Every valid layout is priced by the run model (``plan.runmodel``, through the resolved run of
``plan.resolve``), in closed form from its mesh's parameter shards: milliseconds each, with no
lowering, so the search ranks every layout it enumerates and its answer does not depend on the
machine's load. The work a search does is counted, not timed: the layouts it estimates, and the
``trace`` top layouts whose steps it lowers for the traced detail.

    found = search(load_config("kimi_k2_1t"), gpus=1024, hardware="h200", top=5)
    [p.layout.describe() for p in found.plans]
    found = search(cfg, gpus=512, reference=Layout(pp=8, fsdp=2, ep=32, microbatches=8, ...))
    found.reference["rank"], found.reference["why"]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from shardfn.core.units import format_bytes
from shardfn.partition.cost.hardware import Hardware
from shardfn.partition.layouts.axes import divisors
from shardfn.plan.estimate import make_plan
from shardfn.plan.layout import Layout, PlanError, check_layout, check_layout_batch, check_mesh, check_pipeline
from shardfn.plan.resolve import Resolved, resolve

STEP_TERMS = ("matmul_s", "attention_s", "memory_bound_s", "fsdp_exposed_s", "tp_s", "cp_s", "ep_exposed_s")
"""The per-microbatch terms of the estimate that :func:`step_terms` spreads over a step."""


@dataclass
class SearchResult:
    """What :func:`search` found: the fitting layouts, fastest first by the estimate.

    ``plans`` are the ``top`` fastest that fit (:class:`~shardfn.plan.estimate.Plan`; the first
    ``lowered`` of them with the traced detail). ``ranked`` is every fitting layout that could be
    among them (or faster than the reference) as ``(step_s, layout)``, fastest first: the
    ``fitting - len(ranked)`` others have a step-time bound slower than those; ``too_big`` those estimated not to fit
    (``{"layout", "device_bytes"}``); ``refused`` those that cannot run (``{"layout", "key",
    "reason"}``). ``reference``, when a layout was given to compare, says where it ranks and why
    (:func:`compare`). ``seconds`` is reported only: nothing in the answer depends on it.

    Example:
        found = search(cfg, gpus=1024); found.plans[0].layout.describe()
    """

    gpus: int
    plans: list
    ranked: list
    too_big: list
    refused: list
    estimated: int                # valid layouts the estimate priced
    seconds: float
    lowered: int = 0              # plans traced for their detail
    reference: dict | None = None
    capacity_bytes: int = 0
    budgeted: bool = False
    fitting: int = 0              # layouts that fit; ``ranked`` holds those whose schedule was simulated

    def to_list(self) -> list[dict]:
        """The fitting plans as JSON objects, fastest first (``shardfn plan --search --json``)."""
        return [p.to_dict() for p in self.plans]

    def refused_by_key(self) -> dict[str, int]:
        out: dict = {}
        for r in self.refused:
            out[r["key"]] = out.get(r["key"], 0) + 1
        return out

    def rank_of(self, layout: Layout) -> int | None:
        """1-based rank of ``layout`` among the fitting layouts (None: not among them)."""
        name = layout.describe()
        return next((i for i, (_, lay) in enumerate(self.ranked, 1) if lay.describe() == name), None)


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


def _mesh_candidates(cfg, gpus: int, max_tp: int, model=None) -> list[dict]:
    if model is None:
        from shardfn import models

        model = models.get(cfg.model_name)
    moe = "expert" in model.layout_units(cfg.model)
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


def _microbatch_options(cfg, axes: dict, given: Sequence[int] | None = None) -> list[int]:
    if axes["pp"] == 1:
        return [1]          # the runtime splits a step into microbatches under pp only
    if given:
        return list(given)
    data = axes["dp"] * axes["fsdp"] * axes["ep"]
    if cfg.train.batch_size % data:
        return [1]          # refused by the batch check, with its message
    per_rank = cfg.train.batch_size // data
    first = axes["pp"] if axes["pp"] > 1 else 1
    wanted = {first * 2 ** i for i in range(4)} | ({per_rank} if first <= per_rank <= 8 * first else set())
    return sorted(m for m in wanted if per_rank % m == 0) or [first]


def step_terms(est: dict) -> dict:
    """Where the estimate's step goes, in seconds per step that add up to ``step_s``: each
    per-microbatch term's share of the pipeline's busy time, the bubble, the optimizer, the
    exposed dp reduction and the fixed overhead.

    Example:
        step_terms(resolve(cfg).estimate(layout))["ep_exposed_s"]
    """
    t = est["time"]
    busy = t["pipeline_s"] * (1 - t["bubble"])
    per_mb = sum(t.get(k, 0.0) for k in STEP_TERMS) or 1.0
    out = {k: busy * t.get(k, 0.0) / per_mb for k in STEP_TERMS}
    out.update(bubble_s=t["pipeline_s"] * t["bubble"], optimizer_s=t["optimizer_s"], dp_exposed_s=t["dp_exposed_s"],
               fixed_s=t["fixed_s"])
    return out


def compare(top: dict, other: dict, *, terms: int = 3) -> str:
    """Why ``top``'s estimate is faster or slower than ``other``'s: the step-time terms
    (:func:`step_terms`) that differ most, largest first.

    Example:
        compare(run.estimate(best), run.estimate(published))   # "ep_exposed -1.2 s, bubble +0.4 s, ..."
    """
    a, b = step_terms(top), step_terms(other)
    diff = sorted(((a[k] - b[k], k) for k in a), key=lambda d: -abs(d[0]))
    return ", ".join(f"{k.removesuffix('_s')} {d:+.3g} s" for d, k in diff[:terms] if d)


def search(cfg, gpus: int, *, hardware: str | Hardware = "h200", dtype: torch.dtype = torch.float32,
           schedules: Sequence[str] = ("1f1b", "interleaved_1f1b", "zbh1", "dualpipev"),
           microbatches: Sequence[int] | None = None, checkpointing: Sequence[bool] = (False, True),
           max_tp: int | None = None, top: int = 10, progress: Callable[[str], Any] | None = None,
           trace: int = 0, reference: Layout | None = None, profiles: dict | None = None,
           resolved: Resolved | None = None) -> SearchResult:
    """Layouts of ``cfg`` on ``gpus`` devices that fit, ranked by the estimate's step time.

    Every ``(pp, dp, fsdp, ep, tp)`` whose product is ``gpus`` (``tp`` up to ``max_tp``, default
    the hardware's ``gpus_per_node``; ``cp`` too for long sequences) is combined with microbatch
    counts under pp (``microbatches``, or ``pp x 1, 2, 4, 8``, and one row per microbatch when
    that is within that range; without pp, one: the runtime splits a step only between
    stages), ``schedules`` (``1f1b`` alone when ``pp == 1``) and ``checkpointing``. Invalid
    layouts are refused with the key to change. Every valid one is estimated (``Resolved.
    estimate``: the answer ``shardfn plan`` prints for it); those whose device bytes
    exceed ``partition.memory_budget`` or the device are dropped, the rest ranked by step time
    (ties by name). The pipeline schedules are simulated in order of a step-time bound without
    the bubble, until no unsimulated layout can be faster than the ``top`` ones (or than
    ``reference``). The ``top`` fastest become plans; the first ``trace`` of them are lowered for
    their traced detail (a work budget, counted in layouts). ``reference``: a layout to place in
    the ranking, with the terms that make the top layout faster or slower than it.

    Example:
        found = search(load_config("kimi_k2_1t"), gpus=1024, hardware="h200", top=5)
        [p.layout.describe() for p in found.plans]
    """
    tic = time.perf_counter()
    say = progress or (lambda line: None)
    run = resolved or resolve(cfg, hardware=hardware, dtype=dtype)
    cfg = run.cfg
    max_tp = max_tp or run.hardware.gpus_per_node
    refused, too_big, candidates = [], [], []
    estimated = 0
    meshes = _mesh_candidates(cfg, gpus, max_tp, run.model)
    say(f"search: {len(meshes)} meshes of {gpus} devices; estimating every layout of them")
    for axes in meshes:
        mesh_layout = Layout(**axes)
        try:
            check_mesh(cfg, mesh_layout)
        except PlanError as e:
            refused.append({"layout": mesh_layout.describe(), "key": e.key, "reason": str(e)})
            continue
        for m in _microbatch_options(cfg, axes, microbatches):
            for sched in (schedules if axes["pp"] > 1 else ("1f1b",)):
                for ckpt in checkpointing:
                    layout = Layout(**axes, microbatches=m, schedule=sched, checkpointing=ckpt)
                    try:
                        check_layout_batch(cfg, layout)
                        floor = run.floor_bytes(layout)
                        if floor > run.capacity_bytes:  # over by what needs no schedule: none is built
                            too_big.append({"layout": layout.describe(), "device_bytes": floor})
                            continue
                        check_pipeline(cfg, layout)
                    except PlanError as e:
                        refused.append({"layout": layout.describe(), "key": e.key, "reason": str(e)})
                        continue
                    est = run.estimate(layout, bound=True)  # exact memory; step time without the bubble
                    estimated += 1
                    if est["fits"]:
                        candidates.append((est["time"]["step_s"], layout.describe(), layout))
                    else:
                        too_big.append({"layout": layout.describe(), "device_bytes": est["memory"]["device_bytes"]})
    # simulate the schedules in order of the bound until the top layouts (and every layout faster
    # than the reference) are known: what is left cannot beat them
    candidates.sort(key=lambda c: (c[0], c[1]))
    ref_step = run.estimate(reference)["time"]["step_s"] if reference is not None and _valid(run, reference, gpus) \
        else None
    ranked: list = []
    for bound, name, layout in candidates:
        kth = ranked[top - 1][0] if top and len(ranked) >= top else None
        if kth is not None and bound > kth and (ref_step is None or bound > ref_step):
            break
        ranked.append((run.estimate(layout)["time"]["step_s"], name, layout))
        ranked.sort(key=lambda r: (r[0], r[1]))
    say(f"search: {estimated} layouts estimated, {len(candidates)} fit ({len(ranked)} simulated), "
        f"{len(too_big)} do not, {len(refused)} refused")
    plans = []
    for i, (_, _, layout) in enumerate(ranked[:top] if top else ranked):
        traced = i < trace
        if traced:
            say(f"[{i + 1}] lowering {layout.describe()} for its traced detail")
        plans.append(make_plan(cfg, layout, resolved=run, trace=traced, profiles=profiles, progress=say))
    result = SearchResult(gpus, plans, [(s, lay) for s, _, lay in ranked], too_big, refused, estimated,
                          time.perf_counter() - tic, min(trace, len(plans)), None, run.capacity_bytes, run.budgeted,
                          len(candidates))
    if reference is not None:
        result.reference = _place(run, result, reference, gpus)
    result.seconds = time.perf_counter() - tic
    return result


def _valid(run: Resolved, layout: Layout, gpus: int) -> bool:
    try:
        check_layout(run.with_checkpointing(layout.checkpointing).cfg, layout, gpus=gpus)
    except PlanError:
        return False
    return True


def _place(run: Resolved, result: SearchResult, layout: Layout, gpus: int) -> dict:
    """Where ``layout`` ranks in ``result`` and why the top layout is faster or slower by the estimate."""
    out: dict = {"layout": layout.describe()}
    try:
        check_layout(run.with_checkpointing(layout.checkpointing).cfg, layout, gpus=gpus)
    except PlanError as e:
        return {**out, "rank": None, "fits": False, "reason": str(e)}
    est = run.estimate(layout)
    step = est["time"]["step_s"]
    rank = result.rank_of(layout)
    if rank is None and est["fits"]:  # valid and fitting but outside the enumerated options
        rank = 1 + sum(1 for s, _ in result.ranked if s < step)
    out.update(rank=rank, of=result.fitting, fits=est["fits"], step_s=step,
               tokens_per_s_per_device=est["tokens_per_s_per_device"], device_bytes=est["memory"]["device_bytes"])
    if result.plans:
        best = result.plans[0]
        out["top"] = best.layout.describe()
        out["top_step_s"] = best.time["step_s"]
        out["why"] = compare(best.run, est)
    return out


def format_reference(ref: dict, capacity: int) -> list[str]:
    """The reference layout's place in a search, as lines (see :func:`search`)."""
    if ref.get("reason"):
        return [f"reference {ref['layout']}: cannot run: {ref['reason']}"]
    mem = f"{format_bytes(ref['device_bytes'])} on the device of {format_bytes(capacity)}"
    if not ref["fits"]:
        head = f"reference {ref['layout']}: does not fit ({mem}); step {ref['step_s']:.4g} s"
    else:
        head = (f"reference {ref['layout']}: rank {ref['rank']} of {ref['of']} that fit, step {ref['step_s']:.4g} s, "
                f"{ref['tokens_per_s_per_device']:,.0f} tokens/s per device, {mem}")
    lines = [head]
    if "top" in ref:
        faster = "faster" if ref["top_step_s"] <= ref["step_s"] else "slower"
        lines.append(f"  the top layout is {abs(ref['step_s'] - ref['top_step_s']):.3g} s per step {faster}: "
                     f"{ref['why'] or 'the same terms'} (top minus reference, seconds per step)")
    return lines
