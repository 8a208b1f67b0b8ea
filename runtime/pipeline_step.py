"""The training step of one pipeline rank: schedule, gradients, clipping, optimizer, state.

:class:`PipelineStep` runs the rank's action list (``runtime.executor.run_schedule``) over the
microbatches of its data-parallel share of the global batch, averages the gradients over ``dp``
(and ``ep``, which splits the batch too and, in MoE models, each layer's experts:
``runtime.pipeline_experts``), and updates this rank's stages with the run's optimizer, whose
clipping norm is the norm over every stage (:meth:`PipelineStep.grad_norm`), so clipping matches
one device. A model's non-gradient update (MoE routers' selection bias) runs on each stage with
the tokens per expert its own layers counted. It has the contract of a one-device step,
``(params_local, opt_state_local, global_batch) -> (params_local, opt_state_local, metrics)``.

    step = make_pipeline_step(pipe, schedule, mesh, lambda norm: make_optimizer(cfg.train, model, norm=norm))
    params_local = step.scatter(params); opt_state = step.optimizer.init(params_local)
    params_local, opt_state, metrics = step(params_local, opt_state, batch)
    params = step.gather(params_local)                     # the full tree, on every rank
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardfn.core import optim
from shardfn.core.pytree import PyTree, flatten_with_paths, tree_flatten, tree_unflatten
from shardfn.partition.schedules import Schedule, add_communication, get_schedule, stages_per_rank
from shardfn.partition.stages import Pipeline, merge_params, stage_params
from shardfn.runtime.executor import (
    RunResult,
    check_fit,
    dp_shard,
    run_schedule,
    split_microbatches,
    write_chrome_trace,
)
from shardfn.runtime.step import Step
from shardfn.runtime.train_step import keep_finite, make_optimizer, step_metrics

OptimizerFactory = Callable[[Callable[[PyTree], torch.Tensor]], optim.GradientTransformation]
"""``norm -> optimizer``: the pipeline step hands in the norm over all stages for clipping."""

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
        step = make_pipeline_step(pipe, schedule, mesh, lambda norm: make_optimizer(cfg.train, model, norm=norm))
        params_local = step.scatter(params); opt_state = step.optimizer.init(params_local)
        params_local, opt_state, metrics = step(params_local, opt_state, batch)
    """

    pipe: Pipeline
    schedule: Schedule
    optimizer: optim.GradientTransformation
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
    model: Any = None                   # the model module: its aux_update / aux_metrics (None: no aux)
    model_cfg: Any = None
    skip_nonfinite: bool = False        # train.nonfinite=skip: a NaN/Inf step leaves the state as it was
    recorder: Any = None                # pipeline_experts.Recorder the MoE layers count into (this step's)

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
        batch = dp_shard(global_batch, self.dp_rank * self.ep + self.ep_rank, self.dp * self.ep)
        mbs = split_microbatches(batch, self.schedule.n_microbatches)
        if self.recorder is not None:
            self.recorder.reset()  # this step's tokens per expert and all-to-alls
        out = run_schedule(self.pipe, self.schedule, self.pp_rank, self.held(params_local), mbs,
                           group=self.pp_group, record=self.record)
        self.last_run = out
        grads = self._reduce_grads({stage_key(s): _nest(out.grads[s]) for s in self.stages})
        self.last_grads = grads
        updates, new_state = self.optimizer.update(grads, opt_state, params_local)
        new_params = optim.apply_updates(params_local, updates)
        loss = out.loss if out.loss is not None else torch.zeros(())
        loss = _sum_over(loss.detach().clone(), self.pp_group, over=self.schedule.n_ranks > 1)
        loss = _sum_over(loss, self.dp_group, over=self.dp > 1)
        loss = _sum_over(loss, self.ep_group, over=self.ep > 1) / (self.dp * self.ep)
        metrics = step_metrics(loss, grads, new_state, norm=self.grad_norm)
        if self.model is not None and self.recorder is not None:
            new_params, aux = self._aux_update(new_params, self.recorder.counts)
            metrics.update(self.model.aux_metrics(aux))
        if self.skip_nonfinite:  # loss and grad_norm are global: every rank skips alike
            new_params, new_state = keep_finite((new_params, new_state), (params_local, opt_state), metrics)
        return new_params, new_state, metrics

    def grad_norm(self, grads: dict) -> torch.Tensor:
        """The L2 norm of every stage's gradients (``grads``: this rank's local tree), as one
        device computes it: the clipping norm of :attr:`optimizer`."""
        from shardfn.runtime.pipeline_experts import expert_dim

        sharded = (lambda path: expert_dim(path, self.expert_dims) is not None) if self.ep > 1 else None
        return global_grad_norm(grads, self.pp_group, over=self.schedule.n_ranks > 1, ep_group=self.ep_group,
                                sharded=sharded)

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

    def _aux_update(self, params_local: dict, counts: dict[int, torch.Tensor]) -> tuple[dict, dict]:
        """``params_local`` after the model's non-gradient update of each stage (``model.aux_update``)
        from the tokens per expert of the MoE layers that stage runs, summed over the whole batch
        (this rank's counts over ``dp`` and ``ep``); and the whole model's ``aux`` for the metrics
        (every stage's counts, summed over ``pp``)."""
        from shardfn.runtime.pipeline_experts import counted_layers

        lay = self.experts
        device = _device(self.held(params_local))
        total = torch.zeros((lay.n_layers, lay.n_experts), dtype=torch.int64, device=device)
        for layer, c in counts.items():
            total[layer] += c.to(device)
        _sum_over(total, self.dp_group, over=self.dp > 1)
        _sum_over(total, self.ep_group, over=self.ep > 1)
        out = dict(params_local)
        for s in self.stages:
            mine = counted_layers(self.pipe.stages[s])
            if mine:
                out[stage_key(s)] = self.model.aux_update(out[stage_key(s)], {"expert_counts": total[mine]},
                                                          self.model_cfg)
        _sum_over(total, self.pp_group, over=self.schedule.n_ranks > 1)  # each layer's counts live on one rank
        return out, {"expert_counts": total}


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
        return (
            torch.stack([torch.sum(torch.square(t.to(torch.float32))) for t in leaves]).sum()
            if leaves
            else torch.zeros(())
        )

    if sharded is None:
        sq = sum_sq([t for _, t in items])
    else:
        split = sum_sq([t for p, t in items if sharded(p)])
        sq = sum_sq([t for p, t in items if not sharded(p)]) + _sum_over(split, ep_group, over=True)
    return torch.sqrt(_sum_over(sq, pp_group, over=over))


def make_pipeline_step(pipe: Pipeline, schedule: Schedule, mesh=None, optimizer: OptimizerFactory | None = None, *,
                       compile: bool = False, record: bool = False, experts=None, model=None, model_cfg=None,
                       skip_nonfinite: bool = False, recorder=None) -> PipelineStep:
    """The training step of this rank for ``pipe`` run by ``schedule`` on ``mesh``.

    Args:
        pipe: the split loss (``schedule.n_stages`` stages).
        schedule: e.g. ``get_schedule("1f1b", n_ranks=mesh.axes["pp"], n_microbatches=8)``.
        mesh: a ``shardfn.Mesh`` with a ``pp`` axis (and optionally ``dp`` and ``ep``; other axes
            of size 1), or None for the default process group as the ``pp`` group. The batch is
            split over ``dp x ep``.
        optimizer: ``norm -> GradientTransformation``; the step passes the norm over all its
            stages (:meth:`PipelineStep.grad_norm`), for ``optim.clip_by_global_norm(c, norm=norm)``.
        compile: ``torch.compile`` every F / I / W program.
        record: time every action (``step.last_run.events``) and track held bytes.
        experts: for an MoE model, its ``pipeline_experts.ExpertLayout``: the leaves split over
            ``ep`` (``pipe`` traced with this rank's slices, through ``pipeline_experts.stage_loss``).
        recorder: the ``pipeline_experts.Recorder`` that loss counts its tokens per expert into.
        model, model_cfg: the model module and config whose ``aux_update`` and ``aux_metrics`` the
            step runs (MoE router balancing), or None.
        skip_nonfinite: a step whose loss or gradient norm is NaN/Inf keeps the incoming state.

    Example:
        step = make_pipeline_step(pipe, get_schedule("zbh1", 2, 4), sf.Mesh({"pp": 2}),
                                  lambda norm: optim.chain(optim.clip_by_global_norm(1.0, norm=norm), adamw(1e-3)))
    """
    if optimizer is None:
        raise ValueError("make_pipeline_step needs an optimizer: a function norm -> GradientTransformation, e.g. "
                         "lambda norm: make_optimizer(cfg.train, model, norm=norm)")
    check_fit(pipe, schedule)
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
    elif schedule.n_ranks > 1:
        pp_rank = dist.get_rank()
    if schedule.n_ranks > 1 and not schedule.has_communication:
        schedule = add_communication(schedule)
    if compile:
        for s in schedule.stages_of(pp_rank):
            for part in (pipe.stages[s].F, pipe.stages[s].I, pipe.stages[s].W):
                part.compile()
    step = PipelineStep(pipe, schedule, None, pp_rank, dp_rank, dp, pp_group, dp_group, record,
                        ep=ep, ep_rank=ep_rank, ep_group=ep_group, experts=experts, model=model, model_cfg=model_cfg,
                        skip_nonfinite=skip_nonfinite, recorder=recorder)
    step.optimizer = optimizer(step.grad_norm)
    return step


def build_pipeline_step(cfg, model, params: PyTree, *, mesh=None, record: bool = False) -> PipelineStep:
    """The pipeline training step of a run config (``mesh.pp > 1``), for this rank.

    Reads ``pipeline.schedule``, ``pipeline.microbatches`` and ``pipeline.stages`` (null: the
    schedule's stages per rank, ``partition.schedules.stages_per_rank``), ``mesh.pp``,
    ``mesh.dp`` and ``mesh.ep``, and the ``train`` section's optimizer, clipping, batch size and
    sequence length. Only this rank's stages get F / I / W programs. ``params`` gives shapes (real
    or fake). With ``mesh.ep > 1`` an MoE model's stages hold ``n_experts / ep`` experts per layer
    and exchange tokens over ``ep`` (``runtime.pipeline_experts``); the batch is split over
    ``dp x ep`` either way.

    Example:
        step = build_pipeline_step(cfg, llama, params)
        params_local = step.scatter(params); opt_state = step.optimizer.init(params_local)
        params_local, opt_state, metrics = step(params_local, opt_state, batch)
    """
    import shardfn as sf
    from shardfn.partition.layouts import check_model
    from shardfn.partition.stages import build_pipeline
    from shardfn.runtime import pipeline_experts

    pp, dp, ep = cfg.mesh.pp, cfg.mesh.dp, cfg.mesh.ep
    others = {k: v for k, v in cfg.mesh.axes().items() if k not in ("pp", "dp", "ep") and v > 1}
    if others:
        raise NotImplementedError(f"pipeline parallelism composes with mesh.dp and mesh.ep only so far; set "
                                  f"{', '.join(f'mesh.{k}=1' for k in others)} (mesh.dp splits the batch "
                                  f"instead, mesh.ep the experts)")
    check_model(model, cfg.model, cfg.mesh.axes(), cfg.rules)
    experts = pipeline_experts.expert_layout(model, cfg.model)
    if ep > 1 and experts is not None:
        rule = cfg.rules.get("expert")
        if rule != "ep" and list(rule or []) != ["ep"]:
            raise ValueError(f"rules.expert={rule!r} with mesh.ep={ep} and mesh.pp={pp}: pipeline stages split "
                             f"the routed experts over ep only; set rules.expert=ep (or mesh.ep=1)")
    p = cfg.pipeline
    sched = get_schedule(p.schedule, pp, p.microbatches, stages_per_rank(p.schedule, pp, p.stages))
    rows = cfg.train.batch_size // (dp * ep * p.microbatches)
    device = tree_flatten(params)[0][0].device
    tokens = torch.zeros(rows, cfg.train.seq_len, dtype=torch.long, device=device)
    if mesh is None:
        mesh = sf.Mesh({"pp": pp, "dp": dp, "ep": ep})
    coord = mesh.coordinate()
    ep_group = mesh.device_mesh.get_group("ep") if ep > 1 and experts is not None else None
    if ep_group is not None:  # traced with this rank's experts: [n_experts / ep, ...] slices
        params = pipeline_experts.shard_experts(params, experts.dims, coord["ep"], ep)
    recorder = pipeline_experts.Recorder() if experts is not None else None
    loss_fn = pipeline_experts.stage_loss(model, cfg.model, recorder, ep_group)
    pipe = build_pipeline(loss_fn, params, {"inputs": tokens, "targets": tokens}, sched.n_stages,
                          split=sched.stages_of(coord["pp"]))
    return make_pipeline_step(pipe, sched, mesh, lambda norm: make_optimizer(cfg.train, model, norm=norm),
                              compile=cfg.train.compile, record=record, experts=experts, model=model,
                              model_cfg=cfg.model, skip_nonfinite=cfg.train.nonfinite == "skip", recorder=recorder)


def pipeline_step(cfg, model, params: PyTree, *, record: bool = False) -> Step:
    """The :class:`~shardfn.runtime.step.Step` of a pipeline run (``mesh.pp > 1``) on this rank:
    its state is this rank's stages' slices (:meth:`PipelineStep.scatter`), and checkpoints hold
    them as blocks of the global tensors (``runtime.checkpoint_blocks``), with the optimizer
    state in the one-device structure.

    Example:
        step = pipeline_step(cfg, llama, params)
        local, opt_state = step.place(params)
    """
    pipe = build_pipeline_step(cfg, model, params, record=record)

    def place(params_full: PyTree):
        local = pipe.scatter(params_full)
        return local, pipe.optimizer.init(local)

    def to_checkpoint(params_local: dict, opt_state: Any):
        return pipe.checkpoint_blocks(params_local), pipe.state_blocks(opt_state)

    def from_checkpoint(params_blocks: PyTree, opt_state_blocks: Any):
        return pipe.from_blocks(params_blocks), pipe.state_from_blocks(opt_state_blocks, params_blocks)

    return Step("pipeline", pipe, pipe.optimizer, place, to_checkpoint, from_checkpoint, pipe.gather,
                write_trace=pipe.write_trace)
