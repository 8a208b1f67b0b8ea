"""The plan of one layout: the estimate (step time, memory, fit), and the traced program's bytes
and collectives per rank (see ``shardfn.plan``).

    plan = make_plan(cfg, hardware="h200")
    plan.fits, plan.peak_bytes, plan.time["step_s"], plan.per_rank["params_bytes"]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from shardfn import models
from shardfn.partition.cost.hardware import Hardware
from shardfn.partition.cost.model import Rates
from shardfn.partition.layouts.axes import AXIS_ORDER
from shardfn.plan.inventory import (
    Leaf,
    ModelFacts,
    RankShare,
    layer_costs,
    leaf_on_rank,
    memory_bytes,
    mesh_leaves,
    model_facts,
    rank_shares,
    stage_shares,
)
from shardfn.plan.layout import (
    Layout,
    PlanError,
    check_layout,
    inflight,
    intra_node,
    makespan_units,
    rank_stages,
)
from shardfn.plan.profile import FULL_TRACE_MAX_LAYERS, Comm, Profile, comm_add, comm_round, lower_pipeline, profile
from shardfn.plan.resolve import Resolved, resolve, run_config
from shardfn.runtime.train_step import precision_policy

COMM_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")
"""Collective kinds in report order."""


@dataclass
class Plan:
    """A layout's plan: the one estimate of the run, and the traced program's detail.

    The answer is the run model's (``plan.runmodel``, through :class:`~shardfn.plan.resolve.Resolved`):
    ``time`` (its terms, ``step_s``, ``tokens_per_s``, ``tokens_per_s_per_device``, ``mfu``),
    ``memory`` (its terms; ``reserved_bytes`` is what ``torch.cuda.max_memory_reserved`` reports,
    ``device_bytes`` adds the CUDA context and NCCL) and ``fits`` (``device_bytes`` within
    ``capacity_bytes``). The detail of the traced program, when it was traced: ``per_rank`` (the
    binding pipeline rank by the traced peak), ``ranks``, ``comm`` (the binding rank's collectives per
    step, ``{op, axis, bytes, count, source}``) and ``traced_time``, that program at datasheet peak
    with nothing overlapped (not the answer: a figure for reference). :meth:`to_dict` is the JSON
    form (keys in docs/plan.md).

    Example:
        plan = make_plan(cfg); plan.fits, plan.time["step_s"], plan.to_dict()["peak_bytes"]
    """

    model: str
    config: str | None
    hardware: str
    dtype: str
    layout: Layout
    batch: dict
    params: dict
    time: dict
    memory: dict
    capacity_bytes: int
    fits: bool
    per_rank: dict = field(default_factory=dict)
    ranks: list = field(default_factory=list)
    comm: list = field(default_factory=list)
    traced_time: dict = field(default_factory=dict)
    trace: dict = field(default_factory=lambda: {"mode": "none"})
    notes: list = field(default_factory=list)
    budgeted: bool = False  # capacity_bytes is partition.memory_budget, not the device's memory
    precision: str = "fp32"  # the run's train.precision, train.remat and train.compile the plan describes
    remat: str = "none"
    compile: bool = False
    run: dict = field(default_factory=dict)  # the run model's whole answer (plan.runmodel.run_estimate)

    @property
    def peak_bytes(self) -> float:
        """Peak reserved bytes per device (the caching allocator's, as TorchTitan reports memory)."""
        return self.memory["reserved_bytes"]

    @property
    def device_bytes(self) -> float:
        """Peak bytes on the device: reserved plus the CUDA context and NCCL's buffers (what ``fits`` compares)."""
        return self.memory["device_bytes"]

    @property
    def comm_by_axis(self) -> dict:
        """Bytes per step per mesh axis of the binding rank (traced)."""
        return by_axis(self.comm)

    def to_dict(self) -> dict:
        t = self.time
        return {
            "model": self.model, "config": self.config, "hardware": self.hardware, "dtype": self.dtype,
            "precision": self.precision, "remat": self.remat, "compile": self.compile,
            "layout": self.layout.to_dict(), "batch": dict(self.batch), "params": dict(self.params),
            "step_s": t["step_s"], "tokens_per_s": t["tokens_per_s"],
            "tokens_per_s_per_device": t["tokens_per_s_per_device"], "mfu": t["mfu"],
            "peak_bytes": self.peak_bytes, "device_bytes": self.device_bytes,
            "memory_capacity_bytes": self.capacity_bytes, "fits": self.fits,
            "headroom_bytes": self.capacity_bytes - self.device_bytes,
            "time": dict(t), "memory": dict(self.memory),
            "per_rank": dict(self.per_rank), "ranks": [dict(r) for r in self.ranks],
            "comm": [dict(r) for r in self.comm], "comm_by_axis": self.comm_by_axis,
            "traced_time": dict(self.traced_time), "trace": dict(self.trace), "notes": list(self.notes),
            "run": dict(self.run),
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def collective_seconds(rates: Rates, layout: Layout, intra: dict, op: str, axis: str, nbytes: float,
                       count: float) -> float:
    """``count`` collectives of ``nbytes`` in all on ``axis`` (``"p2p"``: pipeline sends)."""
    if count <= 0:
        return 0.0
    if op == "p2p":
        return count * rates.p2p_s(nbytes / count, intra["pp"])
    return count * rates.collective_s(op, nbytes / count, getattr(layout, axis), intra[axis])


def _stage_mb(prof: Profile, share: RankShare) -> tuple[int, Comm]:
    """Saved activation bytes and collectives of one microbatch through one stage."""
    saved, comm = (prof.base if share.last else (0, {}))
    if prof.full:
        return saved, comm
    for key, n in share.counts.items():
        s, c = prof.per_layer[key]
        saved += n * s
        comm = comm_add(comm, c, n)
    return saved, comm_round(comm)


def _step_comm(prof: Profile, share: RankShare, leaves: Sequence[Leaf], tied: bool) -> Comm:
    """Per-step collectives of a rank: its parameters' gradient reductions and the shared rest."""
    comm = dict(prof.shared_comm)
    for leaf in leaves:
        c = prof.leaf_comm.get(leaf.path)
        if not c:
            continue
        n = leaf_on_rank(leaf, share, tied)
        if leaf.stack is not None:
            traced = prof.traced_layers.get(leaf.stack, 1)
            c = {k: (b * n // traced, cnt if n else 0) for k, (b, cnt) in c.items()}
        elif not n:
            continue
        comm = comm_add(comm, c)
    return comm_round(comm)



def profile_key(cfg, layout: Layout, dtype: torch.dtype = torch.float32) -> tuple:
    """The key of the traced profile :func:`make_plan` uses for ``layout`` (in a ``profiles``
    cache): layouts that share it differ only in pipeline depth and schedule.

    Example:
        profile_key(cfg, Layout(pp=2, dp=4)) == profile_key(cfg, Layout(pp=4, dp=4))  # when rows agree
    """
    from shardfn.plan.profile import _profile_key

    run = run_config(cfg, dtype, layout.checkpointing)
    rows = run.train.batch_size // layout.data_size // layout.microbatches
    full = layout.pp == 1 and models.get(run.model_name).layer_count(run.model) <= FULL_TRACE_MAX_LAYERS
    return _profile_key(run, layout.axes(include_pp=False), rows, torch.float32, full)


def make_plan(cfg, layout: Layout | None = None, *, hardware: str | Hardware = "h200",
              dtype: torch.dtype = torch.float32, checkpointing: bool | None = None, gpus: int | None = None,
              full_trace: bool | None = None, profiles: dict | None = None, progress=None, trace: bool = True,
              resolved: Resolved | None = None) -> Plan:
    """Plan ``cfg`` under ``layout`` (default: the config's own mesh and pipeline) on ``hardware``.

    The answer (``time``, ``memory``, ``fits``) is the run model's estimate; with ``trace`` the
    run's own train step is also lowered on a fake mesh for the exact bytes and collectives per rank.

    Args:
        cfg: a run config (``shardfn.config.load_config``).
        layout: the layout to plan; default ``Layout.from_config(cfg)``.
        hardware: a profile name (``"h200"``) or ``Hardware``.
        dtype: ``torch.bfloat16`` plans the run with ``train.precision=bf16`` (fp32 master weights
            and optimizer state, bf16 compute); ``torch.float32`` keeps the config's own precision.
        checkpointing: True plans with ``train.remat=full``, False with ``none``; None: the
            ``layout``'s ``checkpointing`` when a layout is given, else the config's own
            ``train.remat``.
        gpus: if given, the layout's world size must equal it.
        full_trace: trace the whole model (True), reduced and scaled (False), or by size (None).
        profiles: a cache of traced profiles shared between plans (``None``: no cache).
        progress: called with a line as each lowering starts and ends (e.g. ``print``).
        trace: lower the step for the traced detail (False: the estimate alone, milliseconds).
        resolved: ``cfg`` already resolved (:func:`~shardfn.plan.resolve.resolve`; a search
            passes its own), in which case ``hardware`` and ``dtype`` are its.

    Raises:
        PlanError: the layout cannot run; ``key`` names the config key (``mesh.ep``).

    Example:
        plan = make_plan(load_config("kimi_k2_1t"), hardware="h200")
        plan.peak_bytes / 2**30, plan.fits, plan.time["tokens_per_s_per_device"]
    """
    if checkpointing is None and layout is not None:
        checkpointing = layout.checkpointing  # a layout to plan says it (the search tries both)
    run = (resolved or resolve(cfg, hardware=hardware, dtype=dtype)).with_checkpointing(checkpointing)
    cfg = run.cfg
    layout = dataclasses.replace(layout or Layout.from_config(cfg), checkpointing=cfg.train.remat != "none")
    check_layout(cfg, layout, gpus=gpus)
    est = run.estimate(layout)
    mcfg = cfg.model
    rows = cfg.train.batch_size // layout.data_size // layout.microbatches
    counts = run.model.param_counts(mcfg)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    compute = precision_policy(cfg.train).compute_dtype
    time = {**est["time"], "tokens_per_s": tokens / est["time"]["step_s"],
            "tokens_per_s_per_device": est["tokens_per_s_per_device"], "mfu": est["mfu"],
            "peak_flops": run.rates.peak(compute)}
    plan = Plan(
        model=cfg.model_name, config=cfg.source, hardware=run.hardware.name, dtype=_dtype_name(compute),
        layout=layout,
        batch={"global_rows": cfg.train.batch_size, "seq_len": cfg.train.seq_len, "tokens_per_step": tokens,
               "microbatch_rows": rows, "tokens_per_microbatch_per_rank": rows * cfg.train.seq_len // layout.cp},
        params={"total": int(counts["total"]), "active": int(counts["active"])},
        time=time, memory=est["memory"], capacity_bytes=run.capacity_bytes, fits=est["fits"],
        budgeted=run.budgeted, precision=cfg.train.precision, remat=cfg.train.remat, compile=est["compile"], run=est,
    )
    if layout.ep > 1 and est["time"]["ep_s"] > 0:
        plan.notes.append("all_to_all over ep is estimated for uniform routing; the runtime records the real bytes")
    if trace:
        _trace_detail(plan, run, cfg, full_trace=full_trace, profiles=profiles, progress=progress)
    return plan


def _trace_detail(plan: Plan, run: Resolved, cfg, *, full_trace, profiles, progress) -> None:
    """Lower ``plan``'s step on a fake mesh and fill in its traced detail: bytes and collectives
    per pipeline rank, and the traced program's time at peak with nothing overlapped."""
    layout, model, mcfg = plan.layout, run.model, cfg.model
    compute = precision_policy(cfg.train).compute_dtype
    dtype = torch.float32  # the parameters, gradients and optimizer state: master weights
    tied = model.ties_embeddings(mcfg)
    leaves = mesh_leaves(model, mcfg, layout.axes(), cfg.rules, dtype)
    facts = model_facts(model, mcfg, leaves)
    itemsize = torch.empty((), dtype=compute).element_size()  # activations and exchanges
    rows = plan.batch["microbatch_rows"]
    tokens_mb = plan.batch["tokens_per_microbatch_per_rank"]
    input_bytes = tokens_mb * model.embed_dim(mcfg) * itemsize           # one [mb, seq, dim] activation
    ep_bytes = tokens_mb * facts.top_k * model.embed_dim(mcfg) * itemsize  # one exchange's buffer

    if full_trace is None:
        full_trace = layout.pp == 1 and model.layer_count(mcfg) <= FULL_TRACE_MAX_LAYERS
    if full_trace and layout.pp > 1:
        raise PlanError("mesh.pp", "a whole-model trace has no stages; plan pp > 1 with full_trace=False")
    prof = profile(cfg, layout.axes(include_pp=False), rows, dtype=dtype, full=full_trace, cache=profiles,
                   progress=progress)
    stages = stage_shares(model, cfg, layout, dtype)
    stage_saved, stage_comm = zip(*[_stage_mb(prof, s) for s in stages])
    n_layers = [sum(s.counts.values()) for s in stages]
    if prof.full:  # the base holds every layer; checkpointing keeps each layer's input only
        layer_saved = {k: prof.base[0] // model.layer_count(mcfg) for k, _ in model.stacks(mcfg)}
        ckpt_saved = [n * input_bytes for n in n_layers]
    else:
        layer_saved = {k: s for k, (s, _) in prof.per_layer.items()}
        ckpt_saved = [n * input_bytes + (prof.base[0] if s.last else 0) for n, s in zip(n_layers, stages)]
    # the traced step is the run's own, remat pass included: what it saves is what the run holds
    held, held_mb, sends = inflight(layout, list(stage_saved))

    memory = memory_bytes(cfg, layout, dtype=dtype)
    # a small model under pp: its real stage programs, lowered on a fake mesh, give each rank's
    # bytes and collectives exactly (the run reports the same numbers)
    pipeline = lower_pipeline(cfg, layout, dtype=dtype) if layout.pp > 1 and _exact_pipeline(model, mcfg) else None
    ranks, rank_comm = [], []
    for r, (share, owned) in enumerate(zip(rank_shares(model, cfg, layout, dtype), rank_stages(layout))):
        mb_comm = {}
        for s in owned:
            mb_comm = comm_add(mb_comm, stage_comm[s])
        step_comm = _step_comm(prof, share, leaves, tied)
        if pipeline is not None:
            rows_out = _pipeline_rows(pipeline.comm_report(r))
            rows_out += [row for row in _estimated_rows(layout, share, ep_bytes, input_bytes, sends[r])
                         if row["op"] == "all_to_all"]
            mem = pipeline.memory_report(r)   # "gathered": parameters held gathered for the whole step
        else:
            rows_out = _comm_rows(mb_comm, layout.microbatches, step_comm)
            rows_out += _estimated_rows(layout, share, ep_bytes, input_bytes, sends[r])
            mem = memory[r]
        transient = _transient(leaves, share, layer_saved, layout, tied)
        ranks.append({
            "pp_rank": r, "stages": list(owned), "layers": [list(x) for x in share.layer_ranges],
            "layer_counts": dict(share.counts),
            "params_bytes": mem["params"], "grads_bytes": mem["grads"], "opt_state_bytes": mem["opt_state"],
            "activation_bytes_per_microbatch": sum(stage_saved[s] for s in owned),
            "activation_bytes_per_microbatch_checkpointed": sum(ckpt_saved[s] for s in owned),
            "inflight_microbatches": held_mb[r], "activation_bytes": held[r], "transient_bytes": transient,
            "gathered_bytes": mem.get("gathered", 0),
            # one device's program (pp 1, whole-model trace): its peak of the values it makes, as
            # the run's memory_report()["activations"]
            "step_temporary_bytes": prof.step_temporary_bytes if layout.pp == 1 and prof.full else None,
            "peak_bytes": (mem["params"] + mem["grads"] + mem["opt_state"] + mem.get("gathered", 0) + held[r]
                           + transient),
            "comm_bytes": by_axis(rows_out), "comm": rows_out,
        })
        rank_comm.append((rows_out, step_comm))

    b = max(range(len(ranks)), key=lambda i: ranks[i]["peak_bytes"])
    plan.per_rank = {k: v for k, v in ranks[b].items() if k not in ("comm_bytes", "comm")}
    plan.ranks, plan.comm = ranks, rank_comm[b][0]
    plan.traced_time = step_time(cfg, layout, run.hardware, facts, stages, stage_comm, [c for _, c in rank_comm],
                                 tokens_mb, ep_bytes, input_bytes, compute)
    plan.trace = {"mode": "full" if prof.full else "scaled", "mesh": dict(prof.axes), "rows": prof.rows,
                  "lowered": [dict(t) for t in prof.traces], "seconds": round(prof.seconds, 3)}
    if not prof.full:
        plan.notes.append("traced detail: embedding, final norm, output head and loss are charged to the last stage")
    if layout.n_stages > 1 and layer_costs(cfg.model_name, mcfg, rows, cfg.train.seq_len, dtype) is None:
        plan.notes.append("stages split by layer count: the loss has no cut between layers (a value each layer "
                          "makes reaches the final loss other than as a term of a sum)")
    if layout.pp > 1:
        plan.notes.append("bytes and collectives per rank from the lowered stage programs" if pipeline is not None
                          else "pipeline collectives from per-layer traces of the stage mesh; gradient sums held "
                               "unsharded over fsdp until the step's reduction")


def _exact_pipeline(model, model_cfg) -> bool:
    """Small enough to lower every stage's real programs when planning."""
    return model.layer_count(model_cfg) <= FULL_TRACE_MAX_LAYERS


def _pipeline_rows(rows: list[dict]) -> list[dict]:
    """A pipeline step's static comm report as plan rows (``source``: ``trace``, P2P ``schedule``)."""
    order = {op: i for i, op in enumerate(COMM_OPS)}
    out = [{**r, "source": "schedule" if r["op"] == "p2p" else "trace"} for r in rows if "layer" not in r]
    return sorted(out, key=lambda r: (order.get(r["op"], 99), AXIS_ORDER.index(r["axis"])))


def by_axis(rows: Iterable[dict]) -> dict:
    out: dict = {}
    for row in rows:
        out[row["axis"]] = out.get(row["axis"], 0) + row["bytes"]
    return out


def _comm_rows(mb_comm: Comm, microbatches: int, step_comm: Comm) -> list[dict]:
    """Traced collectives per step: the per-microbatch ones ``microbatches`` times, then the rest."""
    total = comm_add(step_comm, mb_comm, microbatches)
    order = {op: i for i, op in enumerate(COMM_OPS)}
    rows = [{"op": op, "axis": axis, "bytes": int(b), "count": int(c), "source": "trace"}
            for (op, axis), (b, c) in total.items() if c]
    return sorted(rows, key=lambda r: (order.get(r["op"], 99), AXIS_ORDER.index(r["axis"])))


def _estimated_rows(layout: Layout, share: RankShare, ep_bytes: int, input_bytes: int, sends: dict) -> list[dict]:
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


def _transient(leaves: Sequence[Leaf], share: RankShare, layer_saved: dict, layout: Layout, tied: bool) -> int:
    """One layer's working set on top of what is held: its activations (recomputed, or their
    gradients during its backward) and, under fsdp, its parameters gathered for use."""
    gathered: dict = {}
    for leaf in leaves:
        if layout.fsdp == 1 or "fsdp" not in leaf.spec.axes() or not leaf_on_rank(leaf, share, tied):
            continue
        key = leaf.stack or leaf.path
        gathered[key] = gathered.get(key, 0) + leaf.local_bytes(1 if leaf.stack else None) * layout.fsdp
    layers = [layer_saved.get(k, 0) + gathered.get(k, 0) for k, n in share.counts.items() if n]
    others = [v for k, v in gathered.items() if k not in share.counts]
    return max([0, *layers, *others])


def step_time(cfg, layout: Layout, hw: Hardware, facts: ModelFacts, stages, stage_comm, step_comms, tokens_mb,
               ep_bytes, input_bytes, dtype, *, p2p: bool = True) -> dict:
    """Seconds per step: the schedule's makespan over per-stage microbatch times, then the
    per-step collectives of the slowest rank (see the module docstring). ``p2p=False`` leaves
    the P2P delay out (a lower bound)."""
    seq, m = cfg.train.seq_len, layout.microbatches
    rates = Rates.of(hw, achieved=False)  # the traced program at datasheet peaks, nothing overlapped
    intra = intra_node(layout, hw)
    peak = rates.peak(dtype)
    recompute = 8.0 / 6.0 if layout.checkpointing else 1.0

    def seconds(comm: Comm) -> float:
        return sum(collective_seconds(rates, layout, intra, op, axis, b, c) for (op, axis), (b, c) in comm.items())

    compute, comm = [], []
    for share, c in zip(stages, stage_comm):
        params = sum(n * facts.layer_active[k] for k, n in share.counts.items())
        params += facts.embed * share.first + facts.head * share.last
        attn = sum(share.counts.values()) * facts.attn_per_token_layer * seq
        compute.append(rates.flops_s((6.0 * params + attn) * tokens_mb / layout.tp * recompute, dtype))
        a2a = 4 * share.counts.get("moe_layers", 0) * rates.all_to_all_s(ep_bytes, layout.ep, intra["ep"])
        comm.append(seconds(c) + a2a)
    per_mb = max(x + y for x, y in zip(compute, comm))       # the slowest stage sets the pace
    costs = {"F": 1.0, "B": 3.0 if layout.checkpointing else 2.0, "I": 2.0 if layout.checkpointing else 1.0, "W": 1.0}
    unit = per_mb / (costs["F"] + costs["B"])
    p2p_s = collective_seconds(rates, layout, intra, "p2p", "pp", input_bytes, 1) if layout.pp > 1 and p2p else 0.0
    makespan, bubble = makespan_units(layout, costs, p2p_s / unit if unit else 0.0)
    pipeline_s = makespan * unit
    step_comm_s = max(seconds(c) for c in step_comms)
    step_s = pipeline_s + step_comm_s
    tokens = cfg.train.batch_size * seq
    layers = sum(facts.stacks.values())
    active = sum(n * facts.layer_active[k] for k, n in facts.stacks.items()) + facts.embed + facts.head
    model_flops = (6.0 * active + layers * facts.attn_per_token_layer * seq) * tokens
    per_rank_stages = layout.stages_per_rank
    return {
        "compute_s": m * per_rank_stages * max(compute), "microbatch_comm_s": m * per_rank_stages * max(comm),
        "pipeline_s": pipeline_s, "bubble": bubble, "p2p_s": p2p_s, "step_comm_s": step_comm_s, "step_s": step_s,
        "tokens_per_s": tokens / step_s if step_s else None, "model_flops_per_step": model_flops,
        "peak_flops": peak, "mfu": model_flops / (step_s * layout.world_size * peak) if step_s else None,
        "intra_node": intra,
    }
