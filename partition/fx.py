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
