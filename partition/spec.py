"""PartitionSpec ``P`` (JAX convention) and its one translation to DTensor placements.

``P`` is indexed by *tensor dim*: each entry names the mesh axis (or tuple of axes) that dim is
split over, or ``None``. DTensor placements are indexed by *mesh dim*. This module is the only
place that converts between the two.

    spec = P("dp", None, "tp")                  # dim 0 over dp, dim 2 over tp
    to_placements(spec, 3, ("dp", "tp"))        # (Shard(0), Shard(2))
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import optree
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement


class P(tuple):
    """A partition spec: one entry per tensor dim (trailing dims may be left out).

    Each entry is ``None`` (not split), a mesh-axis name, or a tuple of names (split over their
    product, major to minor).

        P("dp")              # dim 0 over dp, the rest replicated
        P(("dp", "fsdp"), None, "tp")
    """

    def __new__(cls, *entries):
        for e in entries:
            if not (e is None or isinstance(e, str) or (isinstance(e, tuple) and all(isinstance(a, str) for a in e))):
                raise TypeError(f"P entries are None, an axis name or a tuple of axis names; got {e!r}")
        return super().__new__(cls, tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries))

    def __reduce__(self):
        return (P, tuple(self))

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def axes(self) -> list[str]:
        """All mesh-axis names this spec uses, in order."""
        return [a for e in self for a in entry_axes(e)]


AUTO_OPTIONS = ("time_limit_s", "mip_gap", "hardware", "cost_model", "strict")


class _Auto:
    """Marker: let the auto-sharder choose this input's spec. Called, it carries the solver's
    options (``time_limit_s``, ``mip_gap``, ``hardware``, ``cost_model``, ``strict``; see
    ``partition.auto.solve``); plain ``AUTO`` uses their defaults.

        step = sf.jit(train_step, mesh, in_specs=sf.AUTO(time_limit_s=60, hardware="h200"))
        step = sf.jit(train_step, mesh, in_specs=(sf.AUTO(mip_gap=0.01, strict=True), P("dp")))
    """

    def __init__(self, **options):
        unknown = sorted(set(options) - set(AUTO_OPTIONS))
        if unknown:
            raise TypeError(f"sf.AUTO: unknown option(s) {unknown}; valid options are {list(AUTO_OPTIONS)}")
        self.options = options

    def __call__(self, **options) -> "_Auto":
        return _Auto(**{**self.options, **options})

    def __repr__(self) -> str:
        if not self.options:
            return "AUTO"
        return "AUTO(" + ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + ")"


AUTO = _Auto()


def is_auto(x: Any) -> bool:
    """True for ``AUTO`` and for ``AUTO(...)`` with options."""
    return isinstance(x, _Auto)


def is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None or is_auto(x)


def to_placements(
    spec: P | None, ndim: int, axis_names: Sequence[str], *, where: str = "value", known: Sequence[str] = ()
) -> tuple[Placement, ...]:
    """Placements (one per mesh dim, ``axis_names``) for a tensor of ``ndim`` dims under ``spec``.

    ``known`` are further valid axis names that have no mesh dim (size-1 axes): naming them
    splits nothing. Raises ValueError naming ``where`` for an unknown axis, an axis used twice,
    or more entries than dims.
    """
    spec = P() if spec is None else spec
    if isinstance(spec, str):  # a bare axis name would be read letter by letter
        raise TypeError(f"{where}: a spec is a P(...) or None, got the string {spec!r}; write P({spec!r})")
    if len(spec) > ndim:
        raise ValueError(f"{where}: spec {spec!r} has {len(spec)} entries but the tensor has {ndim} dims")
    placements: list[Placement] = [Replicate() for _ in axis_names]
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        names = entry_axes(entry)
        for name in names:
            if name not in axis_names and name not in known:
                valid = tuple(known) or tuple(axis_names)
                raise ValueError(f"{where}: unknown mesh axis {name!r} in {spec!r}; the mesh has axes {valid}")
            if name in seen:
                raise ValueError(f"{where}: mesh axis {name!r} is used twice in {spec!r}")
            seen.add(name)
            if name not in axis_names:
                continue  # a size-1 axis: nothing to split
            # Splitting one dim over several axes: DTensor orders shards by mesh dim, so the axes
            # of one entry must follow the mesh order (major to minor).
            placements[list(axis_names).index(name)] = Shard(dim)
        idx = [list(axis_names).index(n) for n in names if n in axis_names]
        if idx != sorted(idx):
            raise ValueError(
                f"{where}: the axes {tuple(names)} of dim {dim} in {spec!r} must follow the mesh order "
                f"{tuple(axis_names)}"
            )
    return tuple(placements)


def to_spec(placements: Sequence[Placement], ndim: int, axis_names: Sequence[str]) -> P:
    """The inverse of :func:`to_placements` (Partial placements are shown by :func:`describe`)."""
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for name, pl in zip(axis_names, placements):
        if isinstance(pl, Shard):
            entries[pl.dim].append(name)
    out = [None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in entries]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def describe(placements: Sequence[Placement], axis_names: Sequence[str]) -> str:
    """Compact text for placements: ``dp:S(0) tp:P(sum)``; replicated axes are left out; a strided
    shard (dim 1 split in 2 interleaved blocks per rank) is ``tp:S(1,strided 2)``."""
    from shardfn.core._torch_private import strided_shard

    parts = []
    for name, pl in zip(axis_names, placements):
        strided = strided_shard(pl)
        if strided is not None:
            parts.append(f"{name}:S({strided[0]},strided {strided[1]})")
        elif isinstance(pl, Shard):
            parts.append(f"{name}:S({pl.dim})")
        elif isinstance(pl, Partial):
            parts.append(f"{name}:P({pl.reduce_op})")
    return " ".join(parts) or "R"


def check_divisible(shape: Sequence[int], spec: P | None, axis_sizes: dict[str, int], *, where: str) -> None:
    """ValueError naming ``where`` when a dim is not divisible by the mesh axes it is split over."""
    for dim, entry in enumerate(spec or ()):
        names = entry_axes(entry)
        n = 1
        for name in names:
            n *= axis_sizes[name]
        if n > 1 and shape[dim] % n:
            raise ValueError(
                f"{where}: dim {dim} of size {shape[dim]} is not divisible by mesh axes {tuple(names)} "
                f"(size {n}); pick a size that divides, or split this dim over fewer axes"
            )


def broadcast_specs(specs: Any, tree: Any, *, what: str = "in_specs") -> list:
    """One spec per leaf of ``tree``; ``specs`` may be a prefix of ``tree`` (a single ``P``
    stands for every leaf below it, ``None`` means replicated).

        broadcast_specs((P("dp"), P()), (x, {"a": y, "b": z}))  # [P('dp'), P(), P()]
    """
    specs = optree.tree_map(lambda s: P() if s is None else s, specs, is_leaf=is_spec, none_is_leaf=True)
    treedef = optree.tree_structure(tree, none_is_leaf=False)
    try:
        full = optree.tree_broadcast_prefix(specs, tree, is_leaf=is_spec, none_is_leaf=False)
        return treedef.flatten_up_to(full)
    except ValueError:
        pass
    # say it again over the tree's structure: shapes, never tensor values
    outline = optree.tree_map(_Outline, tree, none_is_leaf=False)
    try:
        optree.tree_broadcast_prefix(specs, outline, is_leaf=is_spec, none_is_leaf=False)
        detail = "they do not line up"
    except ValueError as e:
        detail = str(e)
    structure = optree.tree_unflatten(treedef, treedef.flatten_up_to(outline))
    raise ValueError(f"{what} must be a pytree prefix of the arguments: {detail.rstrip('.')}. The arguments' "
                     f"structure: {structure!r}") from None


class _Outline:
    """A leaf shown by its dtype and shape (``f32[64, 256]``) in error messages."""

    def __init__(self, x: Any):
        self.text = (f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}" if isinstance(x, torch.Tensor)
                     else type(x).__name__)

    def __repr__(self) -> str:
        return self.text


def specs_like(tree: Any, param_specs: Any) -> Any:
    """Specs for a state that mirrors the parameters (an optimizer's moments, an EMA copy): each
    subtree of ``tree`` with the structure of ``param_specs`` takes ``param_specs``; every other
    leaf (step counts, learning rates, scalars) is replicated, ``P()``.

    ``param_specs`` is the full spec tree of the parameters (one ``P`` per parameter, as given to
    ``in_specs``); subtrees are matched by structure (the same keys, the same nesting), so a
    NamedTuple state whose fields mirror the parameters gets their specs field by field. A
    ``param_specs`` that covers only some of a state subtree's leaves (a partial tree) is refused,
    naming the missing leaves: the state would otherwise be replicated, unlike its parameters.

    Example:
        opt_specs = sf.specs_like(opt.init(params), param_specs)
        # adamw: (ScaleByAdamState(count=P(), mu=param_specs, nu=param_specs), EmptyState(), ...)
    """
    if is_spec(param_specs):
        raise TypeError(f"specs_like: param_specs must be the parameters' spec tree (one P per parameter), got "
                        f"the single spec {param_specs!r}; a state cannot be matched against one leaf")
    param_specs = optree.tree_map(lambda s: P() if s is None else s, param_specs, is_leaf=is_spec,
                                  none_is_leaf=True)
    for s in optree.tree_leaves(param_specs, is_leaf=is_spec, none_is_leaf=False):
        if not is_spec(s):
            raise TypeError(f"specs_like: param_specs has a leaf that is not a P: {_Outline(s)!r}; its "
                            f"structure: {optree.tree_map(_Outline, param_specs, is_leaf=is_spec)!r}")
    wanted = optree.tree_structure(param_specs, is_leaf=is_spec, none_is_leaf=False)
    _refuse_partial(tree, param_specs)

    def like_params(x) -> bool:
        return not isinstance(x, torch.Tensor) and optree.tree_structure(x, none_is_leaf=False) == wanted

    return optree.tree_map(lambda sub: param_specs if like_params(sub) else P(), tree, is_leaf=like_params,
                           none_is_leaf=False)


def _refuse_partial(tree: Any, param_specs: Any) -> None:
    """Raise when a subtree of ``tree`` holds every leaf path of ``param_specs`` and more: the spec
    tree is a part of the parameters' (``{"w": P("fsdp")}`` for ``{"w": ..., "b": ...}``)."""
    covered = set(optree.tree_paths(param_specs, is_leaf=is_spec, none_is_leaf=False))
    if not covered or covered == {()}:
        return

    def visit(x, where: tuple) -> None:
        if isinstance(x, torch.Tensor):
            return
        try:
            children, _, entries, _ = optree.tree_flatten_one_level(x, none_is_leaf=False)
        except ValueError:
            return  # a leaf
        paths = set(optree.tree_paths(x, none_is_leaf=False))
        if covered < paths:
            missing = sorted(".".join(str(k) for k in where + p) for p in paths - covered)
            raise ValueError(
                f"specs_like: param_specs covers only part of the state at {'.'.join(map(str, where)) or 'the root'}: "
                f"no spec for {missing[:8]}{' ...' if len(missing) > 8 else ''}; give the full spec tree of the "
                f"parameters (P() for a replicated one), or that state would be replicated"
            )
        for child, key in zip(children, entries):
            visit(child, where + (key,))

    visit(tree, ())


def specs_from_rules(axes_tree: Any, rules: dict[str, Any], axis_sizes: dict[str, int]) -> Any:
    """Turn logical axis names into a ``P`` per leaf using ``rules`` (logical axis -> mesh axis,
    tuple/list of mesh axes, or None). Mesh axes of size 1 are dropped; a mesh axis is used at
    most once per tensor (the first dim that claims it wins).

        specs_from_rules({"w": ("embed", "mlp")}, {"mlp": "tp"}, {"tp": 2})  # {"w": P(None, 'tp')}
    """
    from shardfn.core.pytree import map_axes

    for logical, target in rules.items():
        for name in entry_axes(target):
            if name not in axis_sizes:
                raise ValueError(
                    f"rules.{logical}: unknown mesh axis {name!r}; the mesh has axes {tuple(axis_sizes)}"
                )

    def one(axes: tuple) -> P:
        used: set[str] = set()
        entries = []
        for logical in axes:
            names = [n for n in entry_axes(rules.get(logical)) if axis_sizes[n] > 1 and n not in used]
            used.update(names)
            entries.append(None if not names else (names[0] if len(names) == 1 else tuple(names)))
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    return map_axes(one, axes_tree)


def entry_axes(entry: Any) -> list[str]:
    """The mesh axes one entry of a ``P`` (or one logical-axis rule) names, major to minor.

    Example:
        entry_axes(None), entry_axes("tp"), entry_axes(("dp", "fsdp"))   # [], ['tp'], ['dp', 'fsdp']
    """
    if entry is None:
        return []
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, Iterable):
        return [str(t) for t in entry]
    raise TypeError(f"a rule maps to a mesh axis name, a list of names, or null; got {entry!r}")


def shard_shape(shape: Sequence[int], spec: P | None, axis_sizes: dict[str, int]) -> torch.Size:
    """Local (per-rank) shape of an evenly divisible tensor under ``spec``."""
    out = list(shape)
    for dim, entry in enumerate(spec or ()):
        for name in entry_axes(entry):
            out[dim] //= axis_sizes[name]
    return torch.Size(out)
