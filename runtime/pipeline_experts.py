"""MoE layers inside pipeline stages: routed experts split over ``ep``, and router-bias balancing.

With ``mesh.ep > 1`` every rank of a stage holds ``n_experts / ep`` experts of each MoE layer (a
slice of the stacked ``[L, E, ...]`` leaves along their ``expert`` dim), and the stage programs
are traced with those slices and with the routed experts replaced by the eager all-to-all
exchange of :mod:`shardfn.runtime.moe_dispatch` over the ``ep`` group: one opaque op in F (the
dispatch, the local experts, the combine) and its backward op in I (the expert weight gradients
come out of the same op; W only stacks them). Tokens stay split over ``dp x ep``.

Every MoE layer of a pipelined loss also counts its tokens per expert at run time (an identity
op on the routing weights), so the step can run the model's ``aux_update`` (router-bias
balancing) on each stage exactly as the one-device step does from ``aux["expert_counts"]``,
which a pipelined loss cannot return.

    layout = expert_layout(moe, cfg.model)                # which leaves are split over ep
    loss_fn = stage_loss(moe, cfg.model, recorder, ep_group)   # what build_pipeline traces
    held = shard_experts(params, layout.dims, ep_rank, ep)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from shardfn.core.pytree import PyTree, map_with_path
from shardfn.core.registry import Registry


@dataclass(frozen=True)
class ExpertLayout:
    """Where a model's routed experts live.

    Attributes:
        dims: ``path -> dim`` of each leaf's ``expert`` dim (split over ``ep``).
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
    from shardfn.core.pytree import flatten_with_paths

    units = model.layout_units(model_cfg)
    if "expert" not in units:
        return None
    axes = dict(flatten_with_paths(model.param_axes(model_cfg), is_leaf=lambda a: isinstance(a, tuple)))
    dims = {path: a.index("expert") for path, a in axes.items() if "expert" in a}
    stacks = dict(model.stacks(model_cfg))
    expert_stacks = {path.partition(".")[0] for path in dims} & set(stacks)
    return ExpertLayout(dims, units["expert"][1], sum(stacks[k] for k in expert_stacks))


def counted_layers(stage) -> list[int]:
    """The MoE layers (in counting order) whose tokens per expert ``stage``'s forward counts:
    the rows of the router bias slice it holds.

        counted_layers(pipe.stages[1])  # [1]
    """
    return [n.args[2] for n in stage.forward.graph.nodes
            if n.op == "call_function" and n.target in (count_experts, torch.ops.shardfn.count_experts.default)]


# ----------------------------------------------------------------------------- expert shards


def shard_experts(tree: PyTree, dims: dict[str, int], rank: int, n: int) -> PyTree:
    """``tree`` with each leaf in ``dims`` narrowed to the ``rank``-th of ``n`` equal slices of its
    expert dim (views; paths may carry a prefix such as ``stage1.``).

        shard_experts(params, {"moe_layers.experts.w1": 1}, 1, 2)  # experts 4..7 of 8
    """
    if n == 1:
        return tree

    def cut(path, x):
        dim = expert_dim(path, dims)
        if dim is None:
            return x
        size = x.shape[dim] // n
        return x.narrow(dim, rank * size, size)

    return map_with_path(cut, tree)


def gather_experts(tree: PyTree, dims: dict[str, int], n: int, group) -> PyTree:
    """Inverse of :func:`shard_experts`: each leaf in ``dims`` all-gathered over ``group``.

        full = gather_experts(local, layout.dims, ep, ep_group)
    """
    if n == 1:
        return tree

    def join(path, x):
        dim = expert_dim(path, dims)
        if dim is None:
            return x
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    return map_with_path(join, tree)


def expert_dim(path: str, dims: dict[str, int]) -> int | None:
    """The expert dim of the leaf at ``path`` (a model path, or one under a ``stage<s>.`` key).

        expert_dim("stage1.moe_layers.experts.w2", {"moe_layers.experts.w2": 1})  # 1
    """
    if path in dims:
        return dims[path]
    head, _, rest = path.partition(".")
    return dims.get(rest) if head.startswith("stage") else None


# ----------------------------------------------------------------------------- expert counts


class Recorder:
    """What the MoE layers of one pipeline rank record while its stages run: tokens per expert of
    each layer (``counts``: ``layer -> [E]`` int64, summed over microbatches) and, with expert
    parallelism, the token exchanges (``exchange``). The step owns it and starts it afresh each call.

        rec = Recorder(); rec.reset(); ...; rec.counts   # {0: tensor([...]), 1: ...}
    """

    def __init__(self):
        from shardfn.runtime.moe_dispatch import Exchange, register_exchange

        self.counts: dict[int, torch.Tensor] = {}
        self.exchange = Exchange()
        self.id = _recorders.add(self)
        self.exchange_id = register_exchange(self.exchange)

    def reset(self) -> None:
        self.counts = {}
        self.exchange.reset()

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


class _CountExperts(torch.autograd.Function):
    """The counting op as an identity on the routing weights (its cotangent passes through)."""

    @staticmethod
    def forward(indices, weights, layer, n_experts, recorder):
        return torch.ops.shardfn.count_experts(indices, weights, layer, n_experts, recorder)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return None, grad, None, None, None


def count_experts(indices: torch.Tensor, weights: torch.Tensor, layer: int, n_experts: int,
                  recorder: int) -> torch.Tensor:
    """``weights``, after adding this call's tokens per expert (``[E]``) to MoE layer ``layer``'s
    count in the :class:`Recorder` whose id is ``recorder``. Differentiable as the identity in
    ``weights``.

        weights = count_experts(r.indices, r.weights, 0, 8, recorder.id)
    """
    return _CountExperts.apply(indices, weights, layer, n_experts, recorder)


def _register() -> None:
    from shardfn.partition.fiw import register_differentiable
    from shardfn.runtime import moe_dispatch

    register_differentiable(torch.ops.shardfn.count_experts.default, count_experts)
    register_differentiable(torch.ops.shardfn.ep_experts.default, moe_dispatch.ep_experts)


_register()


# ----------------------------------------------------------------------------- the traced loss


def routed_fn(n_experts: int, recorder: Recorder, ep_group=None, capacity_factor: float = 0.0) -> Callable:
    """``routed(x, indices, weights, w1, w2, w3) -> y`` for the MoE layers of one traced loss: the
    ``i``-th call counts its tokens as layer ``i`` into ``recorder``, then runs the experts on this
    device (whole ``[E, ...]`` weights) or, with ``ep_group``, through the all-to-all exchange over
    it (``[E / ep, ...]`` weights: this rank's experts), recorded in ``recorder.exchange``.

        loss = moe.loss(params_local, microbatch, cfg, experts=routed_fn(8, recorder, ep_group))
    """
    from shardfn.core import moe
    from shardfn.runtime import moe_dispatch

    layers = itertools.count()
    group_name = ep_group.group_name if ep_group is not None else None

    def routed(x, indices, weights, w1, w2, w3):
        weights = count_experts(indices, weights, next(layers), n_experts, recorder.id)
        if group_name is None:
            return moe.routed_experts(x, indices, weights, w1, w2, w3)
        return moe_dispatch.ep_experts(x, indices, weights, w1, w2, w3, None, None, None, group_name, n_experts,
                                       capacity_factor, recorder.exchange_id)[0]

    return routed


def stage_loss(model, model_cfg, recorder: Recorder, ep_group=None) -> Callable:
    """``loss_fn(params, batch)`` for :func:`~shardfn.partition.stages.build_pipeline`: the
    model's loss with its MoE layers counted into ``recorder`` and, with ``ep_group``,
    expert-parallel.

        pipe = build_pipeline(stage_loss(moe, cfg.model, Recorder(), ep_group), held, microbatch, 2)
    """
    layout = expert_layout(model, model_cfg)
    if layout is None:
        return lambda params, batch: model.loss(params, batch, model_cfg)
    n_experts, capacity = layout.n_experts, model_cfg.capacity_factor

    def loss_fn(params, batch):
        return model.loss(params, batch, model_cfg, experts=routed_fn(n_experts, recorder, ep_group, capacity))

    return loss_fn
