"""What each rank of a layout holds: every parameter's spec and local shape, a pipeline rank's
layers, and exact parameter, gradient and optimizer-state bytes per rank.

    leaves = mesh_leaves(model, cfg.model, layout.axes(), cfg.rules, torch.bfloat16)
    memory_bytes(cfg, layout)[0]      # {"params": ..., "grads": ..., "opt_state": ...} of pp rank 0
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import optree
import torch

from shardfn import models
from shardfn.core.pytree import flatten_with_paths
from shardfn.partition.layouts.axes import param_specs, resolve_rules
from shardfn.partition.pipeline.split import split_costs
from shardfn.partition.spec import P, shard_shape
from shardfn.plan.layout import Layout, rank_stages
from shardfn.runtime.train_step import make_optimizer


@dataclass(frozen=True)
class Leaf:
    """One parameter on one rank of a mesh: its shape, spec and local shape."""

    path: str                # "moe_layers.experts.w1"
    shape: tuple[int, ...]   # global
    spec: P
    local: tuple[int, ...]   # per rank (the stacked dim whole)
    itemsize: int
    stack: str | None        # "moe_layers" for a stacked leaf (``model.stacks``)
    axes: tuple = ()         # logical axes (``model.param_axes``)
    active: float = 1.0      # the share one token uses (``model.active_fraction``: top_k of the experts)

    def local_bytes(self, n_layers: int | None = None) -> int:
        """Bytes on one rank; for a stacked leaf, of ``n_layers`` of its layers."""
        dims = list(self.local)
        if self.stack is not None:
            dims[0] = n_layers if n_layers is not None else dims[0]
        return math.prod(dims) * self.itemsize


def meta_params(model, model_cfg, dtype: torch.dtype):
    """The model's parameter tree on the meta device: shapes and dtypes, nothing allocated."""
    model = models.get(model)
    return model.init(model_cfg, 0, device="meta", dtype=dtype)


def mesh_leaves(model, model_cfg, axes: Mapping[str, int], rules: dict | None, dtype: torch.dtype) -> list[Leaf]:
    """Every parameter with its spec and local shape on a mesh of ``axes`` (nothing allocated).

    Example:
        [leaf.local for leaf in meshmesh_leaves(llama, cfg, {"tp": 2}, None, torch.float32)][:2]
    """
    model = models.get(model)
    sizes = {a: s for a, s in axes.items() if a != "pp"}
    specs = param_specs(model.param_axes(model_cfg), resolve_rules(rules, sizes), sizes)
    params = meta_params(model, model_cfg, dtype)
    stacks = dict(model.stacks(model_cfg))
    fraction = model.active_fraction(model_cfg)
    axes_tree = model.param_axes(model_cfg)
    axes_leaves = optree.tree_leaves(axes_tree, is_leaf=lambda a: isinstance(a, tuple), none_is_leaf=False)
    spec_leaves = optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P), none_is_leaf=False)
    out = []
    for (path, x), spec, logical in zip(flatten_with_paths(params), spec_leaves, axes_leaves):
        stack = path.split(".")[0] if path.split(".")[0] in stacks else None
        active = math.prod(fraction.get(a, 1.0) for a in logical)
        out.append(Leaf(path, tuple(x.shape), spec, tuple(shard_shape(x.shape, spec, sizes)), x.element_size(),
                        stack, tuple(logical), active))
    return out


def stage_ranges(cfg, layout: Layout, dtype: torch.dtype = torch.float32) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges of the layout's pipeline stages: the split a run
    makes (``partition.pipeline.split``: whole layers, the costliest stage as cheap as possible), from the
    per-layer costs of a traced reduced model (:func:`layer_costs`).

    Example:
        stage_ranges(load_config("deepseek_v3_671b"), Layout(pp=16, microbatches=32))[:2]
    """
    n_layers = models.get(cfg.model_name).layer_count(cfg.model)
    if layout.n_stages == 1:
        return [(0, n_layers)]
    rows = cfg.train.batch_size // layout.data_size // layout.microbatches
    costs = layer_costs(cfg.model_name, cfg.model, rows, cfg.train.seq_len, dtype)
    if costs is None:  # the loss has no cut between layers: the planner splits by layer count
        base, extra = divmod(n_layers, layout.n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(layout.n_stages)]
        edges = [sum(sizes[:s]) for s in range(layout.n_stages + 1)]
    else:
        edges = [0, *split_costs(costs, layout.n_stages), n_layers]
    return list(zip(edges[:-1], edges[1:]))


@functools.lru_cache(maxsize=64)
def layer_costs(model_name: str, model_cfg, rows: int, seq_len: int, dtype: torch.dtype) -> tuple[float, ...] | None:
    """The cost of each layer of the model for balancing pipeline stages, as the runtime measures it
    on its traced loss (``partition.pipeline.split.layer_units``; the embedding counts with the first layer,
    the head with the last), for a microbatch of ``rows`` x ``seq_len`` tokens.

    A reduced model with three layers of each stack is traced (nothing is allocated): its middle
    layers cost what every layer of their stack costs, and its first and last units add the
    embedding and the head. None when the traced loss has no valid cut between its layers (every
    layer's auxiliary balance loss reaches the final loss, as DeepSeek-V3's do): the runtime cannot
    split it into stages yet.

    Example:
        layer_costs("llama", llama.Config(), 4, 128, torch.float32)   # one cost per layer
    """
    from shardfn import models
    from shardfn.core._torch_private import fake_mode
    from shardfn.partition.pipeline.split import layer_units, trace_loss

    model = models.get(model_name)
    stacks = model.stacks(model_cfg)
    reduced = model.with_layers(model_cfg, {k: 3 for k, _ in stacks})
    shapes = meta_params(model, reduced, dtype)
    with fake_mode():  # empty tensors of the parameters' shapes: drawing their values is slow and moot
        params = optree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype), shapes, none_is_leaf=False)
        tokens = torch.zeros(rows, seq_len, dtype=torch.long)
    units = layer_units(
        trace_loss(lambda p, b: model.loss(p, b, reduced), params, {"inputs": tokens, "targets": tokens})
    )
    if units.layers is None:
        return None
    cost = dict(zip(units.layers, units.costs))
    per_layer = {k: cost[(k, 1)] for k, _ in stacks}
    first, last = stacks[0][0], stacks[-1][0]
    out = [per_layer[k] for k, n in stacks for _ in range(n)]
    out[0] += cost[(first, 0)] - per_layer[first]    # the embedding
    out[-1] += cost[(last, 2)] - per_layer[last]     # the final norm, the head and the loss
    return tuple(out)


@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank holds: layers per stack, and the non-layer parameters."""

    counts: dict              # stack -> layers on this rank
    first: bool               # holds the embedding
    last: bool                # holds the final norm, output head and loss
    layer_ranges: tuple       # ((start, end), ...) of its stages


def rank_shares(model, cfg, layout: Layout, dtype: torch.dtype = torch.float32) -> list[RankShare]:
    """What each pipeline rank holds (layers per stack; embedding; head), from the stage split."""
    model = models.get(model)
    model_cfg = cfg.model
    stacks = model.stacks(model_cfg)
    ranges = stage_ranges(cfg, layout, dtype)
    n_stages = layout.n_stages
    bounds, start = {}, 0
    for key, n in stacks:
        bounds[key] = (start, start + n)
        start += n
    shares = []
    for stages in rank_stages(layout):
        counts = {key: 0 for key, _ in stacks}
        for s in stages:
            lo, hi = ranges[s]
            for key, (a, b) in bounds.items():
                counts[key] += max(0, min(hi, b) - max(lo, a))
        shares.append(RankShare(counts, 0 in stages, n_stages - 1 in stages, tuple(ranges[s] for s in stages)))
    return shares


def leaf_on_rank(leaf: Leaf, share: RankShare, tied: bool) -> int:
    """Layers of a stacked leaf on this rank; for a non-layer leaf, 1 if the rank holds it."""
    if leaf.stack is not None:
        return share.counts.get(leaf.stack, 0)
    if leaf.path.split(".")[0] == "embed":
        return int(share.first or (tied and share.last))
    return int(share.last)


def local_numel(leaf: Leaf, share: RankShare, tied: bool) -> int:
    """Elements of ``leaf`` on one rank of this pipeline rank's share."""
    n = leaf_on_rank(leaf, share, tied)
    per = math.prod(leaf.local[1:]) if leaf.stack is not None else math.prod(leaf.local)
    return per * n


def state_bytes(state: Any, params: Any, local_bytes: Callable[[str, int], int]) -> int:
    """Bytes of an optimizer state on one rank: every subtree shaped like ``params`` is sharded
    as the parameters (``local_bytes(path, itemsize)``), every other leaf is replicated.

    Example:
        state_bytes(opt.init(meta_params), meta_params, lambda path, size: numel[path] * size)
    """
    params_def = optree.tree_structure(params, none_is_leaf=False)
    like_params = lambda x: optree.tree_structure(x, none_is_leaf=False) == params_def  # noqa: E731
    paths = [p for p, _ in flatten_with_paths(params)]
    total = 0
    for sub in optree.tree_leaves(state, is_leaf=like_params, none_is_leaf=False):
        if like_params(sub):
            total += sum(local_bytes(p, x.element_size()) for p, x in zip(paths, optree.tree_leaves(sub)))
        else:
            total += sub.numel() * sub.element_size()
    return total


def _meta_state(cfg, dtype: torch.dtype):
    """The meta parameters and the optimizer state ``init`` makes of them: the same for every
    layout of a config, so kept for the last few configs (a search asks for each mesh)."""
    return _meta_state_for(cfg.model_name, _ByRepr(cfg.model), _ByRepr(cfg.train), dtype)


@functools.lru_cache(maxsize=4)
def _meta_state_for(model_name: str, model_key: _ByRepr, train_key: _ByRepr, dtype: torch.dtype):
    model = models.get(model_name)
    params = meta_params(model, model_key.value, dtype)
    return params, make_optimizer(train_key.value, model).init(params)


class _ByRepr:
    """A config as a cache key: equal to another when their reprs are (a ``TrainConfig`` is not
    hashable)."""

    __slots__ = ("value", "key")

    def __init__(self, value):
        self.value, self.key = value, repr(value)

    def __eq__(self, other) -> bool:
        return isinstance(other, _ByRepr) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def memory_bytes(cfg, layout: Layout, *, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Exact ``{"params", "grads", "opt_state"}`` bytes on each pipeline rank, for the full model.

    Nothing is allocated: shapes from ``model.init(..., device="meta")``, specs from the rules,
    and the optimizer state from ``make_optimizer(cfg.train, model).init`` on the meta parameters.

    Example:
        memory_bytes(cfg, Layout(ep=64, dp=16))[0]["params"]
    """
    from shardfn import models

    model = models.get(cfg.model_name)
    leaves = mesh_leaves(model, cfg.model, layout.axes(), cfg.rules, dtype)
    by_path = {leaf.path: leaf for leaf in leaves}
    tied = model.ties_embeddings(cfg.model)
    params, state = _meta_state(cfg, dtype)
    out = []
    for share in rank_shares(model, cfg, layout, dtype):
        p = sum(local_numel(leaf, share, tied) * leaf.itemsize for leaf in leaves)
        opt = state_bytes(state, params, lambda path, size, s=share: local_numel(by_path[path], s, tied) * size)
        row = {"params": p, "grads": p, "opt_state": opt, "gathered": 0}
        if layout.pp > 1 and layout.fsdp > 1:
            # a pipeline sums each stage's gradients over its microbatches unsharded over fsdp
            # and (partition.reshard_after_forward null/false) holds its gathered parameters
            whole = sum(local_numel(leaf, share, tied) * leaf.itemsize * (layout.fsdp if "fsdp" in leaf.spec.axes()
                                                                          else 1) for leaf in leaves)
            row["grads"] = whole
            if cfg.partition.reshard_after_forward is not True:
                row["gathered"] = whole - p
        out.append(row)
    return out


@dataclass(frozen=True)
class ModelFacts:
    """Per-layer parameter counts and attention sizes, for the FLOP estimate."""

    stacks: dict            # stack -> layers in the model
    layer_params: dict      # stack -> params of one layer
    layer_active: dict      # stack -> params one token uses in one layer
    embed: int
    head: int               # final norm and output head
    attn_per_token_layer: float   # causal attention FLOPs (fwd + bwd) per token per layer / seq
    dim: int
    top_k: int              # routed experts per token (the all-to-all's fan-out)


def model_facts(model, model_cfg, leaves: Sequence[Leaf]) -> ModelFacts:
    """What the FLOP estimate needs, from the leaves' shapes and the model's own facts
    (``model.stacks``, ``model.active_fraction``, ``model.attention_shape``,
    ``model.experts_per_token``)."""
    model = models.get(model)
    stacks = dict(model.stacks(model_cfg))
    params, active = {k: 0 for k in stacks}, {k: 0 for k in stacks}
    embed = head = 0
    for leaf in leaves:
        n = math.prod(leaf.shape)
        if leaf.stack is None:
            if "vocab" in leaf.axes and leaf.axes[0] == "vocab":
                embed += n
            else:
                head += n
            continue
        per_layer = n // leaf.shape[0]
        params[leaf.stack] += per_layer
        active[leaf.stack] += int(per_layer * leaf.active)
    heads, qk, v = model.attention_shape(model_cfg)
    # forward QK^T and AV: 2 * S * H * (qk + v) per token, halved for the causal mask; x3 with backward
    attn = 3.0 * heads * (qk + v)
    return ModelFacts(stacks, params, active, embed, head, attn, model.embed_dim(model_cfg),
                      model.experts_per_token(model_cfg))


def stage_shares(model, cfg, layout: Layout, dtype: torch.dtype = torch.float32) -> list[RankShare]:
    """One share per stage (not per rank), for per-stage activations and compute."""
    model = models.get(model)
    out, stacks = [], model.stacks(cfg.model)
    ranges = stage_ranges(cfg, layout, dtype)
    for s, (lo, hi) in enumerate(ranges):
        counts, start = {}, 0
        for key, n in stacks:
            counts[key] = max(0, min(hi, start + n) - max(lo, start))
            start += n
        out.append(RankShare(counts, s == 0, s == len(ranges) - 1, ((lo, hi),)))
    return out
