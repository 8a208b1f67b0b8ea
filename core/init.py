"""Parameter tables and deterministic initialisation from an explicit seed.

A model describes its parameters once, as a tree of :class:`Param` leaves (shape, logical axes,
initialiser). Everything else is derived from that one table, so shapes, axes and counts can
never drift apart:

    table = {"embed": normal((256, 64), ("vocab", "embed")), "norm": ones((64,), ("norm",))}
    params = init_params(table, seed=0)          # {"embed": tensor [256, 64], "norm": tensor [64]}
    axes_of(table)                               # {"embed": ("vocab", "embed"), "norm": ("norm",)}
    count_params(table)                          # 16448, from shapes only

Initialisers: ``normal(0, std)`` for matrices, ones for norm weights, zeros for biases (e.g. the
MoE router's selection bias). Values are drawn in *blocks*: one block per index of the leaf's
``layers`` and ``expert`` dims (the whole leaf when it has neither), each from its own
``torch.Generator`` seeded with the run seed folded with the leaf's path and the block's index.
So a value depends only on ``(seed, path, shape)`` -- not on the device, the dtype (draws are
float32 on CPU, then cast and moved), the order of the tree or the other leaves -- and a rank
that holds a few layers (a pipeline stage) or a few experts draws just those blocks:

    part = init_params(table, seed=0, regions={"layers.wq": (slice(2, 4),)})   # {"layers.wq": layers 2..3}

On the ``meta`` device nothing is drawn or allocated, which is how the parameter counts of
trillion-parameter configs are checked.
"""

from __future__ import annotations

import itertools
import zlib
from typing import NamedTuple, Sequence

import torch

from shardfn.core.pytree import PyTree, flatten_with_paths, map_with_path, tree_leaves, tree_map

__all__ = ["Param", "normal", "ones", "zeros", "stacked", "init_params", "axes_of", "shapes_of", "count_params"]


class Param(NamedTuple):
    """One parameter of a model's table: a leaf, not a node, of the table tree."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # one logical axis name (or None) per dim
    init: str = "normal"          # "normal" | "ones" | "zeros"
    std: float = 0.02             # for "normal"


_INITS = ("normal", "ones", "zeros")


def _is_param(x) -> bool:
    return isinstance(x, Param)


def normal(shape: tuple[int, ...], axes: tuple[str | None, ...], std: float = 0.02) -> Param:
    """A parameter drawn from ``N(0, std**2)``.

    Example:
        normal((64, 256), ("embed", "mlp"))
    """
    return _param(shape, axes, "normal", std)


def ones(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> Param:
    """A parameter initialised to ones (norm weights).

    Example:
        ones((64,), ("norm",))
    """
    return _param(shape, axes, "ones", 0.0)


def zeros(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> Param:
    """A parameter initialised to zeros (biases).

    Example:
        zeros((8,), ("expert",))
    """
    return _param(shape, axes, "zeros", 0.0)


def _param(shape, axes, init, std) -> Param:
    shape, axes = tuple(int(d) for d in shape), tuple(axes)
    if len(shape) != len(axes):
        raise ValueError(f"a parameter of shape {shape} needs one logical axis per dim, got {axes}")
    if init not in _INITS:
        raise ValueError(f"unknown initialiser {init!r}; valid: {', '.join(_INITS)}")
    return Param(shape, axes, init, float(std))


def stacked(n: int, table: PyTree) -> PyTree:
    """``table`` with a leading ``layers`` dim of size ``n`` on every parameter.

    Example:
        stacked(32, {"wq": normal((4096, 4096), ("embed", "heads"))})
        # {"wq": Param(shape=(32, 4096, 4096), axes=("layers", "embed", "heads"), ...)}
    """
    return tree_map(lambda p: p._replace(shape=(n, *p.shape), axes=("layers", *p.axes)), table, is_leaf=_is_param)


def _leaf_seed(seed: int, path: str) -> int:
    return (int(seed) * 0x9E3779B97F4A7C15 + zlib.crc32(path.encode())) % (2**63 - 1)


BLOCK_AXES = ("layers", "expert")
"""Logical axes along which a leaf is drawn block by block (one generator per index)."""

Region = Sequence[slice]
"""Which part of a leaf to build: one ``slice`` (step 1) per leading dim; missing dims are whole."""


def _full_region(shape: tuple[int, ...], region: Region | None, path: str) -> tuple[slice, ...]:
    region = tuple(region or ())
    if len(region) > len(shape):
        raise ValueError(f"region {region} of parameter {path!r} has more dims than its shape {shape}")
    out = []
    for d, size in enumerate(shape):
        r = region[d] if d < len(region) else slice(None)
        start, stop, step = r.indices(size)
        if step != 1 or stop < start:
            raise ValueError(f"region {region} of parameter {path!r} {list(shape)}: dim {d} must be a slice "
                             f"with step 1 inside [0, {size})")
        out.append(slice(start, stop))
    return tuple(out)


def _draw(path: str, p: Param, seed: int, region: tuple[slice, ...]) -> torch.Tensor:
    """The float32 normal draws of ``region`` of the leaf, one generator per block."""
    blocks = [d for d, a in enumerate(p.axes) if a in BLOCK_AXES]
    inner = [d for d in range(len(p.shape)) if d not in blocks]
    inner_shape = [p.shape[d] for d in inner]
    inner_region = tuple(region[d] for d in inner)
    if not blocks:
        g = torch.Generator().manual_seed(_leaf_seed(seed, path))
        return (torch.randn(inner_shape, generator=g, dtype=torch.float32) * p.std)[inner_region]
    out = torch.empty([r.stop - r.start for r in region], dtype=torch.float32)
    for index in itertools.product(*[range(region[d].start, region[d].stop) for d in blocks]):
        g = torch.Generator().manual_seed(_leaf_seed(seed, f"{path}{list(index)}"))
        block = (torch.randn(inner_shape, generator=g, dtype=torch.float32) * p.std)[inner_region]
        at: list = [slice(None)] * len(p.shape)
        for d, i in zip(blocks, index):
            at[d] = i - region[d].start
        out[tuple(at)] = block
    return out


def _init_leaf(path: str, p: Param, seed: int, device, dtype, region: Region | None = None) -> torch.Tensor:
    device = torch.device(device)
    box = _full_region(p.shape, region, path)
    shape = tuple(r.stop - r.start for r in box)
    if device.type == "meta":
        return torch.empty(shape, device=device, dtype=dtype)
    if p.init == "ones":
        return torch.ones(shape, device=device, dtype=dtype)
    if p.init == "zeros":
        return torch.zeros(shape, device=device, dtype=dtype)
    return _draw(path, p, seed, box).to(device=device, dtype=dtype)


def init_params(table: PyTree, seed: int, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, regions: dict[str, Region] | None = None) -> PyTree:
    """Tensors for every :class:`Param` of ``table``, deterministic in ``seed``.

    Args:
        table: a tree of :class:`Param`.
        seed: the run seed; each leaf folds in its path (see the module docstring).
        device: where the tensors live; ``"meta"`` allocates nothing.
        dtype: of every tensor.
        regions: build only these parts: ``path -> tuple of slices`` (of the leaf's global
            shape); the result is then the flat dict ``path -> tensor`` of those parts, each equal
            to the same slice of the whole tree's leaf. A pipeline rank builds its stages this way.

    Returns:
        A tree of tensors with the table's structure (a flat dict with ``regions``).

    Example:
        params = init_params({"w": normal((4, 8), ("embed", "mlp"))}, seed=0)
        params["w"].shape  # torch.Size([4, 8])
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if regions is None:
        return map_with_path(lambda path, p: _init_leaf(path, p, seed, device, dtype), table, is_leaf=_is_param)
    leaves = dict(flatten_with_paths(table, is_leaf=_is_param))
    unknown = [path for path in regions if path not in leaves]
    if unknown:
        raise KeyError(f"init_params: no parameter {unknown[0]!r} in the table; its leaves are {list(leaves)[:8]}...")
    return {path: _init_leaf(path, leaves[path], seed, device, dtype, r) for path, r in regions.items()}


def axes_of(table: PyTree) -> PyTree:
    """The tree of logical-axis tuples (``param_axes``) of a table.

    Example:
        axes_of({"w": normal((4, 8), ("embed", "mlp"))})  # {"w": ("embed", "mlp")}
    """
    return tree_map(lambda p: p.axes, table, is_leaf=_is_param)


def shapes_of(table: PyTree) -> PyTree:
    """The tree of shapes of a table.

    Example:
        shapes_of({"w": normal((4, 8), ("embed", "mlp"))})  # {"w": (4, 8)}
    """
    return tree_map(lambda p: p.shape, table, is_leaf=_is_param)


def count_params(table: PyTree) -> int:
    """Number of elements over every parameter of a table (from shapes; nothing allocated).

    Example:
        count_params({"w": normal((4, 8), ("embed", "mlp"))})  # 32
    """
    total = 0
    for p in tree_leaves(table, is_leaf=_is_param):
        n = 1
        for d in p.shape:
            n *= d
        total += n
    return total
