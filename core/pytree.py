"""Pytree helpers on optree.

Parameters are nested dicts of tensors. Every leaf has a string path (``layers.wq``) so specs
and rules can address it, and a parallel pytree of logical axis names describes its dims.

    params = {"embed": torch.zeros(8, 4), "layers": {"wq": torch.zeros(2, 4, 4)}}
    paths(params)  # ['embed', 'layers.wq']
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch

PyTree = Any

# Logical axes are tuples of strings; they must stay leaves, not be flattened as sequences.
_AXES_LEAF = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)  # noqa: E731


def tree_map(fn: Callable, tree: PyTree, *rest: PyTree, is_leaf: Callable | None = None) -> PyTree:
    """``fn`` applied leaf-wise over one or more trees of the same structure.

        tree_map(lambda a, b: a + b, {"w": x}, {"w": y})  # {"w": x + y}
    """
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, none_is_leaf=False)


def tree_leaves(tree: PyTree, is_leaf: Callable | None = None) -> list:
    """The leaves of ``tree`` in a deterministic (sorted-key) order."""
    return optree.tree_leaves(tree, is_leaf=is_leaf, none_is_leaf=False)


def tree_flatten(tree: PyTree, is_leaf: Callable | None = None):
    """``(leaves, treedef)``; ``treedef.unflatten(leaves)`` rebuilds the tree."""
    return optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=False)


def tree_unflatten(treedef, leaves: list) -> PyTree:
    return optree.tree_unflatten(treedef, leaves)


def _path_str(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def flatten_with_paths(tree: PyTree, is_leaf: Callable | None = None) -> list[tuple[str, Any]]:
    """``[(path, leaf), ...]`` with dotted string paths.

        flatten_with_paths({"a": {"b": x}})  # [("a.b", x)]
    """
    keys, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=is_leaf, none_is_leaf=False)
    return [(_path_str(k), leaf) for k, leaf in zip(keys, leaves)]


def paths(tree: PyTree, is_leaf: Callable | None = None) -> list[str]:
    """Dotted paths of every leaf, in leaf order."""
    return [p for p, _ in flatten_with_paths(tree, is_leaf)]


def map_with_path(fn: Callable[[str, Any], Any], tree: PyTree, is_leaf: Callable | None = None) -> PyTree:
    """``fn(path, leaf)`` over every leaf.

        map_with_path(lambda p, x: p, {"a": {"b": 0}})  # {"a": {"b": "a.b"}}
    """
    return optree.tree_map_with_path(
        lambda path, x: fn(_path_str(path), x), tree, is_leaf=is_leaf, none_is_leaf=False
    )


def axes_leaves(axes: PyTree) -> list[tuple]:
    """Leaves of a tree of logical-axis tuples (each tuple is one leaf)."""
    return optree.tree_leaves(axes, is_leaf=_AXES_LEAF, none_is_leaf=False)


def map_axes(fn: Callable, axes: PyTree, *rest: PyTree) -> PyTree:
    """``fn`` over a tree of logical-axis tuples (each tuple is one leaf) and matching trees."""
    return optree.tree_map(fn, axes, *rest, is_leaf=_AXES_LEAF, none_is_leaf=False)


def count(tree: PyTree) -> int:
    """Total number of elements over all tensor (or shape-like) leaves.

        count({"w": torch.zeros(2, 3)})  # 6
    """
    return sum(_numel(x) for x in tree_leaves(tree))


def size_bytes(tree: PyTree) -> int:
    """Total bytes over all tensor leaves (``numel * element_size``).

        size_bytes({"w": torch.zeros(2, 3)})  # 24
    """
    return sum(_numel(x) * x.element_size() for x in tree_leaves(tree) if isinstance(x, torch.Tensor))


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if hasattr(x, "shape"):
        n = 1
        for d in x.shape:
            n *= int(d)
        return n
    return 0
