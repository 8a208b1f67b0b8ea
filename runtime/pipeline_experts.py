"""MoE layers inside pipeline stages: the routed experts on the stage's mesh, and router-bias balancing.

A pipelined loss runs its routed experts as the SPMD step does (``runtime.partitioned.expert_region``
on the stage's mesh): with ``mesh.ep > 1`` a per-rank region whose all-to-all exchange over ``ep``
runs in the runtime (``runtime.moe_dispatch``), one opaque op in F and its backward op in I (the
expert weight gradients come out of the same op); otherwise each rank's tokens through whole
experts. On a one-device stage mesh the experts run in the stage's programs directly.

Every MoE layer of a pipelined loss also counts its tokens per expert at run time (an identity
op on the routing weights, in a per-rank region on a stage mesh), so the step can run the
model's ``aux_update`` (router-bias balancing) on each stage exactly as the one-device step does
from ``aux["expert_counts"]``, which a pipelined loss cannot return.

    layout = expert_layout(moe, cfg.model)                       # n_experts, MoE layers, expert leaves
    loss_fn = stage_loss(moe, cfg.model, recorder, stage_mesh, batch_spec)   # what build_pipeline traces
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from shardfn import models
from shardfn.core.custom_ops import register_autograd
from shardfn.core.registry import Registry


@dataclass(frozen=True)
class ExpertLayout:
    """Where a model's routed experts live.

    Attributes:
        dims: ``path -> dim`` of each leaf's ``expert`` dim.
        n_experts: routed experts per MoE layer (``model.layout_units(cfg)["expert"]``).
        n_layers: MoE layers (the layers whose tokens per expert a step counts).
    """

    dims: dict[str, int]
    n_experts: int
    n_layers: int


def expert_layout(model, model_cfg) -> ExpertLayout | None:
    """The :class:`ExpertLayout` of an MoE model (None for a dense one), from its logical axes.

        expert_layout(moe, cfg.model).dims  # {"moe_layers.experts.w1": 1, ...}
    """
    model = models.get(model)
    from shardfn.core.pytree import flatten_with_paths

    units = model.layout_units(model_cfg)
    if "expert" not in units:
        return None
    axes = dict(flatten_with_paths(model.param_axes(model_cfg), is_leaf=lambda a: isinstance(a, tuple)))
    dims = {path: a.index("expert") for path, a in axes.items() if "expert" in a}
    stacks = dict(model.stacks(model_cfg))
    expert_stacks = {path.partition(".")[0] for path in dims} & set(stacks)
    return ExpertLayout(dims, units["expert"][1], sum(stacks[k] for k in expert_stacks))


def counted_layers(stage, layout: ExpertLayout) -> list[int]:
    """The MoE layers (in counting order) whose tokens per expert ``stage``'s forward counts: the
    layers of the expert leaves it holds.

        counted_layers(pipe.stages[1], layout)  # [1]
    """
    for path in stage.param_paths:
        if path in layout.dims:
            lo, hi = stage.layer_ranges.get(path, (0, layout.n_layers))
            return list(range(lo, hi))
    return []


# ----------------------------------------------------------------------------- expert counts


class Recorder:
    """The tokens per expert the MoE layers of one pipeline rank count while its stages run:
    ``counts``, ``layer -> [E]`` int64, summed over microbatches. The step owns it and starts it
    afresh each call.

        rec = Recorder(); rec.reset(); ...; rec.counts   # {0: tensor([...]), 1: ...}
    """

    def __init__(self):
        self.counts: dict[int, torch.Tensor] = {}
        self.id = _recorders.add(self)

    def reset(self) -> None:
        self.counts = {}

    def add(self, layer: int, counts: torch.Tensor) -> None:
        self.counts[layer] = counts if layer not in self.counts else self.counts[layer] + counts


_recorders = Registry("expert-count recorder")


@torch.library.custom_op("shardfn::count_experts", mutates_args=())
def _count_experts(indices: torch.Tensor, weights: torch.Tensor, layer: int, n_experts: int,
                   recorder: int) -> torch.Tensor:
    from shardfn.core.moe import tokens_per_expert

    _recorders[recorder].add(layer, tokens_per_expert(indices, n_experts))
    return weights.clone()


@_count_experts.register_fake
def _(indices, weights, layer, n_experts, recorder):
    return torch.empty_like(weights)


def _count_experts_backward(ctx, grad):
    return None, grad, None, None, None  # the identity on the routing weights


_count_experts_fn = register_autograd(_count_experts, _count_experts_backward)


def count_experts(indices: torch.Tensor, weights: torch.Tensor, layer: int, n_experts: int,
                  recorder: int) -> torch.Tensor:
    """``weights``, after adding this call's tokens per expert (``[E]``) to MoE layer ``layer``'s
    count in the :class:`Recorder` whose id is ``recorder``. Differentiable as the identity in
    ``weights``.

        weights = count_experts(r.indices, r.weights, 0, 8, recorder.id)
    """
    return _count_experts_fn(indices, weights, layer, n_experts, recorder)


def _register() -> None:
    from shardfn.partition.pipeline.fiw import register_differentiable

    register_differentiable(torch.ops.shardfn.count_experts.default, count_experts)


_register()


# ----------------------------------------------------------------------------- the traced loss


def counting_region(layer: int, n_experts: int, recorder: "Recorder", tokens):
    """``(indices, weights) -> weights`` as a per-rank region (tokens split by ``tokens``, a ``P``):
    each rank adds its own tokens per expert to ``recorder`` as MoE layer ``layer``."""
    from shardfn.partition.local_map import local_map

    def count(indices, weights):
        return torch.ops.shardfn.count_experts(indices, weights, layer, n_experts, recorder.id)

    return local_map(count, in_specs=(tokens, tokens), out_specs=tokens,
                     bwd=lambda inputs, outputs, cotangent: (None, cotangent))


def routed_fn(n_experts: int, recorder: Recorder, experts: Callable | None = None, tokens=None) -> Callable:
    """``routed(x, indices, weights, *expert_weights[, s1, s2, s3], ffn=...) -> y`` for the MoE layers of one
    traced loss (``core.moe.routed_experts``' signature): the
    ``i``-th call counts its tokens as layer ``i`` into ``recorder``, then runs ``experts`` (the
    stage mesh's region, ``runtime.partitioned.expert_region``; None: whole experts here). With
    ``tokens`` (the batch spec of a stage mesh) the count is a per-rank region too.

        loss = moe.loss(params, microbatch, cfg, experts=routed_fn(8, recorder))
    """
    from shardfn.core import moe

    layers = itertools.count()
    run = experts or moe.routed_experts

    def routed(x, indices, weights, *expert_weights, **ffn):
        layer = next(layers)
        if tokens is None:
            weights = count_experts(indices, weights, layer, n_experts, recorder.id)
        else:
            weights = counting_region(layer, n_experts, recorder, tokens)(indices, weights)
        return run(x, indices, weights, *expert_weights, **ffn)

    routed.takes_shared = getattr(experts, "takes_shared", False)  # shared experts behind the dispatch
    return routed


def stage_loss(model, model_cfg, recorder: Recorder, mesh=None, batch=None, *,
               capacity_factor: float = 0.0) -> Callable:
    """``loss_fn(params, batch)`` for :func:`~shardfn.partition.pipeline.split.build_pipeline`: the
    model's ``(loss, aux)`` with its MoE layers counted into ``recorder`` and run as the stage's ``mesh``
    runs them (an expert-parallel exchange with ``mesh.ep > 1``); ``batch`` is the batch spec
    on that mesh. Without a mesh (or on one device) everything runs in the stage's programs.
    ``capacity_factor``: ``partition.capacity_factor`` (:func:`~shardfn.runtime.partitioned.expert_region`).

        pipe = build_pipeline(stage_loss(moe, cfg.model, Recorder(), mesh, P("ep")), params, microbatch, 2)
    """
    model = models.get(model)
    layout = expert_layout(model, model_cfg)
    if layout is None:
        return lambda params, batch: model.loss_and_aux(params, batch, model_cfg)
    experts, tokens = None, None
    if mesh is not None and mesh.size > 1:
        from shardfn.runtime.partitioned import expert_region

        experts = expert_region(model, model_cfg, mesh, {"batch": batch}, capacity_factor=capacity_factor)
        tokens = batch

    def loss_fn(params, microbatch):
        return model.loss_and_aux(params, microbatch, model_cfg,
                                  experts=routed_fn(layout.n_experts, recorder, experts, tokens))

    return loss_fn
