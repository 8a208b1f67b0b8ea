"""The training step of a run config, partitioned over the config's mesh.

The layout comes from the config alone: ``mesh`` sizes and logical-axis ``rules`` give a spec
for every parameter, the optimizer state follows the parameters, the global batch is split over
the data axes (and its sequence over ``cp``, in the load-balanced order of
``partition.spmd.context_rules``), and gradients are constrained to the parameters' specs (so under ``fsdp`` they
are reduce-scattered, under ``dp`` all-reduced). Model code is untouched.

    step = mesh_step(cfg, model, optimizer, params, mesh_from_config(cfg))
    params, opt_state = step.place(params)                         # DTensors of step.specs
    params, opt_state, metrics = step(params, opt_state, batch)
"""

from __future__ import annotations

import warnings
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

import shardfn as sf
from shardfn import models
from shardfn.core import optim
from shardfn.core.pytree import tree_map
from shardfn.partition.layouts.axes import (
    batch_spec,
    mesh_axes,
    param_specs,
    reshard_after_forward,
    resolve_rules,
    seq_split,
    state_specs,
)
from shardfn.partition.passes.points import PassPipeline
from shardfn.partition.spec import P, entry_axes
from shardfn.partition.spmd.context_rules import balanced_batch
from shardfn.runtime.step import Step, identity_state


def mesh_from_config(cfg, *, fake: bool = False) -> sf.Mesh:
    """The ``sf.Mesh`` of the config's non-pipeline axes (``pp`` is the pipeline's own), on the
    kind of device ``runtime.device`` names (cuda: NCCL, each rank on its ``cuda:LOCAL_RANK``)."""
    return sf.Mesh(mesh_axes(cfg.mesh.axes(), include_pp=False), fake=fake,
                   device=None if fake else device_kind(cfg))


def device_kind(cfg) -> str:
    """``"cuda"`` or ``"cpu"``: the kind of device of ``runtime.device`` (a mesh's backend)."""
    return torch.device(cfg.runtime.device).type


def constrained(inner: optim.GradientTransformation, specs: Any,
                reduce_dtype: torch.dtype | None = None) -> optim.GradientTransformation:
    """``inner`` with its incoming updates (the gradients) constrained to ``specs`` first.

    Under ``sf.jit`` this is where partial gradient sums are reduced: a reduce-scatter onto a
    sharded parameter, an all-reduce onto a replicated one, in ``reduce_dtype`` when it is given
    and differs from a gradient's own (``train.reduce_dtype``). Identity on one device.

        opt = constrained(adamw(1e-3), param_specs)
    """

    def update(updates, state, params=None):
        if reduce_dtype is None:
            return inner.update(sf.constrain(updates, specs), state, params)
        sent = tree_map(lambda g: g.to(reduce_dtype), updates)
        reduced = tree_map(lambda r, g: r.to(g.dtype), sf.constrain(sent, specs), updates)
        return inner.update(reduced, state, params)

    return optim.GradientTransformation(inner.init, update)


def layout(cfg, model, params, opt_state, mesh) -> dict[str, Any]:
    """The specs of a run: ``params``, ``opt_state``, ``batch``, and the resolved ``rules``."""
    model = models.get(model)
    rules = resolve_rules(cfg.rules, mesh.axes)
    pspecs = param_specs(model.param_axes(cfg.model), rules, mesh.axes)
    return {
        "rules": rules,
        "params": pspecs,
        "opt_state": state_specs(opt_state, params, pspecs),
        "batch": batch_spec(rules, mesh.axes),
    }


def mesh_step(cfg, model, optimizer, params, mesh, *, backend: str | None = "default", donate: bool = False) -> Step:
    """The :class:`~shardfn.runtime.step.Step` of ``cfg`` on ``mesh``: ``train_step`` as an
    ``sf.jit`` program (the global batch in; params and optimizer state stay DTensors of
    ``specs``; metrics come back as plain replicated tensors).

    ``params`` gives the optimizer state's structure (real or fake tensors). ``backend``:
    ``"default"`` compiles with inductor when ``train.compile``; None runs the per-rank program
    as it is. ``donate``: each call's ``params`` and ``opt_state`` are the step's to write the new
    ones over (``sf.jit``'s ``donate_argnums``; not under ``train.nonfinite=skip``, which returns
    the old state on a skipped step).

    Example:
        step = mesh_step(cfg, llama, make_optimizer(cfg.train, llama), params, mesh_from_config(cfg))
        params, opt_state = step.place(params)
    """
    model = models.get(model)
    from shardfn.runtime.train_step import make_train_step, precision_policy

    specs = layout(cfg, model, params, optimizer.init(params), mesh)
    skip = cfg.train.nonfinite == "skip"  # the torch.where over params and state is traced and partitioned too
    policy = precision_policy(cfg.train)
    reduce_dtype = policy.reduce_dtype if policy.reduce_dtype != policy.param_dtype else None
    experts = expert_region(model, cfg.model, mesh, specs, chunks=cfg.partition.ep_chunks,
                            capacity_factor=cfg.partition.capacity_factor)
    train_step = make_train_step(model, cfg.model, constrained(optimizer, specs["params"], reduce_dtype),
                                 skip_nonfinite=skip, experts=experts, precision=policy)
    if backend == "default":
        backend = "inductor" if cfg.train.compile else None
    fsdp = (0,) if mesh.axes.get("fsdp", 1) > 1 else ()
    in_specs = (specs["params"], specs["opt_state"], specs["batch"])
    if cfg.partition.auto:  # the solver chooses params and optimizer state; the batch stays split
        part = cfg.partition
        solver = sf.AUTO(time_limit_s=part.auto_time_limit_s, mip_gap=part.auto_mip_gap,
                         hardware=part.auto_hardware, strict=part.auto_strict)
        in_specs = (solver, solver, specs["batch"])
    jitted = sf.jit(
        train_step, mesh,
        in_specs=in_specs, memory_budget=cfg.partition.memory_budget,
        out_specs=(specs["params"], specs["opt_state"], P()),
        fsdp_argnums=fsdp, backend=backend, arg_names=("params", "opt_state", "batch"),
        reshard_after_forward=reshard_after_forward(cfg), bucket_bytes=cfg.partition.bucket_bytes,
        passes=_passes(cfg, mesh),
        sequence_parallel=("tp",) if cfg.partition.sequence_parallel and "tp" in mesh.axes else (),
        donate_argnums=(0, 1) if donate and not skip else (),
    )
    last: dict = {}
    split = seq_split(specs["rules"], mesh.axes)

    def run(params, opt_state, batch):
        batch = balanced_batch(batch, split)  # context parallelism: load-balanced tokens and their positions
        last["lowered"] = lowered = jitted.lower(params, opt_state, batch)  # cached after the first call
        params, opt_state, metrics = lowered(params, opt_state, batch, backend=backend)
        return params, opt_state, {k: v.to_local() if isinstance(v, DTensor) else v for k, v in metrics.items()}

    def report(kind):
        def read():
            if "lowered" not in last:
                raise RuntimeError("a mesh step reports on the program it ran: call it once first")
            return getattr(last["lowered"], kind)()
        return read

    def place(params_or_source):
        from shardfn.runtime.param_source import sharded_tree

        placed = sharded_tree(params_or_source, params, specs["params"], mesh)  # each rank builds its shards
        return placed, distribute(optimizer.init(placed), specs["opt_state"], mesh)

    return Step("mesh", run, optimizer, place, identity_state, identity_state, full, specs=specs, mesh=mesh,
                jitted=jitted, comm_report=report("comm_report"), memory_report=report("memory_report"))


def overlaps(cfg, mesh=None) -> bool:
    """Whether the run's per-rank program is scheduled by the overlap pass: ``partition.overlap``,
    or where it is null, whether parameters are stored sharded (``mesh.fsdp > 1``): the FSDP
    gathers it prefetches are where it was measured to pay (docs/passes.md). A null also leaves
    the pass off, with a warning, on a ``mesh`` whose gloo groups run on more than one worker
    thread, which the pass is not safe on (a ``Mesh`` makes its own groups with one: partition/mesh.py).

        overlaps(load_config("llama_tiny", ["mesh.fsdp=2"]))   # True
    """
    if cfg.partition.overlap is not None:
        return bool(cfg.partition.overlap)
    if cfg.mesh.fsdp <= 1:
        return False
    threads = mesh.gloo_worker_threads() if mesh is not None else None
    if threads is not None and threads > 1:
        warnings.warn(
            f"partition.overlap is off for this run: the mesh's gloo process group runs on {threads} worker "
            "threads (it was created before the mesh), and several collectives in flight at once corrupted "
            "memory on such a group (docs/passes.md). To have the pass, let the Mesh create the process group, "
            "or call shardfn.partition.mesh.one_gloo_worker_thread() before init_process_group",
            stacklevel=2)
        return False
    return True


def _passes(cfg, mesh=None) -> PassPipeline:
    """The graph passes a run config asks for on ``mesh``: ``train.remat`` after trace,
    ``partition.overlap`` after lower (``partition/passes/points.py``, ``docs/passes.md``)."""
    return PassPipeline(remat=cfg.train.remat, overlap=overlaps(cfg, mesh), overlap_bytes=cfg.partition.overlap_bytes)


def distribute(tree: Any, specs: Any, mesh) -> Any:
    """``tree``'s leaves as DTensors laid out by ``specs`` (a pytree prefix of ``P``) on ``mesh``.

    Every rank holds the full tree; each keeps its own shard, with no communication. DTensor
    leaves are kept as they are (an optimizer state made from placed parameters).

    Example:
        params = distribute(params, specs["params"], mesh)
    """
    from torch.distributed.tensor import distribute_tensor

    from shardfn.partition.spec import broadcast_specs

    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=False)
    specs = broadcast_specs(specs, tree, what="specs")
    dmesh = mesh.device_mesh
    out = [x if isinstance(x, DTensor) else distribute_tensor(x.detach(), dmesh, mesh.placements(s, x.ndim),
                                                               src_data_rank=None)
           for x, s in zip(leaves, specs)]
    return optree.tree_unflatten(treedef, out)


def expert_region(model, model_cfg, mesh, specs, *, chunks: int = 1, capacity_factor: float = 0.0):
    """How an MoE model's routed experts run on ``mesh`` (``model.loss_and_aux``'s ``experts``):
    a per-rank region with an all-to-all exchange over ``ep`` when ``mesh.ep > 1``, else each
    rank's own tokens through whole experts. None for a model without experts
    (``model.layout_units`` has no ``expert``) or a batch that is not split. ``chunks``
    (``partition.ep_chunks``): the exchange in that many token groups, overlapped with the
    experts' compute; ``capacity_factor`` (``partition.capacity_factor``): at most this times the
    even share of tokens per expert (0: dropless). A model's shared experts, when its MoE layer
    has any, run while the exchange is in flight (``core.moe.moe_layer``).

    Example:
        loss = model.loss(params, batch, cfg.model, experts=expert_region(model, cfg.model, mesh, specs))
    """
    model = models.get(model)
    units = model.layout_units(model_cfg)
    batch = specs["batch"]
    # the batch dim's axes: the region takes each data rank's tokens whole (gathered over cp,
    # which splits the sequence: every cp rank of a data rank routes the same tokens)
    data_axes = tuple(entry_axes(batch[0])) if len(batch) else ()
    if "expert" not in units or not data_axes:
        return None
    from shardfn.runtime import moe_dispatch

    n_experts = units["expert"][1]
    if mesh.axes.get("ep", 1) > 1:
        return moe_dispatch.ExpertRegion(mesh, data_axes, "ep", n_experts, capacity_factor, shared=True,
                                         chunks=chunks)
    return moe_dispatch.data_parallel_region(data_axes)


def full(tree: Any) -> Any:
    """Every DTensor leaf of ``tree`` gathered to a plain tensor (for checks and exports)."""
    return tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, tree)
