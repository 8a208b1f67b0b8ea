"""Activation checkpointing (remat) as a pass on a traced joint graph.

A joint graph (forward, backward and optimizer, as ``partition.spmd.trace`` makes it) keeps every
forward value the backward reads alive from the forward to its use in the backward. This pass
decides, by a *policy*, which of those values are saved; every other one is recomputed in the
backward from saved values, by copies of its forward ops inserted just before the first backward
node that reads it, so a layer's values are remade when that layer's backward starts and die
with it. The recomputed ops are the forward's own ops on the same inputs, so results do not
change by a bit (``tests/test_remat.py``).

Policies (``train.remat``; in the spirit of ``jax.checkpoint``'s):

- ``"none"``: save everything (the pass does nothing);
- ``"full"``: save only what crosses from one layer into the next (the residual stream) and what
  belongs to no layer (embeddings, rope tables): each layer's inside is recomputed;
- ``"selective"``: ``full`` plus the outputs of matmuls and attention (``mm``, ``bmm``, ``addmm``,
  ``baddbmm``, ``scaled_dot_product_*``), TorchTitan's "selective op" checkpointing: the cheap
  element-wise and normalisation values are recomputed, the expensive ones kept;
- a predicate ``node -> bool``: save what it names (plus the layer boundaries of ``full``).

Layers are found from stacked parameters: a node reading ``select(w, 0, i)`` of a stacked leaf
belongs to layer ``i`` of that stack, and so does every node computed from it until the next
layer's slices come in. Only aten ops (and the grouped GEMM, :data:`PURE_CUSTOM_OPS`) are
recomputed: collectives, per-rank regions (the MoE exchange) and other custom ops, random and
in-place ops are always saved.

    gm = remat(traced.graph_module, "selective")      # a pass: graph in, graph out
    step = sf.jit(train_step, mesh, ..., passes={"after_trace": [remat_pass("full")]})
"""

from __future__ import annotations

import operator
from typing import Callable, Union

import torch
import torch.fx as fx

from shardfn.partition.spmd.fx import ancestors

Policy = Union[str, Callable[[fx.Node], bool]]
POLICIES = ("none", "full", "selective")

PURE_CUSTOM_OPS = {"shardfn::grouped_mm"}
"""Custom ops with no side effect and no communication, recomputed like aten ops (the routed
experts' grouped GEMM); every other custom op (collectives, per-rank regions, counters) is saved."""

_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math"}


def check_policy(policy: Policy, *, key: str = "remat") -> Policy:
    """``policy`` if it is a policy name or a predicate, else a ValueError naming ``key``."""
    if callable(policy) or policy in POLICIES:
        return policy
    raise ValueError(f"{key}: {policy!r} is not a remat policy; use one of {', '.join(POLICIES)} "
                     f"(or a predicate node -> bool naming what to save)")


def saves_matmuls(node: fx.Node) -> bool:
    """The ``selective`` policy's predicate: matmul and attention outputs (and their getitems)."""
    if node.target is operator.getitem:
        node = node.args[0]
    overload = getattr(node.target, "_overloadpacket", None)
    if isinstance(node.target, torch._ops.OpOverload) and node.target.name() in PURE_CUSTOM_OPS:
        return True
    return overload is not None and getattr(overload, "__name__", "") in _MATMULS


def remat(gm: fx.GraphModule, policy: Policy = "full", *, forward_of: list[fx.Node] | None = None) -> fx.GraphModule:
    """``gm`` with the forward values ``policy`` does not save recomputed in the backward.

    Args:
        gm: a joint graph: the loss's gradient seeded by ``ones_like(loss)`` (what
            ``torch.autograd.grad`` and ``torch.func.grad`` trace to), followed by its backward (and
            anything after).
        policy: ``"none"``, ``"full"``, ``"selective"`` or a predicate ``node -> bool``.
        forward_of: the forward's results (a pipeline stage's output, whose backward is seeded
            by an input ``dy``); default: the losses that ``ones_like`` seeds.

    Returns:
        ``gm``, rewritten in place and recompiled (unchanged for ``"none"`` or a graph with no
        gradient).

    Example:
        traced = trace(train_step, (params, opt_state, batch))
        gm = remat(traced.graph_module, "selective")
    """
    policy = check_policy(policy)
    if policy == "none":
        return gm
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    if forward_of is None:
        seeds = [n for n in graph.nodes if n.target is torch.ops.aten.ones_like.default
                 and isinstance(n.args[0], fx.Node) and n.args[0].meta.get("val") is not None
                 and n.args[0].meta["val"].ndim == 0]
        forward_of = [s.args[0] for s in seeds]
        start = min((position[s] for s in seeds), default=0)  # the backward begins at its seed
    else:
        start = max((position[n] for n in forward_of), default=0)
    if not forward_of:
        return gm
    forward = ancestors(forward_of)
    results = set(forward_of)  # the losses (or a stage's output) themselves are kept
    tags = _layer_tags(graph, forward)
    extra = saves_matmuls if policy == "selective" else (policy if callable(policy) else None)

    def saved(node: fx.Node) -> bool:
        if node.op != "call_function" or node in results or not _recomputable(node):
            return True
        if any(u in forward and tags.get(u) != tags.get(node) for u in node.users):
            return True  # crosses into another layer (or out of no layer into one)
        return bool(extra is not None and extra(node))

    clones: dict[fx.Node, fx.Node] = {}

    def clone(node: fx.Node, before: fx.Node) -> fx.Node:
        if node not in forward or saved(node):
            return node
        if node in clones:
            return clones[node]
        if node.target is operator.getitem:  # one output of a multi-output op: remake the op
            parent = node.args[0]
            src = clone(parent, before) if not saved(parent) else parent
            with graph.inserting_before(before):
                copy = graph.call_function(operator.getitem, (src, node.args[1]))
        else:
            args = fx.map_arg(node.args, lambda a: clone(a, before))
            kwargs = fx.map_arg(node.kwargs, lambda a: clone(a, before))
            with graph.inserting_before(before):
                copy = graph.call_function(node.target, args, kwargs)
        copy.meta = dict(node.meta)
        copy.meta["sf_remat"] = node.name
        clones[node] = copy
        return copy

    for node in list(graph.nodes):  # what the backward (after its seed) reads of the forward
        if position.get(node, -1) <= start or node in forward or node.op == "output" or "sf_remat" in node.meta:
            continue
        for inp in node.all_input_nodes:
            if inp in forward and not saved(inp):
                node.replace_input_with(inp, clone(inp, node))
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def remat_pass(policy: Policy) -> Callable[[fx.GraphModule], fx.GraphModule]:
    """``policy`` as a graph pass for ``sf.jit(..., passes={"after_trace": [...]})``.

        step = sf.jit(train_step, mesh, in_specs=..., passes={"after_trace": [remat_pass("selective")]})
    """
    policy = check_policy(policy)

    def remat_graph(gm: fx.GraphModule) -> fx.GraphModule:
        return remat(gm, policy)

    remat_graph.__name__ = f"remat_{policy if isinstance(policy, str) else 'predicate'}"
    return remat_graph


def _recomputable(node: fx.Node) -> bool:
    """An aten op with no side effect and no randomness (or a getitem of one)."""
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _recomputable(node.args[0])
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace != "aten" and target.name() not in PURE_CUSTOM_OPS:
        return False
    schema = target._schema
    if schema.is_mutable or any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def _layer_tags(graph: fx.Graph, forward: set[fx.Node]) -> dict[fx.Node, tuple[int, int]]:
    """Each forward node's layer ``(stack, index)``: the latest layer of a stacked parameter it is
    computed from (``select(w, 0, i)`` of a placeholder); untagged nodes belong to no layer."""
    stacks: dict[str, int] = {}
    tags: dict[fx.Node, tuple[int, int]] = {}
    for node in graph.nodes:
        if node not in forward or node.op != "call_function":
            continue
        own = None
        if node.target is torch.ops.aten.select.int and node.args[1] == 0:
            base = node.args[0]
            if isinstance(base, fx.Node) and base.op == "placeholder":
                stack = _stack_of(base)
                rank = stacks.setdefault(stack, len(stacks))
                own = (rank, node.args[2] % base.meta["val"].shape[0])
        found = [tags[a] for a in node.all_input_nodes if a in tags] + ([own] if own is not None else [])
        if found:
            tags[node] = max(found)
    return tags


def _stack_of(placeholder: fx.Node) -> str:
    """The stack a stacked leaf belongs to: its path's first name (``0.moe_layers.attn.wq`` ->
    ``moe_layers``)."""
    path = placeholder.meta.get("sf_path", placeholder.name)
    return next((part for part in str(path).split(".") if not part.isdigit()), str(path))


def rematerialized(fn: Callable, policy: Policy = "full", *, backend: str | None = None) -> Callable:
    """``fn`` (a pure function of pytrees of tensors that takes a gradient inside, such as a
    train step) run as its traced joint graph with :func:`remat` applied: a transform in the
    spirit of ``jax.checkpoint``, for one device. Traced once per input signature; ``backend``:
    ``torch.compile`` the rewritten graph with it (None: run it as it is).

        step = rematerialized(make_train_step(llama, cfg.model, opt), "selective")
        params, opt_state, metrics = step(params, opt_state, batch)
    """
    import optree

    from shardfn.partition.spmd.trace import flatten_args, trace

    policy = check_policy(policy)
    programs: dict = {}

    def run(*args):
        leaves, _, _ = flatten_args(args)
        key = tuple((tuple(x.shape), x.dtype, x.device) for x in leaves) + (optree.tree_structure(args),)
        if key not in programs:
            traced = trace(fn, args)
            gm = remat(traced.graph_module, policy)
            program = gm if backend is None else torch.compile(gm, backend=backend, dynamic=False)
            programs[key] = (program, traced.out_treedef)
        gm, out_treedef = programs[key]
        return optree.tree_unflatten(out_treedef, list(gm(*leaves)))

    return run
