"""Run a pipeline schedule on this rank: F / I / W programs, P2P batches, traces.

:func:`run_schedule` executes one rank's action list from ``shardfn.partition.pipeline.schedules`` with the
stage programs of ``shardfn.partition.pipeline.split``: ``F`` runs a stage's forward and keeps the
values its backward needs per ``(stage, microbatch)``; ``I`` turns the output gradient into the
input gradient; ``W`` adds the parameter gradients into an accumulator; ``B`` is ``I`` then
``W``. Each run of adjacent communication actions is one ``batch_isend_irecv`` over the ``pp``
process group, posted where the schedule puts it; a receive is waited on where its tensor is
first used (the compute action that reads it), so a message travels while the compute before
that runs: in DualPipeV's overlapped pairs, the backward's gradient arrives during the other
chunk's forward. That only waits later than the blocking batches the schedule validator checks,
so a validated schedule cannot deadlock. Buffers have static shapes, known from the fake trace.
With ``overlap_pairs``, each overlapped pair (``partition.pipeline.schedules.pair_overlaps``: an ``F`` and
the other chunk's ``B``) runs as one step whose two members take turns at their MoE exchange
waits (``runtime.interleave``), one computing while the other's all-to-all is in flight; on a
GPU the second member runs on its own CUDA stream, joined with the rank's at the pair's start
and end. ``runtime.pipeline_step`` turns one run into a training step.

    out = run_schedule(pipe, get_schedule("1f1b", 2, 4), rank, held, microbatches, group=pp_group)
    out.loss, out.grads[rank]["layers.w1"]
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shardfn.core.pytree import flatten_with_paths
from shardfn.partition.pipeline.schedules import Action, Schedule, add_communication, group_steps, pair_overlaps
from shardfn.partition.pipeline.split import Pipeline
from shardfn.runtime.interleave import run_pair

# ----------------------------------------------------------------------------- one schedule run


@dataclass
class RunResult:
    """What :func:`run_schedule` returns for this rank.

    Attributes:
        loss: mean of the last stage's microbatch losses, plus the parts of the loss this rank's
            other stages compute (per-layer auxiliary losses; None when the rank has neither):
            their sum over the pp ranks is the loss.
        grads: ``stage -> {path: gradient}`` for this rank's stages, summed over microbatches
            with each loss scaled by ``1 / n_microbatches`` (the gradient of the mean loss).
        events: one dict per step (``name``, ``kind``, ``stage``, ``mb``, ``start_ns``,
            ``end_ns``; a compute step also ``in_flight``: the receives posted and not yet waited on as it
            ran; a ``WAIT_`` step of kind ``P2P``: time blocked on the receive it reads) when recording.
        peak_saved_bytes: the most bytes of values held for backward at once (activations,
            saved tensors and pending messages; parameters excluded).
        turns: ``(F cell, B cell, turn log)`` per overlapped pair run (``overlap_pairs=True``);
            the log is :func:`~shardfn.runtime.interleave.run_pair`'s ``(member, event, ns)``.
        aux: ``key -> `` this rank's part of each 0-d aux value, averaged over the microbatches
            (their sum over the pp ranks is the value).
    """

    loss: torch.Tensor | None
    grads: dict[int, dict[str, torch.Tensor]]
    events: list[dict] = field(default_factory=list)
    peak_saved_bytes: int = 0
    turns: list[tuple[str, str, list]] = field(default_factory=list)
    aux: dict[str, torch.Tensor] = field(default_factory=dict)


def check_fit(pipe: Pipeline, schedule: Schedule) -> None:
    """Raise unless ``schedule`` runs as many stages as ``pipe`` was split into."""
    if pipe.n_stages != schedule.n_stages:
        raise ValueError(
            f"the schedule {schedule.name!r} runs {schedule.n_stages} stages ({schedule.n_ranks} ranks) but the "
            f"pipeline was split into {pipe.n_stages}; build it with n_stages={schedule.n_stages} "
            f"(pipeline.stages = mesh.pp x stages per rank)"
        )


def _tag(sender_stage: int, backward: bool, mb: int, n_mb: int) -> int:
    """One tag per message: the sending stage, the direction and the microbatch."""
    return (2 * sender_stage + int(backward)) * n_mb + mb


def _keep(env: dict, names: set[str]) -> None:
    for k in [k for k in env if k not in names]:
        del env[k]


class _Rank:
    """One rank's state during a schedule run: value envs, in-flight tensors and gradient sums,
    all keyed by ``(stage, microbatch)``; one method per action kind."""

    def __init__(self, pipe: Pipeline, schedule: Schedule, pp_rank: int, params, microbatches, group):
        self.stages, self.s2r, self.rank = pipe.stages, schedule.stage_to_rank, pp_rank
        self.params, self.microbatches, self.group = params, microbatches, group
        self.m = schedule.n_microbatches
        self.device = next((t.device for p in params.values() for t in p.values()), torch.device("cpu"))
        self.seed_dy = torch.full((), 1.0 / self.m, dtype=self.stages[-1].out_spec.dtype, device=self.device)
        self.envs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.acts: dict[tuple[int, int], torch.Tensor] = {}    # stage outputs, for SEND_F or the next local stage
        self.cots: dict[tuple[int, int], torch.Tensor] = {}    # input gradients, for SEND_B or the previous local stage
        # posted receives until their reader takes them: ("x" | "dy", stage, mb) -> (work, buffer, cell),
        # work None once waited on
        self.received: dict[tuple[str, int, int], tuple] = {}
        self.pending_sends: list = []  # (work, tensor) of sends posted but not known to be done
        self.grads: dict[int, dict[str, torch.Tensor]] = {s: {} for s in schedule.stages_of(pp_rank)}
        self.losses: list[torch.Tensor] = []
        self.sides: dict[str, list[torch.Tensor]] = {}  # side name -> each microbatch's value (Stage.sides)
        self.param_ptrs = {t.untyped_storage().data_ptr() for p in params.values() for t in p.values()}

    def local(self, stage: int) -> bool:
        return self.s2r[stage] == self.rank

    def F(self, a: Action) -> None:
        st, key = self.stages[a.stage], (a.stage, a.microbatch)
        x = None
        if st.in_spec is not None:
            x = self.acts.pop((a.stage - 1, a.microbatch)) if self.local(a.stage - 1) else self.take(("x", *key))
        env = st.inputs_env(self.params[a.stage], x, self.microbatches[a.microbatch])
        st.F.run(env)
        y = env[st.y_name]
        if st.is_last:
            self.losses.append(y.detach())
        else:
            self.acts[key] = y
        for side, name in zip(st.sides, st.side_names):
            self.sides.setdefault(side, []).append(env[name].detach())
            if side == "loss":  # the stage's part of the loss: seeded as the loss is, in its own dtype
                env["dloss"] = self.seed_dy.to(env[name].dtype)
        _keep(env, set(st.I.inputs) | set(st.W.inputs))
        self.envs[key] = env

    def I(self, a: Action) -> None:  # noqa: E743 (the schedule's name for it)
        st, key = self.stages[a.stage], (a.stage, a.microbatch)
        env = self.envs[key]
        if st.is_last:
            env["dy"] = self.seed_dy
        elif self.local(a.stage + 1):
            env["dy"] = self.cots.pop((a.stage + 1, a.microbatch))
        else:
            env["dy"] = self.take(("dy", *key))
        st.I.run(env)
        if st.dx_name is not None:
            self.cots[key] = env[st.dx_name]
        _keep(env, set(st.W.inputs))

    def W(self, a: Action) -> None:
        st = self.stages[a.stage]
        env = self.envs.pop((a.stage, a.microbatch))
        st.W.run(env)
        acc = self.grads[a.stage]
        for path, name in zip(st.param_paths, st.grad_names):
            if path in acc:
                acc[path].add_(env[name])
            else:
                acc[path] = env[name].clone()  # W's result may be a view of a live tensor (the loss seed, say)

    def B(self, a: Action) -> None:
        self.I(a)
        self.W(a)

    def awaited(self, a: Action) -> tuple[str, int, int] | None:
        """The receive compute action ``a`` reads, while it is still in flight (else None)."""
        key = ("x" if a.kind == "F" else "dy", a.stage, a.microbatch)
        return key if self.received.get(key, (None,))[0] is not None else None

    def in_flight(self) -> list[str]:
        """The cells of the receives posted and not yet waited on."""
        return [cell for work, _, cell in self.received.values() if work is not None]

    def wait(self, key: tuple[str, int, int]) -> None:
        """Wait for the posted receive ``key`` (a no-op once done); its buffer stays for its reader."""
        work, t, cell = self.received[key]
        if work is not None:
            work.wait()
            self.received[key] = (None, t, cell)

    def take(self, key: tuple[str, int, int]) -> torch.Tensor:
        """The buffer of the receive ``key``, waited on."""
        self.wait(key)
        return self.received.pop(key)[1]

    def communicate(self, batch: tuple[Action, ...]) -> None:
        """Post ``batch`` as one ``batch_isend_irecv``; wait for none of it here (a receive is
        waited on by its reader, a send at the end of the run)."""
        ops, recvs = [], []
        for a in batch:
            key, mb = (a.stage, a.microbatch), a.microbatch
            if a.kind == "SEND_F":
                t, tag, op = self.acts.pop(key).contiguous(), _tag(a.stage, False, mb, self.m), dist.isend
            elif a.kind == "SEND_B":
                t, tag, op = self.cots.pop(key).contiguous(), _tag(a.stage, True, mb, self.m), dist.isend
            elif a.kind == "RECV_F":
                t, tag, op = (
                    self.stages[a.stage].in_spec.empty(self.device),
                    _tag(a.stage - 1, False, mb, self.m),
                    dist.irecv,
                )
                recvs.append((("x", *key), a.cell))
            else:  # RECV_B
                t, tag, op = (
                    self.stages[a.stage].out_spec.empty(self.device),
                    _tag(a.stage + 1, True, mb, self.m),
                    dist.irecv,
                )
                recvs.append((("dy", *key), a.cell))
            ops.append(dist.P2POp(op, t, group=self.group, group_peer=a.peer, tag=tag))
        # A receive completes before the compute that reads it (no later than the schedule's
        # blocking batches assume); a send is only waited on once its rank needs nothing more
        # from it (see docs/pipeline.md).
        received = iter(recvs)
        for p2p, work in zip(ops, dist.batch_isend_irecv(ops)):
            if p2p.op is dist.isend:
                self.pending_sends.append((work, p2p.tensor))
            else:
                key, cell = next(received)
                self.received[key] = (work, p2p.tensor, cell)
        self.pending_sends = [(w, t) for w, t in self.pending_sends if not w.is_completed()]

    def finish(self) -> torch.Tensor | None:
        """Wait for the sends; the mean loss of the last stage's microbatches (None off that stage)."""
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends = []
        if self.received:
            raise RuntimeError(f"rank {self.rank}: the schedule received {sorted(self.received)} "
                               f"(kind, stage, microbatch) and never used it")
        if self.envs:
            raise RuntimeError(f"rank {self.rank}: the schedule left (stage, microbatch) {sorted(self.envs)} "
                               f"without a W or B")
        parts = self.losses + self.sides.get("loss", [])
        return torch.stack(parts).sum() / self.m if parts else None

    def side_means(self) -> dict[str, torch.Tensor]:
        """``aux:<key>`` side results of this rank's stages, each summed over its stages and
        averaged over the microbatches (a stage's part of an aux value, ``partition.stages.stage_sums``)."""
        return {name[4:]: torch.stack(v).sum() / self.m for name, v in self.sides.items() if name.startswith("aux:")}

    def live(self) -> list:
        """Every tensor the rank holds for later actions now (a snapshot: its envs' values, the
        activations and input gradients in hand, the posted buffers), for ``run_pair``'s ``keep``:
        on a GPU, what a pair's second member frees stays allocated until the pair's streams join."""
        return [[dict(env) for env in self.envs.values()], dict(self.acts), dict(self.cots),
                [t for _, t, _ in self.received.values()], [t for _, t in self.pending_sends]]

    def held_bytes(self) -> int:
        """Bytes of distinct storages held for later actions (parameters excluded)."""
        seen, total = set(), 0
        pools = [self.acts, self.cots, *self.envs.values(),
                 {i: t for i, (_, t) in enumerate(self.pending_sends)},
                 {k: t for k, (_, t, _) in self.received.items()}]
        for pool in pools:
            for v in pool.values():
                if not isinstance(v, torch.Tensor):
                    continue
                storage = v.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in seen and ptr not in self.param_ptrs:
                    seen.add(ptr)
                    total += storage.nbytes()
        return total


def _compute(rank: _Rank, a: Action, record: bool, global_rank: int, events: list) -> None:
    """Run compute action ``a``, waiting first on the receive it reads if it is still in flight."""
    t0 = time.perf_counter_ns() if record else 0
    if (key := rank.awaited(a)) is not None:  # its input is still on the wire: wait, as P2P time
        rank.wait(key)
        if record:
            t1 = time.perf_counter_ns()
            events.append({"name": f"WAIT_{a.cell}", "kind": "P2P", "stage": a.stage, "mb": a.microbatch,
                           "start_ns": t0, "end_ns": t1, "rank": global_rank})
            t0 = t1
    in_flight = rank.in_flight() if record else None
    getattr(rank, a.kind)(a)
    if record:
        events.append({"name": a.cell, "kind": a.kind, "stage": a.stage, "mb": a.microbatch, "start_ns": t0,
                       "end_ns": time.perf_counter_ns(), "rank": global_rank})
        if in_flight:
            events[-1]["in_flight"] = in_flight  # receives completing behind this compute


def _pair_events(first: list[dict], second: list[dict], log: list, global_rank: int) -> list[dict]:
    """The two members' events, each compute step split at its handoffs: one event per stretch
    a member computed, and an ``EP`` event per stretch it waited on its exchange (and for its turn)."""
    out = []
    for member, events in enumerate((first, second)):
        stretches, start = [], None
        for who, event, ns in log:
            if who != member:
                continue
            if event in ("start", "resume"):
                start = ns
            else:
                stretches.append((start, ns))
        for e in events:
            if e["kind"] == "P2P":
                out.append(e)
                continue
            inside = [(max(a, e["start_ns"]), min(b, e["end_ns"])) for a, b in stretches
                      if b > e["start_ns"] and a < e["end_ns"]]
            for k, (a, b) in enumerate(inside):
                out.append({**e, "start_ns": a, "end_ns": b})
                if k + 1 < len(inside):
                    out.append({**e, "name": f"EXCHANGE_{e['name']}", "kind": "EP", "start_ns": b,
                                "end_ns": inside[k + 1][0]})
    return sorted(out, key=lambda e: e["start_ns"])


def run_schedule(
    pipe: Pipeline,
    schedule: Schedule,
    pp_rank: int,
    params: dict[int, dict[str, torch.Tensor]],
    microbatches: list[dict[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    record: bool = False,
    receive_at: str = "use",
    overlap_pairs: bool = False,
) -> RunResult:
    """Run ``schedule.actions[pp_rank]`` with ``pipe``'s stage programs.

    Args:
        pipe: from :func:`~shardfn.partition.pipeline.split.build_pipeline`, with ``schedule.n_stages`` stages.
        schedule: a schedule with communication (one without gets it via ``add_communication``).
        pp_rank: this rank's index in the ``pp`` group (the schedule's rank).
        params: ``stage -> {path: held tensor}`` for this rank's stages (:func:`stage_params`).
        microbatches: ``schedule.n_microbatches`` dicts ``path -> tensor`` of batch leaves.
        group: the ``pp`` process group (None: the default group, whose ranks are the schedule's).
        record: time every step (for :func:`write_chrome_trace`) and track held bytes.
        receive_at: ``"use"``: wait on each receive at the compute that reads it; ``"post"``: at
            the batch that posts it (the blocking batches the validator models; for comparison).
        overlap_pairs: run each overlapped pair (``partition.pipeline.schedules.pair_overlaps``: an ``F``
            and the other chunk's ``B``, adjacent) as one step whose members take turns at their
            MoE exchange waits (``runtime.interleave``): one computes while the other's
            all-to-all is in flight. Every rank of a run must pass the same value.

    Example:
        out = run_schedule(pipe, get_schedule("1f1b", 2, 4), rank, held, mbs, group=pp_group)
        out.loss, out.grads[rank]["layers.w1"].shape
    """
    check_fit(pipe, schedule)
    if receive_at not in ("use", "post"):
        raise ValueError(f"receive_at={receive_at!r}: use 'use' (wait where the tensor is read) or 'post' "
                         f"(wait where the receive is posted)")
    if schedule.n_ranks > 1 and not schedule.has_communication:
        schedule = add_communication(schedule)
    if len(microbatches) != schedule.n_microbatches:
        raise ValueError(f"the schedule runs {schedule.n_microbatches} microbatches but {len(microbatches)} were given")
    mine = schedule.stages_of(pp_rank)
    if any(s not in params for s in mine):
        raise ValueError(f"rank {pp_rank} runs stages {list(mine)} but holds parameters for {sorted(params)}")
    unsplit = [s for s in mine if pipe.stages[s].F is None]
    if unsplit:
        raise ValueError(f"stages {unsplit} have no F/I/W programs; build the pipeline with split=None or "
                         f"split=schedule.stages_of({pp_rank})")
    foreign = next((a for a in schedule.actions[pp_rank] if not a.is_comm and a.stage not in mine), None)
    if foreign is not None:
        raise ValueError(f"rank {pp_rank} was given {foreign}, but stage {foreign.stage} lives on rank "
                         f"{schedule.stage_to_rank[foreign.stage]}")
    pairs: frozenset = frozenset()
    if overlap_pairs:
        schedule, pairs = pair_overlaps(schedule)
    rank = _Rank(pipe, schedule, pp_rank, params, microbatches, group)
    global_rank = dist.get_rank() if dist.is_initialized() else pp_rank
    events, turns, peak = [], [], 0
    steps = group_steps(schedule.actions[pp_rank])
    with torch.no_grad():
        i = 0
        while i < len(steps):
            step, a = steps[i], steps[i][0]
            i += 1
            if a.is_comm:
                t0 = time.perf_counter_ns() if record else 0
                rank.communicate(step)
                if receive_at == "post":
                    for key in list(rank.received):
                        rank.wait(key)
                if record:
                    events.append({"name": "+".join(b.cell for b in step), "kind": "P2P", "stage": a.stage,
                                   "mb": a.microbatch, "start_ns": t0, "end_ns": time.perf_counter_ns(),
                                   "rank": global_rank})
            elif (pp_rank, a, steps[i][0] if i < len(steps) else None) in pairs:
                b = steps[i][0]
                i += 1
                mine_f, mine_b = [], []
                log = run_pair(lambda: _compute(rank, a, record, global_rank, mine_f),
                               lambda: _compute(rank, b, record, global_rank, mine_b),
                               device=rank.device, keep=rank.live() if rank.device.type == "cuda" else None)
                turns.append((a.cell, b.cell, log))
                events += _pair_events(mine_f, mine_b, log, global_rank) if record else []
            else:
                _compute(rank, a, record, global_rank, events)
            if record:
                peak = max(peak, rank.held_bytes())
    loss = rank.finish()
    return RunResult(loss, rank.grads, events, peak, turns, rank.side_means())


# ----------------------------------------------------------------------------- batches


def split_microbatches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` (flat or nested dict of ``[B, ...]`` tensors) as ``n`` dicts ``path -> [B/n, ...]``.

        split_microbatches({"inputs": x, "targets": y}, 4)[0]["inputs"].shape  # [B // 4, S]
    """
    flat = dict(flatten_with_paths(batch))
    sizes = {p: t.shape[0] for p, t in flat.items()}
    for path, b in sizes.items():
        if b % n:
            raise ValueError(f"batch leaf {path!r} has {b} rows, not divisible by pipeline.microbatches={n}; "
                             f"make train.batch_size a multiple of microbatches x mesh.dp")
    chunks = {p: t.chunk(n, 0) for p, t in flat.items()}
    # contiguous, as traced: the stage programs' views assume the trace's (contiguous) strides
    return [{p: c[i].contiguous() for p, c in chunks.items()} for i in range(n)]


# ----------------------------------------------------------------------------- traces


def write_chrome_trace(events: list[dict], path: str | os.PathLike) -> Path:
    """Write ``events`` (from every rank) as a Chrome trace: one ``pid`` per rank, times in µs;
    compute and P2P on thread 0, an overlapped pair member's exchange waits (``EP``) on thread 1.

    Open it in ``chrome://tracing`` or Perfetto.

        write_chrome_trace(all_ranks_events, "runs/trace/pipeline.json")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = min((e["start_ns"] for e in events), default=0)
    trace = []
    for rank in sorted({e["rank"] for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"pp rank {rank}"}})
    for e in events:
        trace.append({
            "name": e["name"], "cat": e["kind"], "ph": "X", "pid": e["rank"], "tid": int(e["kind"] == "EP"),
            "ts": (e["start_ns"] - t0) / 1e3, "dur": (e["end_ns"] - e["start_ns"]) / 1e3,
            "args": {"stage": e["stage"], "microbatch": e["mb"],
                     **({"receives_in_flight": e["in_flight"]} if e.get("in_flight") else {})},
        })
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return path


def bubble_fraction(events: list[dict]) -> float:
    """Idle share of the ranks' time between the first start and the last end: ``1 - busy / (ranks * span)``,
    where busy is compute (F, B, I, W) time; P2P waits and a pair member's exchange waits (EP) count as idle.

        bubble_fraction(all_ranks_events)  # e.g. 0.27 for 1f1b on 4 ranks with 8 microbatches
    """
    if not events:
        return 0.0
    span = max(e["end_ns"] for e in events) - min(e["start_ns"] for e in events)
    ranks = {e["rank"] for e in events}
    busy = sum(e["end_ns"] - e["start_ns"] for e in events if e["kind"] not in ("P2P", "EP"))
    return 1.0 - busy / (len(ranks) * span) if span else 0.0
