"""Trace: one joint FX graph (forward, backward and optimizer) of a pure function of pytrees.

The graph is traced at *global* shapes with fake tensors, so nothing is computed or allocated;
placements are attached later by propagation. The gradient of a stacked parameter is built by one
``stack`` of its per-layer parts (``partition.spmd.fx.stack_gradients``), not summed from zero-filled
``select_backward`` s.

    traced = trace(train_step, (params, opt_state, batch))
    print(traced.graph_module.graph)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import optree
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core.pytree import flatten_with_paths
from shardfn.partition.constrain import tracing_scope
from shardfn.partition.local_map import collecting_regions
from shardfn.partition.spmd.fx import drop_detaches, stack_gradients


@dataclass
class Traced:
    """A traced function: the global graph plus how to flatten its inputs and rebuild outputs."""

    graph_module: torch.fx.GraphModule
    in_treedef: Any
    out_treedef: Any
    in_paths: list[str]            # dotted path of every input leaf, e.g. "0.layers.wq"
    in_meta: list[torch.Tensor]    # fake tensors with each input's global shape and dtype
    out_meta: list[torch.Tensor]   # same, for each output leaf
    regions: tuple = ()            # the sf.local_map regions the graph calls (kept alive with it)


def flatten_args(args: tuple) -> tuple[list, Any, list[str]]:
    leaves, treedef = optree.tree_flatten(args, none_is_leaf=False)
    paths = [p for p, _ in flatten_with_paths(args)]
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"argument leaf {path!r} is a {type(leaf).__name__}; sf.jit traces functions of "
                f"pytrees of tensors (close over Python values instead of passing them)"
            )
    return leaves, treedef, paths


def trace(fn: Callable, args: tuple) -> Traced:
    """Trace ``fn(*args)`` into one graph of aten ops at global shapes."""
    leaves, in_treedef, paths = flatten_args(args)
    out_treedef = None

    def flat_fn(*flat):
        nonlocal out_treedef
        with tracing_scope():
            out = fn(*optree.tree_unflatten(in_treedef, list(flat)))
        out_leaves, out_treedef = optree.tree_flatten(out, none_is_leaf=False)
        for leaf in out_leaves:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"sf.jit functions return pytrees of tensors; got a {type(leaf).__name__} leaf")
        return out_leaves

    distinct, seen = [], set()
    for x in leaves:  # one tensor passed as two leaves would trace as one input
        distinct.append(x.clone() if id(x) in seen else x)
        seen.add(id(x))
    with collecting_regions() as regions:
        gm = make_fx(flat_fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*distinct)
    gm = stack_gradients(drop_detaches(gm))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    in_meta = [n.meta["val"] for n in placeholders]
    out_meta = [o.meta["val"] for o in outputs]
    for node, path in zip(placeholders, paths):
        node.meta["sf_path"] = path
    return Traced(gm, in_treedef, out_treedef, paths, in_meta, out_meta, tuple(regions))
