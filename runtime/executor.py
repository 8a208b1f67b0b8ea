"""Run a pipeline schedule on this rank: F / I / W programs, P2P batches, gradients, the step.

:func:`run_schedule` executes one rank's action list from ``shardfn.runtime.schedules`` with the
stage programs of ``shardfn.partition.pipeline``: ``F`` runs a stage's forward and keeps the
values its backward needs per ``(stage, microbatch)``; ``I`` turns the output gradient into the
input gradient; ``W`` adds the parameter gradients into an accumulator; ``B`` is ``I`` then
``W``. Each run of adjacent communication actions is one ``batch_isend_irecv`` over the ``pp``
process group, waited on before the next step (the blocking-batch semantics the schedule
validator checks). Buffers have static shapes, known from the fake trace.

:func:`make_pipeline_step` wraps it into a training step with the same contract as a one-device
step, ``(params_local, opt_state_local, global_batch) -> (params_local, opt_state_local,
metrics)``: gradients are averaged over ``dp`` (and ``ep``, which splits the batch too and, in
MoE models, each layer's experts: ``runtime.pipeline_experts``), the gradient norm is summed
over all stages so clipping matches one device, then the optimizer updates this rank's
parameters only (and MoE routers' selection bias moves by auxiliary-loss-free balancing).

    step = make_pipeline_step(pipe, schedule, mesh, optimizer, grad_clip=1.0)
    params_local = step.scatter(params); opt_state = optimizer.init(params_local)
    params_local, opt_state, metrics = step(params_local, opt_state, batch)
    params = step.gather(params_local)                     # the full tree, on every rank
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardfn.core import optim
from shardfn.core.pytree import PyTree, flatten_with_paths, tree_flatten, tree_map, tree_unflatten
from shardfn.partition.pipeline import Pipeline, merge_params, stage_params
from shardfn.runtime.schedules import Action, Schedule, add_communication, group_steps

# ----------------------------------------------------------------------------- one schedule run


@dataclass
class RunResult:
    """What :func:`run_schedule` returns for this rank.

    Attributes:
        loss: mean of the last stage's microbatch losses (None when this rank lacks that stage).
        grads: ``stage -> {path: gradient}`` for this rank's stages, summed over microbatches
            with each loss scaled by ``1 / n_microbatches`` (the gradient of the mean loss).
        events: one dict per step (``name``, ``kind``, ``stage``, ``mb``, ``start_ns``,
            ``end_ns``) when recording.
        peak_saved_bytes: the most bytes of values held for backward at once (activations,
            saved tensors and pending messages; parameters excluded).
    """

    loss: torch.Tensor | None
    grads: dict[int, dict[str, torch.Tensor]]
    events: list[dict] = field(default_factory=list)
    peak_saved_bytes: int = 0


def _check_fit(pipe: Pipeline, schedule: Schedule) -> None:
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
        self.recv_x: dict[tuple[int, int], torch.Tensor] = {}
        self.recv_dy: dict[tuple[int, int], torch.Tensor] = {}
        self.pending_sends: list = []  # (work, tensor) of sends posted but not known to be done
        self.grads: dict[int, dict[str, torch.Tensor]] = {s: {} for s in schedule.stages_of(pp_rank)}
        self.losses: list[torch.Tensor] = []
        self.param_ptrs = {t.untyped_storage().data_ptr() for p in params.values() for t in p.values()}

    def local(self, stage: int) -> bool:
        return self.s2r[stage] == self.rank

    def F(self, a: Action) -> None:
        st, key = self.stages[a.stage], (a.stage, a.microbatch)
        x = None
        if st.in_spec is not None:
            x = self.acts.pop((a.stage - 1, a.microbatch)) if self.local(a.stage - 1) else self.recv_x.pop(key)
        env = st.inputs_env(self.params[a.stage], x, self.microbatches[a.microbatch])
        st.F.run(env)
        y = env[st.y_name]
        if st.is_last:
            self.losses.append(y.detach())
        else:
            self.acts[key] = y
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
            env["dy"] = self.recv_dy.pop(key)
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

    def communicate(self, batch: tuple[Action, ...]) -> None:
        """Post ``batch`` as one ``batch_isend_irecv``; wait for its receives, not its sends."""
        ops, recvs = [], []
        for a in batch:
            key, mb = (a.stage, a.microbatch), a.microbatch
            if a.kind == "SEND_F":
                t, tag, op = self.acts.pop(key).contiguous(), _tag(a.stage, False, mb, self.m), dist.isend
            elif a.kind == "SEND_B":
                t, tag, op = self.cots.pop(key).contiguous(), _tag(a.stage, True, mb, self.m), dist.isend
            elif a.kind == "RECV_F":
                t, tag, op = self.stages[a.stage].in_spec.empty(self.device), _tag(a.stage - 1, False, mb, self.m), dist.irecv
                recvs.append((self.recv_x, key, t))
            else:  # RECV_B
                t, tag, op = self.stages[a.stage].out_spec.empty(self.device), _tag(a.stage + 1, True, mb, self.m), dist.irecv
                recvs.append((self.recv_dy, key, t))
            ops.append(dist.P2POp(op, t, group=self.group, group_peer=a.peer, tag=tag))
        # Receives complete before the next step (the schedule's blocking-batch semantics); a send
        # is only waited on once its rank needs nothing more from it (see docs/pipeline.md).
        for p2p, work in zip(ops, dist.batch_isend_irecv(ops)):
            if p2p.op is dist.isend:
                self.pending_sends.append((work, p2p.tensor))
            else:
                work.wait()
        for pool, key, t in recvs:
            pool[key] = t
        self.pending_sends = [(w, t) for w, t in self.pending_sends if not w.is_completed()]

    def finish(self) -> torch.Tensor | None:
        """Wait for the sends; the mean loss of the last stage's microbatches (None off that stage)."""
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends = []
        if self.envs:
            raise RuntimeError(f"rank {self.rank}: the schedule left (stage, microbatch) {sorted(self.envs)} "
                               f"without a W or B")
        return torch.stack(self.losses).sum() / self.m if self.losses else None

    def held_bytes(self) -> int:
        """Bytes of distinct storages held for later actions (parameters excluded)."""
        seen, total = set(), 0
        pools = [self.acts, self.cots, self.recv_x, self.recv_dy, *self.envs.values(),
                 {i: t for i, (_, t) in enumerate(self.pending_sends)}]
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


def run_schedule(
    pipe: Pipeline,
    schedule: Schedule,
    pp_rank: int,
    params: dict[int, dict[str, torch.Tensor]],
    microbatches: list[dict[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    record: bool = False,
) -> RunResult:
    """Run ``schedule.actions[pp_rank]`` with ``pipe``'s stage programs.

    Args:
        pipe: from :func:`~shardfn.partition.pipeline.build_pipeline`, with ``schedule.n_stages`` stages.
        schedule: a schedule with communication (one without gets it via ``add_communication``).
        pp_rank: this rank's index in the ``pp`` group (the schedule's rank).
        params: ``stage -> {path: held tensor}`` for this rank's stages (:func:`stage_params`).
        microbatches: ``schedule.n_microbatches`` dicts ``path -> tensor`` of batch leaves.
        group: the ``pp`` process group (None: the default group, whose ranks are the schedule's).
        record: time every step (for :func:`write_chrome_trace`) and track held bytes.

    Example:
        out = run_schedule(pipe, get_schedule("1f1b", 2, 4), rank, held, mbs, group=pp_group)
        out.loss, out.grads[rank]["layers.w1"].shape
    """
    _check_fit(pipe, schedule)
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
    rank = _Rank(pipe, schedule, pp_rank, params, microbatches, group)
    global_rank = dist.get_rank() if dist.is_initialized() else pp_rank
    events, peak = [], 0
    with torch.no_grad():
        for step in group_steps(schedule.actions[pp_rank]):
            a = step[0]
            t0 = time.perf_counter_ns() if record else 0
            if a.is_comm:
                rank.communicate(step)
            elif a.stage not in mine:
                raise ValueError(f"rank {pp_rank} was given {a}, but stage {a.stage} lives on rank "
                                 f"{schedule.stage_to_rank[a.stage]}")
            else:
                getattr(rank, a.kind)(a)
            if record:
                events.append({"name": "+".join(b.cell for b in step), "kind": "P2P" if a.is_comm else a.kind,
                               "stage": a.stage, "mb": a.microbatch, "start_ns": t0,
                               "end_ns": time.perf_counter_ns(), "rank": global_rank})
                peak = max(peak, rank.held_bytes())
    loss = rank.finish()
    return RunResult(loss, rank.grads, events, peak)


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


def dp_shard(batch: dict, dp_rank: int, dp: int) -> dict:
    """This data-parallel rank's contiguous rows of every leaf of ``batch``.

        dp_shard({"inputs": x}, 1, 2)["inputs"]  # x[B // 2:]
    """
    if dp == 1:
        return batch

    def rows(t):
        if t.shape[0] % dp:
            raise ValueError(f"a batch leaf has {t.shape[0]} rows, not divisible by the {dp} data-parallel ranks "
                             f"(mesh.dp x mesh.ep); make train.batch_size a multiple of mesh.dp x mesh.ep x "
                             f"pipeline.microbatches")
        n = t.shape[0] // dp
        return t[dp_rank * n:(dp_rank + 1) * n]

    return tree_map(rows, batch)


# ----------------------------------------------------------------------------- the train step


def _nest(flat: dict[str, torch.Tensor]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        node = out
        *head, last = path.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = x
    return out


def stage_key(stage: int) -> str:
    """The key of a stage's subtree in a local parameter tree: ``"stage3"``."""
    return f"stage{stage}"


@dataclass
class PipelineStep:
    """The training step of one pipeline rank; call it like a one-device step.

    ``params_local`` is ``{"stage<s>": subtree}`` for this rank's stages, each subtree shaped
    like the model's tree restricted to the leaves that stage holds (stacked leaves narrowed to
    its layers). Build it with :meth:`scatter`; rebuild the full tree with :meth:`gather`.

    Example:
        step = make_pipeline_step(pipe, schedule, mesh, optimizer, grad_clip=1.0)
        params_local = step.scatter(params); opt_state = optimizer.init(params_local)
        params_local, opt_state, metrics = step(params_local, opt_state, batch)
    """

    pipe: Pipeline
    schedule: Schedule
    optimizer: optim.GradientTransformation
    grad_clip: float | None
    pp_rank: int
    dp_rank: int
    dp: int
    pp_group: Any = None
    dp_group: Any = None
    record: bool = False
    last_run: RunResult | None = None   # the latest step's schedule run (events, held bytes)
    last_grads: dict | None = None      # the latest step's gradients (dp-averaged, before clipping)
    ep: int = 1                         # expert-parallel size: the experts are split, the batch too
    ep_rank: int = 0
    ep_group: Any = None
    experts: Any = None                 # an ExpertLayout (runtime.pipeline_experts) for MoE models

    @property
    def stages(self) -> tuple[int, ...]:
        return self.schedule.stages_of(self.pp_rank)

    @property
    def expert_dims(self) -> dict[str, int]:
        """``path -> dim`` of the leaves split over ``ep`` (empty without expert parallelism)."""
        return self.experts.dims if self.experts is not None and self.ep > 1 else {}

    def scatter(self, params: PyTree) -> dict:
        """This rank's local tree from the full parameter tree (copies: the full tree can be freed)."""
        from shardfn.runtime.pipeline_experts import shard_experts

        params = shard_experts(params, self.expert_dims, self.ep_rank, self.ep)
        return {stage_key(s): _nest({p: t.detach().clone() for p, t in stage_params(params, self.pipe, s).items()})
                for s in self.stages}

    def held(self, params_local: dict) -> dict[int, dict[str, torch.Tensor]]:
        """``stage -> {path: tensor}`` from a local tree."""
        out = {}
        for s in self.stages:
            flat = dict(flatten_with_paths(params_local[stage_key(s)]))
            out[s] = {p: flat[p] for p in self.pipe.stages[s].param_paths}
        return out

    def gather(self, params_local: dict) -> PyTree:
        """The full parameter tree on every rank: each stage's owner broadcasts its slices over
        ``pp``, then the expert slices are all-gathered over ``ep``."""
        from shardfn.runtime.pipeline_experts import gather_experts

        return gather_experts(self._gather_stages(params_local), self.expert_dims, self.ep, self.ep_group)

    def _gather_stages(self, params_local: dict) -> PyTree:
        mine = self.held(params_local)
        held = {}
        for s, stage in enumerate(self.pipe.stages):
            owner = self.schedule.stage_to_rank[s]
            tensors = {}
            for p in stage.param_paths:
                t = mine[s][p].contiguous() if owner == self.pp_rank else stage.param_specs[p].empty(_device(mine))
                if self.schedule.n_ranks > 1:
                    dist.broadcast(t, group=self.pp_group, group_src=owner)
                tensors[p] = t
            held[s] = tensors
        return merge_params(held, self.pipe)

    def gather_state(self, opt_state: Any) -> Any:
        """``opt_state`` with every tree shaped like the local params (AdamW's ``mu``, ``nu``)
        replaced by the full tree, on every ``pp`` rank."""
        return _map_local_trees(self.gather, opt_state, self.stages)

    def scatter_state(self, opt_state_full: Any, params: PyTree) -> Any:
        """Inverse of :meth:`gather_state`: each full-params-shaped tree cut to this rank's stages."""
        return _map_full_trees(self.scatter, opt_state_full, params)

    def checkpoint_blocks(self, params_local: dict) -> PyTree:
        """The full parameter tree's structure with this rank's slices at each leaf, as
        :class:`~shardfn.runtime.checkpoint_blocks.Blocks` (no blocks where other ranks hold the
        leaf): what a checkpoint save writes and a load fills in place. No communication.

            blocks = step.checkpoint_blocks(params_local)  # Blocks(shape=(L, D, H), blocks=[((0, 0, 0), w)])
        """
        from shardfn.runtime.checkpoint_blocks import Blocks

        held, dims = self.held(params_local), self.expert_dims
        leaves = []
        for path, spec in self.pipe.param_specs.items():
            shape = list(spec.shape)
            if path in dims:
                shape[dims[path]] *= self.ep  # traced with this rank's n_experts / ep
            blocks = []
            for s in self.stages:
                if path in held[s]:
                    t, offsets = held[s][path], [0] * len(shape)
                    if path in self.pipe.stages[s].layer_ranges:
                        offsets[0] = self.pipe.stages[s].layer_ranges[path][0]
                    if path in dims:
                        offsets[dims[path]] = self.ep_rank * t.shape[dims[path]]
                    blocks.append((tuple(offsets), t))
            leaves.append(Blocks(shape, spec.dtype, blocks))
        return tree_unflatten(self.pipe.param_treedef, leaves)

    def from_blocks(self, blocks_tree: PyTree) -> dict:
        """Inverse of :meth:`checkpoint_blocks`: the local tree of the blocks' tensors."""
        taken = {p: iter(b.blocks) for p, b in zip(self.pipe.param_specs, tree_flatten(blocks_tree)[0])}
        return {stage_key(s): _nest({p: next(taken[p])[1] for p in self.pipe.stages[s].param_paths})
                for s in self.stages}

    def state_blocks(self, opt_state: Any) -> Any:
        """``opt_state`` with every local-params-shaped tree (AdamW's ``mu``, ``nu``) as :meth:`checkpoint_blocks`."""
        return _map_local_trees(self.checkpoint_blocks, opt_state, self.stages)

    def state_from_blocks(self, opt_state_blocks: Any, params_blocks: PyTree) -> Any:
        """Inverse of :meth:`state_blocks`."""
        return _map_full_trees(self.from_blocks, opt_state_blocks, params_blocks)

    def write_trace(self, path: str | os.PathLike) -> Path | None:
        """Write the latest step's action timings of every rank as one Chrome trace (on global rank 0).

        Needs ``record=True``. Every rank must call it (the events are gathered).
        """
        events = self.last_run.events if self.last_run is not None else []
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, events)
            events = [e for rank_events in everyone for e in rank_events]
            if dist.get_rank() != 0:
                return None
        return write_chrome_trace(events, path)

    def __call__(self, params_local: dict, opt_state: Any, global_batch: dict) -> tuple[dict, Any, dict]:
        from shardfn.runtime import moe_dispatch, pipeline_experts

        batch = dp_shard(global_batch, self.dp_rank * self.ep + self.ep_rank, self.dp * self.ep)
        mbs = split_microbatches(batch, self.schedule.n_microbatches)
        pipeline_experts.take_counts()
        moe_dispatch.reset_stats()  # exchange_stats() reports this step's all-to-alls
        out = run_schedule(self.pipe, self.schedule, self.pp_rank, self.held(params_local), mbs,
                           group=self.pp_group, record=self.record)
        self.last_run = out
        counts = pipeline_experts.take_counts()
        grads = self._reduce_grads({stage_key(s): _nest(out.grads[s]) for s in self.stages})
        self.last_grads = grads
        sharded = (lambda path: pipeline_experts.expert_dim(path, self.expert_dims) is not None) if self.ep > 1 else None
        norm = global_grad_norm(grads, self.pp_group, over=self.schedule.n_ranks > 1, ep_group=self.ep_group,
                                sharded=sharded)
        if self.grad_clip is not None:
            scale = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
            grads = tree_map(lambda g: g * scale.to(g.dtype), grads)
        updates, opt_state = self.optimizer.update(grads, opt_state, params_local)
        params_local = optim.apply_updates(params_local, updates)
        loss = out.loss if out.loss is not None else torch.zeros((), device=norm.device)
        loss = _sum_over(loss.detach().clone(), self.pp_group, over=self.schedule.n_ranks > 1)
        loss = _sum_over(loss, self.dp_group, over=self.dp > 1)
        loss = _sum_over(loss, self.ep_group, over=self.ep > 1) / (self.dp * self.ep)
        lr = optim.find_state(opt_state, optim.ScaleByLearningRateState)
        metrics = {"loss": loss, "grad_norm": norm, "lr": lr.lr if lr is not None else torch.zeros(())}
        if self.experts is not None and self.experts.bias_path is not None:
            params_local, load = self._balance_router_bias(params_local, counts)
            metrics.update(load)
        return params_local, opt_state, metrics

    def _reduce_grads(self, grads: dict) -> dict:
        """Gradients of the mean loss over the whole batch: every leaf summed over the ranks that
        hold the same values and divided by the ``dp x ep`` ranks the batch was split over. An
        expert slice's gradient already sums every ``ep`` rank's tokens (the all-to-all backward),
        so it is summed over ``dp`` only."""
        from shardfn.runtime.pipeline_experts import expert_dim

        if self.ep == 1:
            return _all_reduce_mean(grads, self.dp, self.dp_group) if self.dp > 1 else grads
        items, treedef = flatten_with_paths(grads), tree_flatten(grads)[1]
        split = [expert_dim(p, self.expert_dims) is not None for p, _ in items]
        replicated = _all_reduce_mean([g for (_, g), e in zip(items, split) if not e], self.ep, self.ep_group)
        experts = [g / self.ep for (_, g), e in zip(items, split) if e]
        if self.dp > 1:
            replicated = _all_reduce_mean(replicated, self.dp, self.dp_group)
            experts = _all_reduce_mean(experts, self.dp, self.dp_group)
        rep, exp = iter(replicated), iter(experts)
        return tree_unflatten(treedef, [next(exp) if e else next(rep) for e in split])

    def _balance_router_bias(self, params_local: dict, counts: dict[int, torch.Tensor]) -> tuple[dict, dict]:
        """``params_local`` with each held router-bias row moved by auxiliary-loss-free balancing
        from the whole batch's tokens per expert (this rank's counts summed over ``dp``, ``ep``
        and ``pp``), and the per-layer load metrics of the one-device step."""
        from shardfn.core.moe import update_expert_bias
        from shardfn.runtime.pipeline_experts import load_metrics

        lay = self.experts
        total = torch.zeros((lay.n_layers, lay.n_experts), dtype=torch.int64, device=_device(self.held(params_local)))
        for layer, c in counts.items():
            total[layer] += c.to(total.device)
        for group, n in ((self.dp_group, self.dp), (self.ep_group, self.ep), (self.pp_group, self.schedule.n_ranks)):
            _sum_over(total, group, over=n > 1)
        out = dict(params_local)
        for s in self.stages:
            if lay.bias_path not in self.pipe.stages[s].param_paths:
                continue
            l0, l1 = self.pipe.stages[s].layer_ranges.get(lay.bias_path, (0, lay.n_layers))
            flat = dict(flatten_with_paths(out[stage_key(s)]))
            flat[lay.bias_path] = update_expert_bias(flat[lay.bias_path], total[l0:l1], lay.bias_update_rate)
            out[stage_key(s)] = _nest(flat)
        return out, load_metrics(total)


def _map_trees(fn, state: Any, match) -> Any:
    """``fn`` applied to every sub-tree of ``state`` (NamedTuples, tuples, lists, dicts) where ``match`` holds."""
    if match(state):
        return fn(state)
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*[_map_trees(fn, s, match) for s in state])
    if isinstance(state, (tuple, list)):
        return type(state)(_map_trees(fn, s, match) for s in state)
    if isinstance(state, dict):
        return {k: _map_trees(fn, v, match) for k, v in state.items()}
    return state


def _map_local_trees(fn, state: Any, stages) -> Any:
    """``fn`` on every sub-tree shaped like a local parameter tree (``{"stage<s>": ...}`` of ``stages``)."""
    keys = set(map(stage_key, stages))
    return _map_trees(fn, state, lambda t: isinstance(t, dict) and t and set(t) == keys)


def _map_full_trees(fn, state: Any, params: PyTree) -> Any:
    """``fn`` on every sub-tree shaped like the full parameter tree ``params``."""
    treedef = tree_flatten(params)[1]
    return _map_trees(fn, state, lambda t: isinstance(t, dict) and tree_flatten(t)[1] == treedef)


def _device(held: dict) -> torch.device:
    return next((t.device for p in held.values() for t in p.values()), torch.device("cpu"))


def _sum_over(x: torch.Tensor, group, *, over: bool) -> torch.Tensor:
    """``x`` summed in place over ``group`` (None: the default group) when ``over``."""
    if over:
        dist.all_reduce(x, group=group)
    return x


def _all_reduce_mean(tree: PyTree, n: int, group) -> PyTree:
    """Leaf-wise mean over ``group``: one flat buffer per dtype, one all-reduce each."""
    leaves, treedef = tree_flatten(tree)
    out = list(leaves)
    for dtype in sorted({t.dtype for t in leaves}, key=str):
        idx = [i for i, t in enumerate(leaves) if t.dtype == dtype]
        flat = torch.cat([leaves[i].reshape(-1) for i in idx])
        dist.all_reduce(flat, group=group)
        flat /= n
        k = 0
        for i in idx:
            out[i] = flat[k:k + leaves[i].numel()].view_as(leaves[i])
            k += leaves[i].numel()
    return tree_unflatten(treedef, out)


def global_grad_norm(grads: PyTree, pp_group, *, over: bool = True, ep_group=None,
                     sharded: Callable[[str], bool] | None = None) -> torch.Tensor:
    """The L2 norm of the gradients of every stage: local sums of squares added over ``pp``.

    Gradients are already averaged over ``dp`` (the replicas agree), so the sum over the
    ``pp`` group is the sum over the whole model, as one device computes it. Leaves whose path
    satisfies ``sharded`` (expert slices) differ over ``ep_group``: their squares are summed
    over it first; the replicated leaves are counted once.

        norm = global_grad_norm(grads_local, pp_group)   # over=False on a one-rank pipeline
    """
    items = flatten_with_paths(grads)

    def sum_sq(leaves):
        return torch.stack([torch.sum(torch.square(t.to(torch.float32))) for t in leaves]).sum() if leaves else torch.zeros(())

    if sharded is None:
        sq = sum_sq([t for _, t in items])
    else:
        split = sum_sq([t for p, t in items if sharded(p)])
        sq = sum_sq([t for p, t in items if not sharded(p)]) + _sum_over(split, ep_group, over=True)
    return torch.sqrt(_sum_over(sq, pp_group, over=over))


def make_pipeline_step(pipe: Pipeline, schedule: Schedule, mesh=None, optimizer: optim.GradientTransformation | None = None,
                       *, grad_clip: float | None = None, compile: bool = False, record: bool = False,
                       experts=None) -> PipelineStep:
    """The training step of this rank for ``pipe`` run by ``schedule`` on ``mesh``.

    Args:
        pipe: the split loss (``schedule.n_stages`` stages).
        schedule: e.g. ``get_schedule("1f1b", n_ranks=mesh.axes["pp"], n_microbatches=8)``.
        mesh: a ``shardfn.Mesh`` with a ``pp`` axis (and optionally ``dp`` and ``ep``; other axes
            of size 1), or None for the default process group as the ``pp`` group. The batch is
            split over ``dp x ep``.
        optimizer: a transform without clipping (e.g. :func:`pipeline_optimizer`); clipping
            needs the norm over all stages, so it is ``grad_clip`` here.
        grad_clip: max global gradient norm (as ``optim.clip_by_global_norm``), or None.
        compile: ``torch.compile`` every F / I / W program.
        record: time every action (``step.last_run.events``) and track held bytes.
        experts: for an MoE model, its ``pipeline_experts.ExpertLayout``: the leaves split over
            ``ep`` (``pipe`` traced with this rank's slices, through
            ``pipeline_experts.stage_loss``) and the router bias that the step balances.

    Example:
        step = make_pipeline_step(pipe, get_schedule("zbh1", 2, 4), sf.Mesh({"pp": 2}), adamw(1e-3))
    """
    if optimizer is None:
        raise ValueError("make_pipeline_step needs an optimizer, e.g. pipeline_optimizer(cfg.train)")
    probe = optimizer.init({"w": torch.zeros(1)})
    if optim.find_state(probe, optim.ClipByGlobalNormState) is not None:
        raise ValueError("the optimizer clips by its own (local) gradient norm; pass it without "
                         "clip_by_global_norm and set grad_clip=..., which clips by the norm over all stages")
    _check_fit(pipe, schedule)
    pp_rank, dp_rank, dp, pp_group, dp_group = 0, 0, 1, None, None
    ep_rank, ep, ep_group = 0, 1, None
    if mesh is not None:
        extra = {k: v for k, v in mesh.axes.items() if k not in ("pp", "dp", "ep") and v > 1}
        if extra:
            raise NotImplementedError(f"pipeline parallelism composes with dp and ep only so far; mesh has {extra}")
        coord = mesh.coordinate()
        pp = mesh.axes.get("pp", 1)
        if pp != schedule.n_ranks:
            raise ValueError(f"the schedule has {schedule.n_ranks} ranks but mesh.pp is {pp}; build the schedule "
                             f"with n_ranks=mesh.pp")
        pp_rank = coord.get("pp", 0)
        pp_group = mesh.device_mesh.get_group("pp") if "pp" in mesh.axes else None
        dp = mesh.axes.get("dp", 1)
        dp_rank = coord.get("dp", 0)
        dp_group = mesh.device_mesh.get_group("dp") if dp > 1 else None
        ep, ep_rank = mesh.axes.get("ep", 1), coord.get("ep", 0)
        ep_group = mesh.device_mesh.get_group("ep") if ep > 1 else None
        if ep > 1 and experts is not None:
            from shardfn.runtime.pipeline_experts import check_divides

            check_divides(experts.n_experts, ep)
    elif schedule.n_ranks > 1:
        pp_rank = dist.get_rank()
    if schedule.n_ranks > 1 and not schedule.has_communication:
        schedule = add_communication(schedule)
    if compile:
        for s in schedule.stages_of(pp_rank):
            for part in (pipe.stages[s].F, pipe.stages[s].I, pipe.stages[s].W):
                part.compile()
    return PipelineStep(pipe, schedule, optimizer, grad_clip, pp_rank, dp_rank, dp, pp_group, dp_group, record,
                        ep=ep, ep_rank=ep_rank, ep_group=ep_group, experts=experts)


def build_pipeline_step(cfg, model, params: PyTree, *, mesh=None, record: bool = False) -> PipelineStep:
    """The pipeline training step of a run config (``mesh.pp > 1``), for this rank.

    Reads ``pipeline.schedule``, ``pipeline.microbatches`` and ``pipeline.stages`` (null: one
    stage per rank, two for ``interleaved_1f1b`` and ``dualpipev``), ``mesh.pp``, ``mesh.dp``
    and ``mesh.ep``, and the ``train`` section's optimizer, clipping, batch size and sequence
    length. Only this rank's stages get F / I / W programs. ``params`` gives shapes (real or
    fake). With ``mesh.ep > 1`` an MoE model's stages hold ``n_experts / ep`` experts per layer
    and exchange tokens over ``ep`` (``runtime.pipeline_experts``); the batch is split over
    ``dp x ep`` either way.

    Example:
        step = build_pipeline_step(cfg, llama, params)
        params_local = step.scatter(params); opt_state = step.optimizer.init(params_local)
        params_local, opt_state, metrics = step(params_local, opt_state, batch)
    """
    import shardfn as sf
    from shardfn.runtime.schedules import get_schedule

    from shardfn.runtime import pipeline_experts

    pp, dp, ep = cfg.mesh.pp, cfg.mesh.dp, cfg.mesh.ep
    others = {k: v for k, v in cfg.mesh.axes().items() if k not in ("pp", "dp", "ep") and v > 1}
    if others:
        raise NotImplementedError(f"pipeline parallelism composes with mesh.dp and mesh.ep only so far; set "
                                  f"{', '.join(f'mesh.{k}=1' for k in others)} (mesh.dp splits the batch "
                                  f"instead, mesh.ep the experts)")
    experts = pipeline_experts.expert_layout(model, cfg.model, params)
    if ep > 1 and experts is not None:
        pipeline_experts.check_divides(experts.n_experts, ep)
        rule = cfg.rules.get("expert")
        if rule != "ep" and list(rule or []) != ["ep"]:
            raise ValueError(f"rules.expert={rule!r} with mesh.ep={ep} and mesh.pp={pp}: pipeline stages split "
                             f"the routed experts over ep only; set rules.expert=ep (or mesh.ep=1)")
    p = cfg.pipeline
    virtual = None
    if p.stages is not None:
        if p.stages % pp:
            raise ValueError(f"pipeline.stages={p.stages} is not a multiple of mesh.pp={pp}; use "
                             f"{pp * max(1, p.stages // pp)} or null (one stage per rank)")
        virtual = p.stages // pp
    sched = get_schedule(p.schedule, pp, p.microbatches, virtual)
    rows = cfg.train.batch_size // (dp * ep * p.microbatches)
    if rows * dp * ep * p.microbatches != cfg.train.batch_size:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} is not divisible by mesh.dp x mesh.ep x "
                         f"pipeline.microbatches = {dp * ep * p.microbatches}; make it a multiple of it")
    tokens = torch.zeros(rows, cfg.train.seq_len, dtype=torch.long, device=next(iter(_leaves(params))).device)
    if mesh is None:
        mesh = sf.Mesh({"pp": pp, "dp": dp, "ep": ep})
    coord = mesh.coordinate()
    ep_group = mesh.device_mesh.get_group("ep") if ep > 1 and experts is not None else None
    if ep_group is not None:  # traced with this rank's experts: [n_experts / ep, ...] slices
        params = pipeline_experts.shard_experts(params, experts.dims, coord["ep"], ep)
    from shardfn.partition.pipeline import build_pipeline

    pipe = build_pipeline(pipeline_experts.stage_loss(model, cfg.model, ep_group), params,
                          {"inputs": tokens, "targets": tokens}, sched.n_stages, split=sched.stages_of(coord["pp"]))
    return make_pipeline_step(pipe, sched, mesh, pipeline_optimizer(cfg.train), grad_clip=cfg.train.grad_clip,
                              compile=cfg.train.compile, record=record, experts=experts)


def _leaves(tree: PyTree) -> list:
    return tree_flatten(tree)[0]


def pipeline_optimizer(train_cfg) -> optim.GradientTransformation:
    """The run's AdamW on its warmup-cosine schedule, without clipping (the step clips globally).

        opt = pipeline_optimizer(cfg.train); step = make_pipeline_step(..., opt, grad_clip=cfg.train.grad_clip)
    """
    from shardfn.runtime.train import trainable_mask

    t = train_cfg
    schedule = optim.warmup_cosine(t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
    return optim.adamw(schedule, t.b1, t.b2, t.eps, t.weight_decay, mask=trainable_mask)


# ----------------------------------------------------------------------------- traces


def write_chrome_trace(events: list[dict], path: str | os.PathLike) -> Path:
    """Write ``events`` (from every rank) as a Chrome trace: one ``pid`` per rank, times in µs.

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
            "name": e["name"], "cat": e["kind"], "ph": "X", "pid": e["rank"], "tid": 0,
            "ts": (e["start_ns"] - t0) / 1e3, "dur": (e["end_ns"] - e["start_ns"]) / 1e3,
            "args": {"stage": e["stage"], "microbatch": e["mb"]},
        })
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return path


def bubble_fraction(events: list[dict]) -> float:
    """Idle share of the ranks' time between the first start and the last end: ``1 - busy / (ranks * span)``,
    where busy is compute (F, B, I, W) time; P2P waits count as idle.

        bubble_fraction(all_ranks_events)  # e.g. 0.27 for 1f1b on 4 ranks with 8 microbatches
    """
    if not events:
        return 0.0
    span = max(e["end_ns"] for e in events) - min(e["start_ns"] for e in events)
    ranks = {e["rank"] for e in events}
    busy = sum(e["end_ns"] - e["start_ns"] for e in events if e["kind"] != "P2P")
    return 1.0 - busy / (len(ranks) * span) if span else 0.0
