"""The training step of a run config, partitioned over the config's mesh.

The layout comes from the config alone: ``mesh`` sizes and logical-axis ``rules`` give a spec
for every parameter, the optimizer state follows the parameters, the global batch is split over
the data axes, and gradients are constrained to the parameters' specs (so under ``fsdp`` they
are reduce-scattered, under ``dp`` all-reduced). Model code is untouched.

    mesh = mesh_from_config(cfg)
    step = partitioned_step(cfg, model, optimizer, params, opt_state, mesh)
    params, opt_state, metrics = step(params, opt_state, batch)    # params stay DTensors
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

import shardfn as sf
from shardfn.core import optim
from shardfn.partition.layouts import batch_spec, param_specs, resolve_rules, state_specs
from shardfn.partition.spec import P

MESH_ORDER = ("pp", "dp", "fsdp", "ep", "tp")
"""Mesh axes, major to minor: tp innermost (fastest links), pp outermost."""


def mesh_axes(cfg, *, include_pp: bool = False) -> dict[str, int]:
    """The config's mesh as ordered axes (``pp`` left out unless asked: stages own it)."""
    return {a: getattr(cfg.mesh, a) for a in MESH_ORDER if include_pp or a != "pp"}


def mesh_from_config(cfg, *, fake: bool = False) -> sf.Mesh:
    return sf.Mesh(mesh_axes(cfg), fake=fake)


def constrained(inner: optim.GradientTransformation, specs: Any) -> optim.GradientTransformation:
    """``inner`` with its incoming updates (the gradients) constrained to ``specs`` first.

    Under ``sf.jit`` this is where partial gradient sums are reduced: a reduce-scatter onto a
    sharded parameter, an all-reduce onto a replicated one. Identity on one device.

        opt = constrained(adamw(1e-3), param_specs)
    """

    def update(updates, state, params=None):
        return inner.update(sf.constrain(updates, specs), state, params)

    return optim.GradientTransformation(inner.init, update)


def layout(cfg, model, params, opt_state, mesh) -> dict[str, Any]:
    """The specs of a run: ``params``, ``opt_state``, ``batch``, and the resolved ``rules``."""
    rules = resolve_rules(cfg.rules, mesh)
    pspecs = param_specs(model.param_axes(cfg.model), rules, mesh)
    return {
        "rules": rules,
        "params": pspecs,
        "opt_state": state_specs(opt_state, params, pspecs),
        "batch": batch_spec(rules, mesh),
    }


def partitioned_step(cfg, model, optimizer, params, opt_state, mesh, *, backend: str | None = "default"):
    """``train_step`` of ``cfg`` as an ``sf.jit`` program over ``mesh`` (same contract as the
    one-device step; metrics come back as plain replicated tensors)."""
    from shardfn.runtime.train import make_train_step

    specs = layout(cfg, model, params, opt_state, mesh)
    skip = cfg.train.nonfinite == "skip"  # the torch.where over params and state is traced and partitioned too
    step = make_train_step(model, cfg.model, constrained(optimizer, specs["params"]), skip_nonfinite=skip)
    step = with_expert_regions(step, cfg, mesh, specs)
    if backend == "default":
        backend = "inductor" if cfg.train.compile else None
    fsdp = (0,) if mesh.axes.get("fsdp", 1) > 1 else ()
    in_specs = (specs["params"], specs["opt_state"], specs["batch"])
    if cfg.partition.auto:  # the solver chooses params and optimizer state; the batch stays split
        in_specs = (sf.AUTO, sf.AUTO, specs["batch"])
    jitted = sf.jit(
        step, mesh,
        in_specs=in_specs, memory_budget=cfg.partition.memory_budget,
        out_specs=(specs["params"], specs["opt_state"], P()),
        fsdp_argnums=fsdp, backend=backend, arg_names=("params", "opt_state", "batch"),
    )

    def run(params, opt_state, batch):
        params, opt_state, metrics = jitted(params, opt_state, batch)
        return params, opt_state, {k: v.to_local() if isinstance(v, DTensor) else v for k, v in metrics.items()}

    run.jitted = jitted
    run.specs = specs
    return run


def with_expert_regions(step, cfg, mesh, specs):
    """``step`` with its MoE layers' routed experts in per-rank regions: an all-to-all exchange
    over ``ep`` when ``mesh.ep > 1``, else each rank's own tokens through whole experts. Dense
    models are returned unchanged."""
    n_experts = getattr(cfg.model, "n_experts", 0)
    batch = specs["batch"]
    data_axes = tuple(batch.axes()) if len(batch) else ()
    if not n_experts or not data_axes:
        return step
    from shardfn.core import moe
    from shardfn.runtime import moe_dispatch

    if mesh.axes.get("ep", 1) > 1:
        routed = moe_dispatch.expert_parallel_region(
            mesh, data_axes, "ep", n_experts, getattr(cfg.model, "capacity_factor", 0.0) or 0.0)
    else:
        routed = moe_dispatch.data_parallel_region(data_axes, moe.routed_experts)

    def step_with_regions(*args):
        with moe.routed_experts_impl(routed):
            return step(*args)

    return step_with_regions


def full(tree: Any) -> Any:
    """Every DTensor leaf of ``tree`` gathered to a plain tensor (for checks and checkpoints)."""
    from shardfn.core.pytree import tree_map

    return tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, tree)
