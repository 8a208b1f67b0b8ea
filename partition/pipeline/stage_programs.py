"""A pipeline stage's programs on its mesh: the stage's joint partitioned over the non-pp axes.

The pipeline (``partition.pipeline.split``) cuts the loss at global shapes; each stage's joint
(forward and backward, ``partition.pipeline.fiw.joint_graph``) is then partitioned by the same
interpreter as every other step (``partition.spmd.propagate`` under ``partition.spmd.lower``) on the
stage's mesh -- the axes other than ``pp`` -- and the per-rank program is cut into F / I / W.
So fsdp gathers on use, Megatron tp, the MoE exchange over ep, and dp / HSDP data splits are
the same inside a pipeline as outside it.

What crosses program boundaries has one fixed layout (:class:`StageLayout`): activations and
their gradients between stages are split over the batch axes and replicated elsewhere (the
residual stream of Megatron tp); the loss is replicated. Parameters are *stored* in their specs'
placements. With ``gather_once`` (``partition.reshard_after_forward=false``, the default under
pp) a per-step program gathers each stage's parameters over fsdp before its first microbatch
and F / I / W read the gathered copies, so nothing is gathered per microbatch; otherwise F and I
gather on use, per microbatch. Either way W leaves gradients as partial sums over the data axes,
the executor adds them over the microbatches, and one per-step program reduces them onto the
stored placements: a reduce-scatter over fsdp, an all-reduce over dp, once per step.

    programs = lower_stage(stage, mesh, specs, batch_spec, gather_once=True)
    programs.stage.F.run(env)                       # local tensors in and out
    use = programs.gather_params(held)              # once per step
    grads = programs.reduce_grads(accumulated)      # once per step
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import torch
from torch.distributed.tensor import Replicate, Shard

from shardfn.core import _torch_private as private
from shardfn.partition.local_map import mesh_scope
from shardfn.partition.passes.points import PassPipeline
from shardfn.partition.pipeline.fiw import joint_graph, set_programs, split_fiw, split_joint
from shardfn.partition.pipeline.split import Stage, TensorSpec
from shardfn.partition.spec import P, check_divisible
from shardfn.partition.spmd.lower import Lowered, lower, lower_redistribute
from shardfn.partition.spmd.trace import Traced


@dataclass(frozen=True)
class StageLayout:
    """How one stage's values are placed on its mesh (DTensor placements per mesh dim).

    Attributes:
        stored: ``path -> placements`` of the parameters as the state holds them.
        use: ``path -> placements`` as F / I / W read them (``stored``, or gathered over fsdp).
        grads: ``path -> placements`` W's gradients leave in (partial sums until reduced).
        activation: placements of the stage's input, output and their gradients.
        data: ``path -> placements`` of the batch leaves the stage reads.
        loss: placements of the last stage's loss (replicated).
    """

    stored: dict
    use: dict
    grads: dict
    activation: tuple
    data: dict
    loss: tuple


@dataclass
class StagePrograms:
    """One stage as a rank runs it.

    Attributes:
        stage: the stage with this rank's F / I / W and its boundary specs at local shapes (what
            the executor runs, receives and sends); ``param_specs`` stay the stage's global ones.
        mesh: the stage's mesh (``None`` when it is one device: programs run unpartitioned).
        layout: the :class:`StageLayout` (None on one device).
        joint: the partitioned joint before the F / I / W cut (None on one device).
        gather: the per-step program ``stored -> use`` for :attr:`gathered` (None: nothing to gather).
        reduce: the per-step program ``grads -> stored`` (None: nothing to reduce).
        gathered: the parameter paths :attr:`gather` takes, in order.
    """

    stage: Stage
    mesh: object = None
    layout: StageLayout | None = None
    joint: Lowered | None = None
    gather: Lowered | None = None
    reduce: Lowered | None = None
    gathered: tuple[str, ...] = ()

    def gather_params(self, held: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``path -> tensor`` as F / I / W read them, from the stored ``held`` (once per step)."""
        if self.gather is None:
            return dict(held)
        out = dict(held)
        out.update(zip(self.gathered, self.gather.graph_module(*[held[p] for p in self.gathered])))
        return out

    def reduce_grads(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The summed microbatch gradients moved onto the stored placements (once per step)."""
        if self.reduce is None:
            return dict(grads)
        paths = self.stage.param_paths
        return dict(zip(paths, self.reduce.graph_module(*[grads[p] for p in paths])))

    def local_shape(self, path: str, which: str = "stored") -> tuple[int, ...]:
        """This rank's shape of the stage's leaf ``path`` under ``which`` (stored, use, grads)."""
        shape = self.stage_global(path).shape
        if self.mesh is None:
            return tuple(shape)
        return private.local_shape(shape, self.mesh.device_mesh, getattr(self.layout, which)[path])

    def local_offset(self, path: str) -> tuple[int, ...]:
        """Where this rank's stored block of the stage's leaf ``path`` starts in the stage's tensor."""
        spec = self.stage_global(path)
        if self.mesh is None:
            return (0,) * len(spec.shape)
        return private.local_shape_and_offset(spec.shape, self.mesh.device_mesh, self.layout.stored[path])[1]

    def replicas(self, path: str) -> int:
        """How many ranks of the stage's mesh hold the same stored block of ``path``."""
        if self.mesh is None:
            return 1
        n = 1
        for name, p in zip(self.mesh.dims, self.layout.stored[path]):
            if isinstance(p, Replicate):
                n *= self.mesh.axes[name]
        return n

    def stage_global(self, path: str) -> TensorSpec:
        return self.stage.param_specs[path]


def _placements(mesh, spec, ndim: int, where: str):
    return mesh.placements(spec, ndim, where=where)


def _gathered(placements: tuple, dims: tuple[str, ...], axes: tuple[str, ...]) -> tuple:
    return tuple(Replicate() if name in axes and isinstance(p, Shard) else p for name, p in zip(dims, placements))


def stage_layout(stage: Stage, mesh, specs: Mapping[str, P], batch: P, data_specs: Mapping[str, TensorSpec], *,
                 gather_once: bool, fsdp_axes: tuple[str, ...] = ("fsdp",)) -> StageLayout:
    """The :class:`StageLayout` of ``stage`` on ``mesh`` from the parameters' specs (by path),
    the batch spec and the microbatch's leaves; W's gradient placements are left to
    :func:`lower_stage`, which learns them from propagation."""
    stored, use = {}, {}
    for path in stage.param_paths:
        shape = stage.param_specs[path].shape
        where = f"parameter {path} {list(shape)} of pipeline stage {stage.index}"
        check_divisible(shape, specs[path], mesh.axes, where=where)
        stored[path] = _placements(mesh, specs[path], len(shape), where)
        use[path] = _gathered(stored[path], mesh.dims, fsdp_axes) if gather_once else stored[path]
    boundary = stage.in_spec if stage.is_last else stage.out_spec
    activation = ()
    if boundary is not None:
        where = f"the activations {list(boundary.shape)} between pipeline stages"
        check_divisible(boundary.shape, batch, mesh.axes, where=where)
        activation = _placements(mesh, batch, len(boundary.shape), where)
    data = {}
    for path, spec in data_specs.items():
        where = f"batch leaf {path} {list(spec.shape)} of one microbatch"
        check_divisible(spec.shape, batch, mesh.axes, where=where)
        data[path] = _placements(mesh, batch, len(spec.shape), where)
    return StageLayout(stored, use, {}, activation, data, (Replicate(),) * len(mesh.dims))


def _local_spec(spec: TensorSpec, mesh, placements) -> TensorSpec:
    return TensorSpec(private.local_shape(spec.shape, mesh.device_mesh, placements), spec.dtype)


def lower_stage(stage: Stage, mesh, specs: Mapping[str, P], batch: P, *, gather_once: bool,
                fsdp_axes: tuple[str, ...] = ("fsdp",), device: torch.device | str = "cpu",
                remat: str = "none", sequence_parallel: tuple[str, ...] = ()) -> StagePrograms:
    """``stage``'s programs for one rank of ``mesh`` (the stage's mesh, no ``pp``).

    Args:
        stage: a stage of ``partition.pipeline.split.build_pipeline`` (traced at the global microbatch).
        mesh: the stage's ``sf.Mesh`` (``mesh.sub([...])`` of the run's); one device: the stage
            runs unpartitioned (``partition.pipeline.fiw.split_fiw``).
        specs: ``path -> P`` of every parameter the stage holds.
        batch: the spec of ``[batch, ...]`` values (``partition.layouts.axes.batch_spec``).
        gather_once: gather the parameters over ``fsdp_axes`` once per step (a separate program)
            rather than on each use in F and I.
        remat: a ``partition.passes.remat`` policy applied to the stage's joint before it is partitioned.
        sequence_parallel: mesh axes for Megatron sequence parallelism inside the stage (``lower``).

    Example:
        programs = lower_stage(pipe.stages[1], mesh.sub(["fsdp", "tp"]), specs, P("fsdp"), gather_once=True)
        print(programs.joint.graph_module.graph)
    """
    if mesh is None or mesh.size == 1:
        local = dataclasses.replace(stage)
        return StagePrograms(split_fiw(local, device, remat))
    with mesh_scope(mesh):
        gm, names = joint_graph(stage, device, remat)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    in_meta = [n.meta["val"] for n in placeholders]
    data_specs = {name[5:]: TensorSpec.of(m) for name, m in zip(names, in_meta) if name.startswith("data:")}
    layout = stage_layout(stage, mesh, specs, batch, data_specs, gather_once=gather_once, fsdp_axes=fsdp_axes)
    out_meta = [o.meta["val"] for o in outputs]
    in_pl, stored = [], []
    for name in names:
        kind, _, path = name.partition(":")
        if kind == "param":
            in_pl.append(layout.use[path])
            stored.append(not gather_once)
        elif kind == "data":
            in_pl.append(layout.data[path])
            stored.append(False)
        else:  # x, or dy: the loss's seed on the last stage, else the next stage's input gradient;
            # dloss: the seed of the stage's part of the loss (replicated, as the loss)
            in_pl.append(layout.loss if ((name == "dy" and stage.is_last) or name == "dloss") else layout.activation)
            stored.append(False)
    has_x = stage.in_spec is not None
    out_pl = [layout.loss if stage.is_last else layout.activation] + ([layout.activation] if has_x else [])
    n_sides = len(stage.sides)
    out_pl += [None] * (len(out_meta) - len(out_pl) - n_sides)  # gradients: as propagation leaves them
    out_pl += [layout.loss] * n_sides  # the side results: replicated, as the loss
    traced = Traced(gm, None, None, list(names), in_meta, out_meta)
    with mesh_scope(mesh):
        joint = lower(traced, mesh, in_pl, out_pl, stored=stored, fsdp_axes=fsdp_axes,
                      sequence_parallel=sequence_parallel)
        joint.graph_module = PassPipeline().run("after_lower", traced, joint.graph_module)
    head = 1 + has_x
    grads = dict(zip(stage.param_paths, joint.out_placements[head:head + len(stage.param_paths)]))
    layout = dataclasses.replace(layout, grads=grads)
    local = dataclasses.replace(
        stage,
        in_spec=_local_spec(stage.in_spec, mesh, layout.activation) if has_x else None,
        out_spec=_local_spec(stage.out_spec, mesh, layout.loss if stage.is_last else layout.activation),
    )
    set_programs(local, split_joint(joint.graph_module, names, has_x, n_sides))
    gathered = tuple(p for p in stage.param_paths if layout.use[p] != layout.stored[p])
    gather = None
    if gathered:
        metas = [stage.param_specs[p].empty("meta") for p in gathered]
        gather = lower_redistribute(metas, mesh, [layout.stored[p] for p in gathered],
                                    [layout.use[p] for p in gathered])
    reduce = None
    if any(grads[p] != layout.stored[p] for p in stage.param_paths):
        metas = [stage.param_specs[p].empty("meta") for p in stage.param_paths]
        reduce = lower_redistribute(metas, mesh, [grads[p] for p in stage.param_paths],
                                    [layout.stored[p] for p in stage.param_paths])
    return StagePrograms(local, mesh, layout, joint, gather, reduce, gathered)

