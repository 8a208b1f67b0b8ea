"""MoE layers inside pipeline stages: routed experts split over ``ep``, and router-bias balancing.

With ``mesh.ep > 1`` every rank of a stage holds ``n_experts / ep`` experts of each MoE layer (a
slice of the stacked ``[L, E, ...]`` leaves along their ``expert`` dim), and the stage programs
are traced with those slices and with the routed experts replaced by the eager all-to-all
exchange of :mod:`shardfn.runtime.moe_dispatch` over the ``ep`` group: one opaque op in F (the
dispatch, the local experts, the combine) and its backward op in I (the expert weight gradients
come out of the same op; W only stacks them). Tokens stay split over ``dp x ep``.

Every MoE layer of a pipelined loss also counts its tokens per expert at run time (an identity
op on the routing weights), so the step can move ``moe_layers.router_bias`` exactly as the
one-device step does from ``aux["expert_counts"]``, which a pipelined loss cannot return.

    layout = expert_layout(moe, cfg.model, params)        # which leaves are split, the bias
    loss_fn = stage_loss(moe, cfg.model, ep_group)         # what build_pipeline traces
    held = shard_experts(params, layout.dims, ep_rank, ep)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from shardfn.core.pytree import PyTree, map_with_path

BIAS_SUFFIX = "router_bias"
"""The routers' selection bias: moved by balancing, never by the optimizer."""


@dataclass(frozen=True)
class ExpertLayout:
    """Where a model's routed experts live and how its routers are balanced.

    Attributes:
        dims: ``path -> dim`` of each leaf's ``expert`` dim (split over ``ep``).
        n_experts: routed experts per MoE layer.
        n_layers: MoE layers (the rows of the router bias).
        bias_path: the ``[n_layers, n_experts]`` router bias leaf, or None.
        bias_update_rate: the balancing step (``model.bias_update_rate``).
    """

    dims: dict[str, int]
    n_experts: int
    n_layers: int
    bias_path: str | None
    bias_update_rate: float


def expert_layout(model, model_cfg, params: PyTree) -> ExpertLayout | None:
    """The :class:`ExpertLayout` of an MoE model (None for a dense one), from its logical axes.

        expert_layout(moe, cfg.model, params).dims  # {"moe_layers.experts.w1": 1, ...}
    """
    from shardfn.core.pytree import flatten_with_paths

    n_experts = getattr(model_cfg, "n_experts", 0)
    if not n_experts or not hasattr(model, "param_axes"):
        return None
    axes = dict(flatten_with_paths(model.param_axes(model_cfg), is_leaf=lambda a: isinstance(a, tuple)))
    dims = {path: a.index("expert") for path, a in axes.items() if "expert" in a}
    shapes = {path: tuple(t.shape) for path, t in flatten_with_paths(params)}
    bias = next((p for p in shapes if p.endswith(BIAS_SUFFIX) and len(shapes[p]) == 2), None)
    n_layers = shapes[bias][0] if bias is not None else 0
    return ExpertLayout(dims, n_experts, n_layers, bias, getattr(model_cfg, "bias_update_rate", 0.0))


def check_divides(n_experts: int, ep: int) -> None:
    """Raise unless ``ep`` divides ``n_experts``, naming both keys.

        check_divides(8, 3)  # ValueError: mesh.ep=3 does not divide model.n_experts=8 ...
    """
    if n_experts % ep:
        divisors = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
        raise ValueError(f"mesh.ep={ep} does not divide model.n_experts={n_experts}: every ep rank holds the same "
                         f"number of experts; set mesh.ep to one of {divisors}")


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

_counts: dict[int, torch.Tensor] = {}


@torch.library.custom_op("shardfn::count_experts", mutates_args=())
def _count_experts(indices: torch.Tensor, weights: torch.Tensor, layer: int, n_experts: int) -> torch.Tensor:
    from shardfn.core.moe import tokens_per_expert

    counts = tokens_per_expert(indices, n_experts)
    _counts[layer] = counts if layer not in _counts else _counts[layer] + counts
    return weights.clone()


@_count_experts.register_fake
def _(indices, weights, layer, n_experts):
    return torch.empty_like(weights)


class _CountExperts(torch.autograd.Function):
    """The counting op as an identity on the routing weights (its cotangent passes through)."""

    @staticmethod
    def forward(indices, weights, layer, n_experts):
        return torch.ops.shardfn.count_experts(indices, weights, layer, n_experts)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return None, grad, None, None


def count_experts(indices: torch.Tensor, weights: torch.Tensor, layer: int, n_experts: int) -> torch.Tensor:
    """``weights``, after adding this call's tokens per expert (``[E]``) to MoE layer ``layer``'s
    count (read with :func:`take_counts`). Differentiable as the identity in ``weights``.

        weights = count_experts(r.indices, r.weights, 0, 8)
    """
    return _CountExperts.apply(indices, weights, layer, n_experts)


def take_counts() -> dict[int, torch.Tensor]:
    """``layer -> [E]`` int64 tokens per expert counted on this rank since the last call (and forget them).

        counts = take_counts()   # {0: tensor([...]), 1: ...}: this rank's MoE layers
    """
    out = dict(_counts)
    _counts.clear()
    return out


def _register() -> None:
    from shardfn.partition.pipeline import register_differentiable
    from shardfn.runtime import moe_dispatch

    register_differentiable(torch.ops.shardfn.count_experts.default, count_experts)
    register_differentiable(torch.ops.shardfn.ep_experts.default, moe_dispatch.ep_experts)


_register()


# ----------------------------------------------------------------------------- the traced loss


def routed_fn(n_experts: int, ep_group=None, capacity_factor: float = 0.0) -> Callable:
    """``routed(x, indices, weights, w1, w2, w3) -> y`` for the MoE layers of one traced loss: the
    ``i``-th call counts its tokens as layer ``i``, then runs the experts on this device (whole
    ``[E, ...]`` weights) or, with ``ep_group``, through the all-to-all exchange over it
    (``[E / ep, ...]`` weights: this rank's experts).

        with core.moe.routed_experts_impl(routed_fn(8, ep_group)):
            loss = moe.loss(params_local, microbatch, cfg)
    """
    from shardfn.core import moe
    from shardfn.runtime import moe_dispatch

    layers = itertools.count()
    group_name = ep_group.group_name if ep_group is not None else None

    def routed(x, indices, weights, w1, w2, w3):
        weights = count_experts(indices, weights, next(layers), n_experts)
        if group_name is None:
            return moe.routed_experts(x, indices, weights, w1, w2, w3)
        return moe_dispatch.ep_experts(x, indices, weights, w1, w2, w3, None, None, None, group_name, n_experts,
                                       capacity_factor)[0]

    return routed


def stage_loss(model, model_cfg, ep_group=None) -> Callable:
    """``loss_fn(params, batch)`` for :func:`~shardfn.partition.pipeline.build_pipeline`: the
    model's loss with its MoE layers counted and, with ``ep_group``, expert-parallel.

        pipe = build_pipeline(stage_loss(moe, cfg.model, ep_group), held, microbatch, 2)
    """
    n_experts = getattr(model_cfg, "n_experts", 0)
    if not n_experts:
        return lambda params, batch: model.loss(params, batch, model_cfg)
    from shardfn.core import moe

    capacity = getattr(model_cfg, "capacity_factor", 0.0) or 0.0

    def loss_fn(params, batch):
        with moe.routed_experts_impl(routed_fn(n_experts, ep_group, capacity)):
            return model.loss(params, batch, model_cfg)

    return loss_fn


def load_metrics(counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per MoE layer, the most-loaded expert's tokens over the mean (the one-device step's metric).

        load_metrics(torch.tensor([[4, 0, 2, 2]]))  # {"expert_load_max_over_mean/0": tensor(2.)}
    """
    counts = counts.to(torch.float32)
    load = counts.amax(-1) / counts.mean(-1).clamp_min(1.0)
    return {f"expert_load_max_over_mean/{i}": load[i] for i in range(load.shape[0])}
