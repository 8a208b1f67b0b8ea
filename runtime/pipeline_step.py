"""The training step of one pipeline rank: schedule, gradients, clipping, optimizer, state.

Each stage's F / I / W programs are partitioned over the stage's mesh -- the axes other than
``pp`` (``partition.stage_programs``) -- so a pipeline composes with dp, fsdp (and HSDP), ep and
tp through the same partitioner as every other step. One step of a rank:

1. with ``partition.reshard_after_forward=false`` (the default under pp) each stage's
   parameters are gathered over fsdp once, for all its microbatches;
2. the rank's action list runs (``runtime.executor.run_schedule``) on this rank's rows of each
   microbatch, adding each stage's gradients (partial sums over the data axes) as it goes;
3. each stage's summed gradients are reduced once onto its parameters' placements (a
   reduce-scatter over fsdp, an all-reduce over dp); a tied leaf's (embedding and head) are
   summed over the stages that hold it;
4. the optimizer updates this rank's blocks, clipping by the norm over every stage and rank
   (:meth:`PipelineStep.grad_norm`); a model's non-gradient update (MoE routers' selection
   bias) runs on each stage from the tokens per expert its layers counted.

It has the contract of a one-device step, ``(params_local, opt_state_local, global_batch) ->
(params_local, opt_state_local, metrics)``; the state's layout is ``runtime.rank_layout``'s.

    step = build_pipeline_step(cfg, model, params)
    params_local = step.scatter(params); opt_state = step.optimizer.init(params_local)
    params_local, opt_state, metrics = step(params_local, opt_state, batch)
    params = step.gather(params_local)                     # the full tree, on every rank
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardfn import models
from shardfn.core import _torch_private as private
from shardfn.core import optim
from shardfn.core.precision import with_policy
from shardfn.core.pytree import PyTree, flatten_with_paths, tree_leaves
from shardfn.partition.pipeline.schedules import Schedule, add_communication, get_schedule, stages_per_rank
from shardfn.partition.pipeline.split import Pipeline
from shardfn.partition.pipeline.stage_programs import StagePrograms, lower_stage
from shardfn.partition.spec import P
from shardfn.partition.spmd import report
from shardfn.partition.spmd.context_rules import balanced_batch
from shardfn.runtime.executor import RunResult, check_fit, run_schedule, split_microbatches, write_chrome_trace
from shardfn.runtime.param_source import Source, as_source
from shardfn.runtime.rank_layout import RankLayout, nest, stage_key
from shardfn.runtime.step import Step
from shardfn.runtime.train_step import keep_finite, make_optimizer, precision_policy, step_metrics

_STEP_METRICS = ("loss", "grad_norm", "lr")
"""What ``step_metrics`` reports; an aux value of the same name is not reported over it."""

OptimizerFactory = Callable[[Callable[[PyTree], torch.Tensor]], optim.GradientTransformation]
"""``norm -> optimizer``: the pipeline step hands in the norm over all stages for clipping."""


@dataclass(frozen=True)
class StageBuild:
    """How each stage's F / I / W programs are built (``stage_programs.lower_stage``): under
    ``torch.compile`` (``train.compile``), with a ``partition.remat`` policy for every stage's
    joint (``train.remat``), Megatron sequence parallelism over the stage mesh's
    ``sequence_parallel`` axes (``("tp",)`` under ``partition.sequence_parallel``), fsdp-sharded
    parameters re-gathered in every microbatch's F and I instead of once per step
    (``partition.reshard_after_forward``), on ``device`` (None: the traced loss's). ``all_stages``
    builds every stage's programs, not only this rank's (one rank's view of all ranks, for plans).

        StageBuild(compile=cfg.train.compile, remat=cfg.train.remat)
        StageBuild(reshard_after_forward=True, sequence_parallel=("tp",), all_stages=True)
    """

    compile: bool = False
    remat: str = "none"
    sequence_parallel: tuple[str, ...] = ()
    reshard_after_forward: bool = False
    all_stages: bool = False
    device: torch.device | None = None


@dataclass(frozen=True)
class MoEUpdate:
    """An MoE model's non-gradient update (its routers' selection bias): the model's loss counts
    tokens per expert into ``recorder`` (a ``pipeline_experts.Recorder``, reset every call); the
    step runs ``model.aux_update(stage_params, aux, model_cfg)`` on each stage from the counts of
    the layers it runs (``experts``: the model's ``pipeline_experts.ExpertLayout``) and reports
    ``model.aux_metrics``. ``model_cfg`` is the run's ``model`` section.

        experts = pipeline_experts.expert_layout(moe, cfg.model)
        MoEUpdate(moe, cfg.model, experts, pipeline_experts.Recorder())
    """

    model: Any
    model_cfg: Any
    experts: Any
    recorder: Any


@dataclass(frozen=True)
class RunOptions:
    """How each call runs the schedule and the update: ``record`` times every action
    (``step.last_run.events``, :meth:`PipelineStep.write_trace`) and tracks held bytes;
    ``receive_at`` is ``run_schedule``'s (``"use"``: wait on a receive where its tensor is read,
    ``"post"``: where it is posted); ``overlap_pairs`` (``pipeline.overlap_pairs``): where the
    stages run an MoE exchange, each overlapped pair's two members take turns at its all-to-all
    waits; ``skip_nonfinite`` (``train.nonfinite=skip``): a step whose loss or gradient norm is
    NaN/Inf keeps the incoming state.

        RunOptions(record=True)
        RunOptions(overlap_pairs=cfg.pipeline.overlap_pairs, skip_nonfinite=cfg.train.nonfinite == "skip")
    """

    record: bool = False
    receive_at: str = "use"
    overlap_pairs: bool = False
    skip_nonfinite: bool = False


@dataclass
class LatestCall:
    """What the latest call of a :class:`PipelineStep` left: its schedule ``run``, the reduced
    ``grads`` (before clipping) and ``eager``, the ``(op, axis, bytes)`` of the step's own
    collectives. The step's one mutable part; each call overwrites it.

        step.latest.run.events      # with RunOptions(record=True)
        step.latest.eager           # [("all_reduce", "pp", 4), ...]
    """

    run: RunResult | None = None
    grads: dict | None = None
    eager: list = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class PipelineStep:
    """The training step of one pipeline rank; call it like a one-device step.

    ``params_local`` is ``{"stage<s>": subtree}`` for this rank's stages (``runtime.rank_layout``):
    build it with :meth:`scatter` (or ``layout.from_source``), rebuild the full tree with
    :meth:`gather`. Everything it runs with is given at construction (:func:`make_pipeline_step`
    builds it) and frozen; only :attr:`latest` (``last_run``, ``last_grads``, ``eager``) changes,
    with every call. ``dataclasses.replace(step, run=...)`` runs the same programs another way,
    with its own :attr:`optimizer` and :attr:`latest`.

    Attributes:
        layout: what this rank holds (:class:`~shardfn.runtime.rank_layout.RankLayout`).
        pipe: the pipeline with this rank's programs in its own stages (what the executor runs).
        schedule: the schedule, with communication.
        optimizer_factory: ``norm -> GradientTransformation``; the step builds :attr:`optimizer`
            from it with :meth:`grad_norm`.
        mesh: the stage's mesh (the non-pp axes; None: one device per stage).
        batch_axes, seq_axes: the stage mesh's axes that split the batch and the sequence
            (context parallelism: ``mesh.cp``).
        placements: ``path -> stored placements`` of every parameter on the stage mesh.
        moe: an MoE model's non-gradient update (:class:`MoEUpdate`; None: none).
        run: how each call runs (:class:`RunOptions`).
        optimizer: the run's optimizer, clipping by :meth:`grad_norm`.
        latest: the latest call's schedule run, reduced gradients and collectives (:class:`LatestCall`).

    Example:
        step = make_pipeline_step(pipe, schedule, mesh, lambda norm: make_optimizer(cfg.train, model, norm=norm))
        params_local = step.scatter(params); opt_state = step.optimizer.init(params_local)
        params_local, opt_state, metrics = step(params_local, opt_state, batch)
    """

    layout: RankLayout
    pipe: Pipeline
    schedule: Schedule
    optimizer_factory: OptimizerFactory
    mesh: Any = None
    batch_axes: tuple[str, ...] = ()
    seq_axes: tuple[str, ...] = ()
    placements: dict = field(default_factory=dict)
    moe: MoEUpdate | None = None
    run: RunOptions = RunOptions()
    optimizer: optim.GradientTransformation = field(init=False, repr=False)
    latest: LatestCall = field(init=False, repr=False, default_factory=LatestCall)

    def __post_init__(self):
        object.__setattr__(self, "optimizer", self.optimizer_factory(self.grad_norm))

    # -- state ---------------------------------------------------------------------------
    @property
    def stages(self) -> tuple[int, ...]:
        return self.layout.stages

    @property
    def programs(self) -> dict[int, StagePrograms]:
        return self.layout.programs

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank

    @property
    def last_run(self) -> RunResult | None:
        """The latest call's schedule run (``events`` and ``peak_saved_bytes`` with ``run.record``)."""
        return self.latest.run

    @property
    def last_grads(self) -> dict | None:
        """The latest call's reduced gradients (before clipping), as ``params_local``."""
        return self.latest.grads

    @property
    def eager(self) -> list:
        """``(op, axis, bytes)`` of the step's own collectives in the latest call."""
        return self.latest.eager

    def scatter(self, params: PyTree) -> dict:
        """This rank's local tree from the full parameter tree."""
        return self.layout.scatter(params)

    def gather(self, params_local: dict) -> PyTree:
        """The full parameter tree, on every rank."""
        return self.layout.gather(params_local)

    def gather_state(self, opt_state: Any) -> Any:
        """The optimizer state with full trees (``RankLayout.gather_state``), on every rank."""
        return self.layout.gather_state(opt_state)

    def scatter_state(self, opt_state_full: Any, params: PyTree) -> Any:
        """Inverse of :meth:`gather_state`."""
        return self.layout.scatter_state(opt_state_full, params)

    # -- the step ------------------------------------------------------------------------
    def __call__(self, params_local: dict, opt_state: Any, global_batch: dict) -> tuple[dict, Any, dict]:
        self.latest.eager = []
        if self.moe is not None:
            self.moe.recorder.reset()  # this step's tokens per expert
        for records in self.records:
            records.reset()  # this step's all-to-alls
        held = self.layout.held(params_local)
        use = {s: self.programs[s].gather_params(held[s]) for s in self.stages}
        out = run_schedule(self.pipe, self.schedule, self.pp_rank, use, self.microbatches(global_batch),
                           group=self.layout.pp_group, record=self.run.record, receive_at=self.run.receive_at,
                           overlap_pairs=self.run.overlap_pairs and bool(self.records))
        self.latest.run = out
        grads = {s: self.programs[s].reduce_grads(out.grads[s]) for s in self.stages}
        grads = self._sum_tied(grads)
        grads = {stage_key(s): nest(grads[s]) for s in self.stages}
        self.latest.grads = grads
        updates, new_state = self.optimizer.update(grads, opt_state, params_local)
        new_params = optim.apply_updates(params_local, updates)
        loss = out.loss.detach().clone() if out.loss is not None else torch.zeros((), device=self._device(held))
        loss = self._all_reduce(loss, "pp")  # the last stage's ranks hold it; the others add zeros
        metrics = step_metrics(loss, grads, new_state, norm=self.grad_norm)
        for key in self.pipe.aux_keys:  # each rank's stages hold their parts of it; the others add zeros
            if key not in _STEP_METRICS:
                part = out.aux.get(key)
                part = part.detach().clone() if part is not None else torch.zeros((), device=self._device(held))
                metrics[key] = self._all_reduce(part.to(torch.float32), "pp")
        if self.moe is not None:
            new_params, aux = self._aux_update(new_params, self.moe.recorder.counts, held)
            metrics.update(self.moe.model.aux_metrics(aux))
        if self.run.skip_nonfinite:  # loss and grad_norm are global: every rank skips alike
            new_params, new_state = keep_finite((new_params, new_state), (params_local, opt_state), metrics)
        return new_params, new_state, metrics

    def microbatches(self, global_batch: dict) -> list[dict[str, torch.Tensor]]:
        """This rank's rows of each microbatch: the global batch cut into ``n_microbatches`` in
        order, each split over the stage mesh's batch axes (and, under context parallelism, its
        load-balanced sequence over the sequence axes) as its programs expect."""
        if self.seq_axes:
            split = math.prod(self.mesh.axes[a] for a in self.seq_axes)
            global_batch = balanced_batch(global_batch, split)
        mbs = split_microbatches(global_batch, self.schedule.n_microbatches)
        if self.mesh is None:
            return mbs
        dmesh = self.mesh.device_mesh
        spec = batch_and_seq_spec(self.batch_axes, self.seq_axes)

        def rows(t: torch.Tensor) -> torch.Tensor:
            pl = self.mesh.placements(spec, t.ndim, where="a batch leaf")
            shape, offset = private.local_shape_and_offset(t.shape, dmesh, pl)
            for d in range(min(t.ndim, 2)):
                t = t.narrow(d, offset[d], shape[d])
            return t.contiguous()

        return [{p: rows(t) for p, t in mb.items()} for mb in mbs]

    def grad_norm(self, grads: dict) -> torch.Tensor:
        """The L2 norm of every stage's gradients (``grads``: this rank's local tree, on the
        parameters' placements), as one device computes it: each block's sum of squares divided
        by the ranks that hold the same block, summed over every rank. The clipping norm of
        :attr:`optimizer`."""
        tied = self.pipe.tied
        parts = []
        for s in self.stages:
            for path, g in flatten_with_paths(grads[stage_key(s)]):
                if path in tied and tied[path][0] != s:
                    continue  # a tied leaf counts once
                parts.append(torch.sum(torch.square(g.to(torch.float32))) / self.programs[s].replicas(path))
        sq = torch.stack(parts).sum() if parts else torch.zeros(())
        for axis in self._mesh_axes():
            sq = self._all_reduce(sq, axis)
        return torch.sqrt(self._all_reduce(sq, "pp"))

    # -- collectives of the step itself --------------------------------------------------
    def _mesh_axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.dims) if self.mesh is not None else ()

    def _group(self, axis: str):
        return self.layout.pp_group if axis == "pp" else self.mesh.device_mesh.get_group(axis)

    def _all_reduce(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """``x`` summed in place over the mesh axis ``axis`` (a no-op when that axis has one rank);
        recorded for :meth:`comm_report`."""
        if axis == "pp" and self.layout.n_ranks == 1:
            return x
        dist.all_reduce(x, group=self._group(axis))
        self.latest.eager.append(("all_reduce", axis, x.numel() * x.element_size()))
        return x

    def _sum_tied(self, grads: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
        """Each tied leaf's gradient summed over the stages that hold it, on every holder."""
        for path, holders in self.pipe.tied.items():
            mine = [s for s in holders if s in grads]
            across = self._tied_across_ranks(holders)  # else every holder is on one pp rank: a local sum
            if not mine and not across:
                continue
            total = sum((grads[s][path] for s in mine[1:]), grads[mine[0]][path].clone()) if mine else \
                torch.zeros(self._tied_shape(path), dtype=self.pipe.param_specs[path].dtype,
                            device=self._device(grads))
            if across:
                total = self._all_reduce(total, "pp")
            for s in mine:
                grads[s][path] = total
        return grads

    def _tied_across_ranks(self, holders) -> bool:
        """Whether a tied leaf's holders sit on more than one pp rank (so its sum is a collective)."""
        return len({self.layout.stage_to_rank[s] for s in holders}) > 1

    def _tied_shape(self, path: str) -> tuple[int, ...]:
        """This rank's block shape of a tied leaf it does not hold (every holder's is the same)."""
        shape = self.pipe.param_specs[path].shape
        if self.mesh is None:
            return tuple(shape)
        return private.local_shape(shape, self.mesh.device_mesh, self.placements[path])

    def _aux_update(self, params_local: dict, counts: dict[int, torch.Tensor], held) -> tuple[dict, dict]:
        """``params_local`` after the model's non-gradient update of each stage (``model.aux_update``)
        from the tokens per expert of the MoE layers that stage runs, summed over the batch axes;
        and the whole model's ``aux`` for the metrics (every stage's counts, summed over ``pp``)."""
        from shardfn.runtime.pipeline_experts import counted_layers

        lay = self.moe.experts
        total = torch.zeros((lay.n_layers, lay.n_experts), dtype=torch.int64, device=self._device(held))
        for layer, c in counts.items():
            total[layer] += c.to(total.device)
        for axis in self.batch_axes:
            total = self._all_reduce(total, axis)
        out = dict(params_local)
        for s in self.stages:
            mine = counted_layers(self.pipe.stages[s], lay)
            if mine:
                out[stage_key(s)] = self.moe.model.aux_update(out[stage_key(s)], {"expert_counts": total[mine]},
                                                              self.moe.model_cfg)
        total = self._all_reduce(total, "pp")  # each layer's counts live on one pp rank
        return out, {"expert_counts": total}

    @staticmethod
    def _device(held: dict) -> torch.device:
        return next((t.device for p in held.values() for t in p.values()), torch.device("cpu"))

    # -- reports -------------------------------------------------------------------------
    def comm_report(self, pp_rank: int | None = None) -> list[dict]:
        """Collectives per step of one pp rank (default this one), rows ``{op, axis, bytes, count}``:
        each of its stages' F / I / W programs once per microbatch, the per-step parameter gather
        and gradient reduction, the P2P sends of its schedule (``op: "p2p"``), the step's own
        reductions (clipping norm, loss, tied gradients, expert counts: as the latest call ran
        them, or as planned before any call or for another rank), and -- after a step has run on
        this rank -- one ``all_to_all`` row per MoE layer with the bytes its exchanges moved.

            rows = step.comm_report()   # [{"op": "all_gather", "axis": "fsdp", "bytes": ..., "count": ...}, ...]
        """
        r = self.pp_rank if pp_rank is None else pp_rank
        total: dict = defaultdict(lambda: [0, 0])

        def add(rows, times=1):
            for row in rows:
                acc = total[(row["op"], row["axis"])]
                acc[0] += row["bytes"] * times
                acc[1] += row["count"] * times

        m = self.schedule.n_microbatches
        for s in self.schedule.stages_of(r):
            prog = self.programs[s]
            if prog.mesh is None:
                continue
            for part in (prog.stage.F, prog.stage.I, prog.stage.W):
                add(report.comm_report(part.graph_module, prog.mesh), m)
            for program in (prog.gather, prog.reduce):
                if program is not None:
                    add(report.comm_report(program.graph_module, prog.mesh))
        sched = self.schedule if self.schedule.has_communication else add_communication(self.schedule)
        for a in sched.actions[r]:
            if a.kind in ("SEND_F", "SEND_B"):
                st = self.programs[a.stage].stage
                add([{"op": "p2p", "axis": "pp", "bytes": (st.out_spec if a.kind == "SEND_F" else st.in_spec).nbytes,
                      "count": 1}])
        eager = self.eager if (r == self.pp_rank and self.eager) else self.planned_reductions(r)
        add([{"op": op, "axis": axis, "bytes": b, "count": 1} for op, axis, b in eager])
        rows = [{"op": op, "axis": axis, "bytes": b, "count": c} for (op, axis), (b, c) in sorted(total.items())]
        if r == self.pp_rank and self.mesh is not None:
            for records in self.records:
                rows += records.rows(self.mesh)
        return rows

    @property
    def records(self) -> list:
        """What the regions of the programs that communicate by themselves (the MoE exchange)
        recorded in the latest step."""
        return [r.records for r in self.pipe.regions if r.records is not None]

    def planned_reductions(self, pp_rank: int) -> list[tuple[str, str, int]]:
        """``(op, axis, bytes)`` of the step's own reductions on ``pp_rank``, in the order
        :meth:`__call__` runs them (what :attr:`eager` records)."""
        pp = self.layout.n_ranks > 1
        out = []
        for path, holders in self.pipe.tied.items():
            if self._tied_across_ranks(holders):
                shape = self._tied_shape(path)
                n = 1
                for d in shape:
                    n *= d
                out.append(("all_reduce", "pp", n * _itemsize(self.pipe.param_specs[path].dtype)))
        if pp:
            out.append(("all_reduce", "pp", _itemsize(self.pipe.stages[-1].out_spec.dtype)))  # the loss
        out += [("all_reduce", a, 4) for a in self._mesh_axes()] + ([("all_reduce", "pp", 4)] if pp else [])
        if pp:  # the aux values' parts
            out += [("all_reduce", "pp", 4) for key in self.pipe.aux_keys if key not in _STEP_METRICS]
        if self.moe is not None:
            n = self.moe.experts.n_layers * self.moe.experts.n_experts * 8
            out += [("all_reduce", a, n) for a in self.batch_axes] + ([("all_reduce", "pp", n)] if pp else [])
        return out

    def memory_report(self, pp_rank: int | None = None) -> dict:
        """Bytes one pp rank (default this one) holds: ``params`` and ``opt_state`` (its blocks),
        ``grads`` (the gradient sums its programs leave across the microbatches: unsharded over
        fsdp until the step's reduction), ``gathered`` (parameters gathered for the step, with
        ``partition.reshard_after_forward=false``) and, after a recorded step on this rank,
        ``activations`` (the most bytes held for backward at once).

            step.memory_report()   # {"params": ..., "grads": ..., "opt_state": ..., "gathered": ..., ...}
        """
        r = self.pp_rank if pp_rank is None else pp_rank
        fake = self.fake_local(r)
        out = {"params": _tree_bytes(fake)}
        with private.fake_mode():
            out["opt_state"] = _tree_bytes(self.optimizer.init(fake))
        grads = gathered = 0
        for s in self.schedule.stages_of(r):
            prog = self.programs[s]
            for p in prog.stage.param_paths:
                size = _itemsize(prog.stage_global(p).dtype)
                grads += _numel(prog.local_shape(p, "grads" if prog.mesh is not None else "stored")) * size
                if p in prog.gathered:
                    gathered += _numel(prog.local_shape(p, "use")) * size
        out.update(grads=grads, gathered=gathered)
        if r == self.pp_rank and self.last_run is not None and self.run.record:
            out["activations"] = self.last_run.peak_saved_bytes
        return out

    def fake_local(self, pp_rank: int) -> dict:
        """A local tree of fake tensors shaped like what ``pp_rank`` holds (for reports)."""
        shapes = {s: {p: self.programs[s].local_shape(p) for p in self.programs[s].stage.param_paths}
                  for s in self.schedule.stages_of(pp_rank)}
        with private.fake_mode():
            return {stage_key(s): nest({p: torch.empty(shape, dtype=self.programs[s].stage_global(p).dtype)
                                        for p, shape in paths.items()}) for s, paths in shapes.items()}

    def write_trace(self, path: str | os.PathLike) -> Path | None:
        """Write the latest step's action timings of every rank as one Chrome trace (on global rank 0).

        Needs ``RunOptions(record=True)``. Every rank must call it (the events are gathered).
        """
        events = self.last_run.events if self.last_run is not None else []
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, events)
            events = [e for rank_events in everyone for e in rank_events]
            if dist.get_rank() != 0:
                return None
        return write_chrome_trace(events, path)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tree_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


# ----------------------------------------------------------------------------- building


def make_pipeline_step(pipe: Pipeline, schedule: Schedule, mesh=None, optimizer: OptimizerFactory | None = None, *,
                       specs: dict | None = None, batch_axes: tuple[str, ...] | None = None,
                       seq_axes: tuple[str, ...] = (), build: StageBuild = StageBuild(),
                       moe: MoEUpdate | None = None, run: RunOptions = RunOptions()) -> PipelineStep:
    """The training step of this rank for ``pipe`` run by ``schedule`` on ``mesh``.

    Args:
        pipe: the split loss (``schedule.n_stages`` stages), traced at the global microbatch
            (``train.batch_size / pipeline.microbatches`` rows), without F / I / W programs for
            the stages to partition (``build_pipeline(..., split=())``).
        schedule: e.g. ``get_schedule("1f1b", n_ranks=mesh.axes["pp"], n_microbatches=8)``.
        mesh: a ``shardfn.Mesh`` with a ``pp`` axis (any other axes form each stage's mesh), or
            None for the default process group as the ``pp`` group.
        optimizer: ``norm -> GradientTransformation``; the step passes the norm over all its
            stages (:meth:`PipelineStep.grad_norm`), for ``optim.clip_by_global_norm(c, norm=norm)``.
        specs: ``path -> P`` of every parameter on the stage mesh (None: replicated).
        batch_axes: the stage mesh's axes that split the batch (None: all of its axes but ``seq_axes``).
        seq_axes: the stage mesh's axes that split the sequence (``("cp",)``: context
            parallelism; the step load-balances each batch and the model reads ``positions``).
        build: how the stages' programs are built (:class:`StageBuild`).
        moe: an MoE model's non-gradient update (:class:`MoEUpdate`; None: none).
        run: how each call runs (:class:`RunOptions`).

    Example:
        step = make_pipeline_step(pipe, get_schedule("zbh1", 2, 4), sf.Mesh({"pp": 2, "fsdp": 2}),
                                  lambda norm: optim.chain(optim.clip_by_global_norm(1.0, norm=norm), adamw(1e-3)),
                                  build=StageBuild(compile=True), run=RunOptions(record=True))
    """
    if optimizer is None:
        raise ValueError("make_pipeline_step needs an optimizer: a function norm -> GradientTransformation, e.g. "
                         "lambda norm: make_optimizer(cfg.train, model, norm=norm)")
    check_fit(pipe, schedule)
    pp_rank, pp_group, stage_mesh = 0, None, None
    if mesh is not None:
        pp = mesh.axes.get("pp", 1)
        if pp != schedule.n_ranks:
            raise ValueError(f"the schedule has {schedule.n_ranks} ranks but mesh.pp is {pp}; build the schedule "
                             f"with n_ranks=mesh.pp")
        pp_rank = mesh.coordinate().get("pp", 0)
        pp_group = mesh.device_mesh.get_group("pp") if pp > 1 else None
        stage_mesh = mesh.sub([a for a in mesh.axes if a != "pp"])
        if stage_mesh.size == 1:
            stage_mesh = None
    elif schedule.n_ranks > 1:
        pp_rank = dist.get_rank()
    if schedule.n_ranks > 1 and not schedule.has_communication:
        schedule = add_communication(schedule)
    if batch_axes is None:
        batch_axes = tuple(a for a in stage_mesh.dims if a not in seq_axes) if stage_mesh is not None else ()
    batch_axes = tuple(a for a in batch_axes if stage_mesh is not None and a in stage_mesh.dims)
    seq_axes = tuple(a for a in seq_axes if stage_mesh is not None and a in stage_mesh.dims)
    batch = batch_and_seq_spec(batch_axes, seq_axes)
    specs = dict(specs or {})
    all_specs = {p: specs.get(p, P()) for p in pipe.param_specs}
    device = build.device
    if device is None:
        device = next((n.meta["val"].device for n in pipe.graph_module.graph.nodes if n.op == "placeholder"),
                      torch.device("cpu")) if pipe.graph_module is not None else torch.device("cpu")
    built = range(pipe.n_stages) if build.all_stages else schedule.stages_of(pp_rank)
    programs = {s: lower_stage(pipe.stages[s], stage_mesh, all_specs, batch,
                               gather_once=not build.reshard_after_forward, device=device, remat=build.remat,
                               sequence_parallel=build.sequence_parallel) for s in built}
    if build.compile:
        for s in schedule.stages_of(pp_rank):
            for part in (programs[s].stage.F, programs[s].stage.I, programs[s].stage.W):
                part.compile()
    run_pipe = dataclasses.replace(pipe, stages=[programs[s].stage if s in programs else st
                                                 for s, st in enumerate(pipe.stages)])
    layout = RankLayout(pipe, programs, tuple(schedule.stages_of(pp_rank)), tuple(schedule.stage_to_rank),
                        pp_rank, pp_group)
    placements = {}
    if stage_mesh is not None:
        placements = {p: stage_mesh.placements(all_specs[p], len(spec.shape)) for p, spec in pipe.param_specs.items()}
    return PipelineStep(layout, run_pipe, schedule, optimizer, stage_mesh, batch_axes, seq_axes, placements, moe, run)


def build_pipeline_step(cfg, model, params: PyTree, *, mesh=None, record: bool = False,
                        all_stages: bool = False) -> PipelineStep:
    """The pipeline training step of a run config (``mesh.pp > 1``), for this rank.

    Reads ``pipeline.schedule``, ``pipeline.microbatches``, ``pipeline.overlap_pairs`` and
    ``pipeline.stages`` (null: the schedule's stages per rank,
    ``partition.schedules.stages_per_rank``), the ``mesh`` (every
    axis but ``pp`` forms each stage's mesh), ``rules``, ``partition.reshard_after_forward``
    and the ``train`` section's optimizer, clipping, batch size and sequence length. The loss is
    traced once at the global microbatch; this rank's stages are partitioned on the stage mesh.
    ``params`` gives shapes (real or fake tensors, on the run's device).

    Example:
        step = build_pipeline_step(cfg, llama, params)
        params_local = step.scatter(params); opt_state = step.optimizer.init(params_local)
        params_local, opt_state, metrics = step(params_local, opt_state, batch)
    """
    model = models.get(model)
    import shardfn as sf
    from shardfn.core.pytree import tree_flatten
    from shardfn.partition.layouts.axes import (
        batch_axes,
        check_run,
        mesh_axes,
        param_specs,
        reshard_after_forward,
        resolve_rules,
        seq_axes,
    )
    from shardfn.partition.local_map import mesh_scope
    from shardfn.partition.pipeline.split import build_pipeline
    from shardfn.runtime import pipeline_experts

    check_run(model, cfg)
    p = cfg.pipeline
    pp = cfg.mesh.pp
    sched = get_schedule(p.schedule, pp, p.microbatches, stages_per_rank(p.schedule, pp, p.stages))
    if mesh is None:
        mesh = sf.Mesh(mesh_axes(cfg.mesh.axes()), device=torch.device(cfg.runtime.device).type)
    stage_axes = {a: n for a, n in mesh.axes.items() if a != "pp"}
    stage_mesh = mesh.sub(list(stage_axes))
    rules = resolve_rules(cfg.rules, stage_axes)
    specs = dict(flatten_with_paths(param_specs(model.param_axes(cfg.model), rules, stage_axes),
                                    is_leaf=lambda x: isinstance(x, P)))
    data = batch_axes(rules, stage_axes)
    seq = seq_axes(rules, stage_axes)
    batch = P(data if len(data) != 1 else data[0]) if data else P()  # the expert region's tokens
    device = tree_flatten(params)[0][0].device
    rows = cfg.train.batch_size // p.microbatches
    tokens = torch.zeros(rows, cfg.train.seq_len, dtype=torch.long, device=device)
    experts = pipeline_experts.expert_layout(model, cfg.model)
    recorder = pipeline_experts.Recorder() if experts is not None else None
    loss_fn = pipeline_experts.stage_loss(model, cfg.model, recorder, stage_mesh if stage_mesh.size > 1 else None,
                                          batch, capacity_factor=cfg.partition.capacity_factor)
    loss_fn = with_policy(loss_fn, precision_policy(cfg.train))  # stages compute (and send) in its dtype
    with mesh_scope(stage_mesh if stage_mesh.size > 1 else None):
        example = {"inputs": tokens, "targets": tokens}
        if seq:  # context parallelism: the model reads each token's position (load-balanced order)
            example["positions"] = torch.arange(cfg.train.seq_len, device=device).expand(rows, -1)
        pipe = build_pipeline(loss_fn, params, example, sched.n_stages, split=())
    build = StageBuild(compile=cfg.train.compile, remat=cfg.train.remat,
                       sequence_parallel=("tp",) if cfg.partition.sequence_parallel and "tp" in stage_mesh.axes else (),
                       reshard_after_forward=reshard_after_forward(cfg), all_stages=all_stages, device=device)
    run = RunOptions(record=record, overlap_pairs=p.overlap_pairs, skip_nonfinite=cfg.train.nonfinite == "skip")
    moe = MoEUpdate(model, cfg.model, experts, recorder) if experts is not None else None
    return make_pipeline_step(pipe, sched, mesh, lambda norm: make_optimizer(cfg.train, model, norm=norm),
                              specs=specs, batch_axes=data, seq_axes=seq, build=build, moe=moe, run=run)


def batch_and_seq_spec(batch_axes: tuple[str, ...], seq_axes: tuple[str, ...]) -> P:
    """The spec of a ``[batch, seq, ...]`` value split over ``batch_axes`` and ``seq_axes``.

        batch_and_seq_spec(("dp",), ("cp",))   # P('dp', 'cp')
    """
    first = (batch_axes if len(batch_axes) != 1 else batch_axes[0]) if batch_axes else None
    if not seq_axes:
        return P(first) if first is not None else P()
    return P(first, seq_axes if len(seq_axes) != 1 else seq_axes[0])


def pipeline_step(cfg, model, params: PyTree, *, record: bool = False) -> Step:
    """The :class:`~shardfn.runtime.step.Step` of a pipeline run (``mesh.pp > 1``) on this rank:
    its state is this rank's blocks (``runtime.rank_layout``), built from a source of regions so
    a rank makes only its own, and checkpoints hold them as blocks of the global tensors
    (``runtime.checkpoint_blocks``), with the optimizer state in the one-device structure.

    Example:
        step = pipeline_step(cfg, llama, params)
        local, opt_state = step.place(source)      # a full tree, or source(regions) -> {path: tensor}
    """
    model = models.get(model)
    pipe = build_pipeline_step(cfg, model, params, record=record)
    layout = pipe.layout

    def place(params_or_source: PyTree | Source):
        local = layout.from_source(as_source(params_or_source))
        return local, pipe.optimizer.init(local)

    def to_checkpoint(params_local: dict, opt_state: Any):
        return layout.checkpoint_blocks(params_local), layout.state_blocks(opt_state)

    def from_checkpoint(params_blocks: PyTree, opt_state_blocks: Any):
        return layout.from_blocks(params_blocks), layout.state_from_blocks(opt_state_blocks, params_blocks)

    return Step("pipeline", pipe, pipe.optimizer, place, to_checkpoint, from_checkpoint, layout.gather,
                mesh=pipe.mesh, write_trace=pipe.write_trace, comm_report=pipe.comm_report,
                memory_report=pipe.memory_report)
