"""Where a run's parameters come from: a *source* builds any boxes of the full leaves it is asked
for, so each rank makes only what it holds.

A source is ``source(regions) -> {path: tensor}`` with ``regions`` a dict ``path -> tuple of
slices`` of each full leaf: ``model.init(cfg, seed, regions=...)`` and
``models.hf.load(..., regions=...)`` are sources, and so is a full tree (:func:`tree_source`).
A step's ``place`` takes either.

    source = lambda regions: model.init(cfg.model, seed, regions=regions)
    params = sharded_tree(source, shapes, specs, mesh)     # DTensors; each rank built its shard only
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch
from torch.distributed.tensor import DTensor

from shardfn.core import _torch_private as private
from shardfn.core.pytree import PyTree, flatten_with_paths

Source = Callable[[dict], dict]
"""``source(regions) -> {path: tensor}``: the boxes ``path -> tuple of slices`` of full leaves."""


def tree_source(params: PyTree) -> Source:
    """The :data:`Source` of a full tree: each region sliced out of its leaf.

        tree_source(params)({"embed": (slice(0, 4),)})   # {"embed": params["embed"][0:4]}
    """
    flat = dict(flatten_with_paths(params))
    return lambda regions: {p: flat[p][tuple(r)] for p, r in regions.items()}


def as_source(params_or_source: PyTree | Source) -> Source:
    """A source as it is, a full tree as :func:`tree_source`."""
    return params_or_source if callable(params_or_source) else tree_source(params_or_source)


def full_tree(params_or_source: PyTree | Source, like: PyTree) -> PyTree:
    """The whole tree shaped like ``like`` (tensors of the right shapes: fake, meta or real)."""
    if not callable(params_or_source):
        return params_or_source
    items = flatten_with_paths(like)
    got = params_or_source({p: tuple(slice(0, n) for n in x.shape) for p, x in items})
    return optree.tree_unflatten(optree.tree_structure(like, none_is_leaf=False), [got[p] for p, _ in items])


def sharded_tree(params_or_source: PyTree | Source, like: PyTree, specs: Any, mesh) -> PyTree:
    """DTensors laid out by ``specs`` (a pytree prefix of ``P``) on ``mesh``, each rank building
    only its own shard of every leaf of ``like``'s shapes; no communication.

        params = sharded_tree(source, shapes, step.specs["params"], mesh)
    """
    from shardfn.partition.spec import broadcast_specs

    source = as_source(params_or_source)
    items = flatten_with_paths(like)
    dmesh = mesh.device_mesh
    specs = broadcast_specs(specs, like, what="specs")
    placements, regions = [], {}
    for (path, x), spec in zip(items, specs):
        pl = mesh.placements(spec, x.ndim, where=f"parameter {path}")
        shape, offset = private.local_shape_and_offset(x.shape, dmesh, pl)
        placements.append(pl)
        regions[path] = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    got = source(regions)
    leaves = [DTensor.from_local(got[p].detach().clone().contiguous(), dmesh, pl, run_check=False,
                                 shape=x.shape, stride=contiguous_stride(x.shape))
              for (p, x), pl in zip(items, placements)]
    return optree.tree_unflatten(optree.tree_structure(like, none_is_leaf=False), leaves)


def contiguous_stride(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, n = [], 1
    for d in reversed(tuple(shape)):
        stride.append(n)
        n *= d
    return tuple(reversed(stride))


def abstract(tree: PyTree, device: torch.device | str) -> PyTree:
    """Fake tensors with ``tree``'s shapes and dtypes on ``device``: what step builders trace."""
    with private.fake_mode():
        return optree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device=device), tree,
                               none_is_leaf=False)
