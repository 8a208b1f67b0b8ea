"""Small helpers over FX graphs that every layer of the partitioner shares.

    live = ancestors([loss_node])                      # what the loss depends on
    later = descendants([dy_node])                      # what depends on the output gradient
    sub = extract_subgraph(gm, nodes, inputs=[x, w], outputs=[y])
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx


def ancestors(roots: Iterable[fx.Node], stop: Callable[[fx.Node], bool] = lambda n: False) -> set[fx.Node]:
    """``roots`` and everything they depend on (not walking past nodes where ``stop`` is true).

    Example:
        ancestors([loss]) - ancestors([x])   # the nodes between x and the loss
    """
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if not stop(n):
            stack.extend(n.all_input_nodes)
    return seen


def descendants(roots: Iterable[fx.Node]) -> set[fx.Node]:
    """``roots`` and every node that depends on them (the graph's output node left out).

    Example:
        descendants([dy])   # the backward part of a joint graph
    """
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(u for u in n.users if u.op != "output")
    return seen


def is_view(target: Any) -> bool:
    """True for an op (or a node calling one) whose output aliases an input: no bytes move.

    Example:
        is_view(torch.ops.aten.t.default), is_view(torch.ops.aten.mm.default)   # True, False
    """
    if isinstance(target, fx.Node):
        target = target.target
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def moves_no_bytes(node: fx.Node) -> bool:
    """A view, or a ``getitem`` taking one output of a multi-output op."""
    return node.target is operator.getitem or is_view(node)


def node_val(node: Any) -> Any:
    """The fake value tracing recorded for ``node`` (None for anything else)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def nbytes(val: Any) -> int:
    """Bytes of a tensor, or of every tensor in a tuple or list of them."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(nbytes(v) for v in val)
    return 0


def output_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The values a graph returns, in order."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def extract_subgraph(gm: fx.GraphModule, nodes: Iterable[fx.Node], inputs: Sequence[fx.Node],
                     outputs: Sequence[fx.Node], *, input_names: Sequence[str] | None = None) -> fx.GraphModule:
    """A GraphModule computing ``outputs`` from ``inputs`` with the ops in ``nodes`` (copied in graph order).

    Every argument of a copied node must be an input or another copied node. ``outputs`` may
    name inputs (passed through). The result returns a tuple, in ``outputs`` order.

    Example:
        sub = extract_subgraph(gm, {mm, relu}, inputs=[x, w], outputs=[relu])
        (y,) = sub(x_value, w_value)
    """
    keep = set(nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names = list(input_names) if input_names is not None else [n.name for n in inputs]
    for node, name in zip(inputs, names):
        ph = g.placeholder(identifier(name))
        ph.meta.update(node.meta)
        env[node] = ph

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:
            raise AssertionError(f"node {a.name!r} is neither an input nor in the subgraph")
        return env[a]

    for node in gm.graph.nodes:
        if node in keep and node not in env:
            assert node.op not in ("placeholder", "output"), f"{node.op} {node.name} cannot be copied"
            env[node] = g.node_copy(node, lookup)
    g.output(tuple(lookup(o) for o in outputs))
    g.lint()
    return fx.GraphModule(gm, g)


def identifier(name: str) -> str:
    """``name`` as a valid Python identifier (a placeholder's name)."""
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else f"v_{out}"


def stack_layer_grads(gm: fx.GraphModule, outputs: Sequence[fx.Node]) -> list[fx.Node]:
    """Rewrite each output that sums ``select_backward(g_i, [k, ...], 0, i)`` over every layer
    ``i < k`` into one ``stack([g_0, ..., g_{k-1}])``: the gradient of a stacked slice no longer
    materialises a zero ``[k, ...]`` tensor per layer. Returns the (possibly new) outputs.

        dparams = stack_layer_grads(joint, dparams)
        # add(select_backward(g1, .., 1), select_backward(g0, .., 0)) -> stack([g0, g1])
    """
    out = []
    for node in outputs:
        leaves = _add_tree(node)
        sb = torch.ops.aten.select_backward.default
        sizes = {tuple(leaf.args[1]) for leaf in leaves if leaf.target is sb and leaf.args[2] == 0} if leaves else set()
        if not leaves or len(sizes) != 1 or any(leaf.target is not sb or leaf.args[2] != 0 for leaf in leaves):
            out.append(node)
            continue
        k = sizes.pop()[0]
        by_layer: dict[int, list[fx.Node]] = {}
        for leaf in leaves:
            by_layer.setdefault(leaf.args[3] % k, []).append(leaf.args[0])
        if sorted(by_layer) != list(range(k)):
            out.append(node)
            continue
        with gm.graph.inserting_after(node):
            parts = []
            for i in range(k):
                g = by_layer[i][0]
                for extra in by_layer[i][1:]:
                    g = gm.graph.call_function(torch.ops.aten.add.Tensor, (g, extra))
                parts.append(g)
            stacked = gm.graph.call_function(torch.ops.aten.stack.default, (parts, 0))
        stacked.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(stacked)
        out.append(stacked)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return out


def _add_tree(node: fx.Node) -> list[fx.Node]:
    """The summands of a tree of ``aten.add.Tensor`` nodes rooted at ``node`` (``[node]`` if it is not an add)."""
    if node.target is not torch.ops.aten.add.Tensor or node.kwargs.get("alpha", 1) != 1:
        return [node]
    leaves = []
    for a in node.args:
        if not isinstance(a, fx.Node):
            return []
        leaves += _add_tree(a) if len(a.users) == 1 else [a]
    return leaves


def drop_detaches(gm: fx.GraphModule) -> fx.GraphModule:
    """Every ``aten.detach`` of a traced graph that the output does not read, replaced by its
    input (in place). A traced graph is already differentiated, so a detach is the identity
    there. Taken out, a parameter that a gradient's fresh leaf read through one
    (``core.transforms.value_and_grad``) is read directly again, as every pass after tracing
    expects (fsdp's gather at each use), and autograd's saved values are read without the two
    detaches it recorded for each. A detach the output reads (a metric's ``loss.detach()``)
    stays, moved to right after its input: program order then says the value exists from there,
    so the collective that reduces it can go with the first ones after it (a loss joins the
    gradients' bucket, ``partition.passes.bucket``) instead of costing one more at the end.

        gm = drop_detaches(gm)   # the same outputs, no aten.detach but the outputs' own
    """
    detach = torch.ops.aten.detach.default
    detaches = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is detach]
    found = [n for n in detaches if not any(u.op == "output" for u in n.users)]
    for node in found:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    kept = [n for n in detaches if n not in found and isinstance(n.args[0], fx.Node)
            and n.args[0].op == "call_function"]  # (placeholders stay together at the top)
    for node in kept:
        node.args[0].append(node)
    if found or kept:
        gm.graph.lint()
        gm.recompile()
    return gm


def stack_gradients(gm: fx.GraphModule) -> fx.GraphModule:
    """Every gradient of a stacked parameter that the backward sums from per-layer
    ``select_backward`` s built by one ``stack`` instead (:func:`stack_layer_grads`), wherever it
    is used (the optimizer of a train step): no zero-filled ``[k, ...]`` tensor per layer, the
    same values and the same collectives after partitioning.

        gm = stack_gradients(traced.graph_module)
    """
    sb = torch.ops.aten.select_backward.default
    add = torch.ops.aten.add.Tensor
    roots = [n for n in gm.graph.nodes
             if n.target is add and not any(u.target is add for u in n.users)
             and (leaves := _add_tree(n)) and all(leaf.target is sb for leaf in leaves)]
    if roots:
        stack_layer_grads(gm, roots)
    return gm


def memory_order(t: torch.Tensor) -> list[int] | None:
    """The dims of ``t`` from outermost to innermost in memory, or None when ``t`` is not dense
    (overlapping or with gaps), so cannot be a view of a flat buffer in that order.

        memory_order(torch.empty(2, 3).t())  # [1, 0]
    """
    order = sorted(range(t.ndim), key=lambda d: (-t.stride(d), d))
    expected = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return None
        expected *= t.shape[d]
    return order
