"""``local_map``: a manual per-rank region inside a partitioned function (JAX's ``shard_map``).

Inside the region, ``f`` sees this rank's *local* shards (as laid out by ``in_specs``) and may
call collectives itself (MoE dispatch does its all-to-alls here); its local outputs are
reassembled under ``out_specs``. In the traced graph the region is one opaque node (and one for
its backward, computed by autograd over ``f``), so propagation never looks inside.
On one device, and outside ``sf.jit``, ``local_map(f, ...)`` is simply ``f``.

    moe = sf.local_map(dispatch_and_compute, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
    y = moe(x, expert_weights)
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Protocol

import optree
import torch

from shardfn.core.custom_ops import register_autograd
from shardfn.core.registry import Registry
from shardfn.core.transforms import autograd_vjp
from shardfn.partition.constrain import tracing
from shardfn.partition.spec import broadcast_specs, entry_axes

_state = threading.local()


class Records(Protocol):
    """What a region that communicates by itself reports (an MoE exchange's all-to-alls): the
    program that runs it starts the records afresh each call and lists them in its comm report."""

    def reset(self) -> None: ...

    def rows(self, mesh) -> list[dict]: ...


@dataclass(eq=False)
class Region:
    fn: Callable
    in_specs: Any
    out_specs: Any
    bwd: Callable | None = None    # bwd(inputs, outputs, output_cotangents) -> input cotangents
    records: Records | None = None  # the collectives fn runs itself, recorded per call
    in_treedef: Any = None
    out_treedef: Any = None
    in_leaf_specs: list | None = None
    out_leaf_specs: list | None = None
    out_meta: list | None = None   # local output metadata, set when first traced
    flops: Callable | None = None  # flops(*args) at global shapes (partition.cost.flops.node_flops)

    def call_flat(self, flat_inputs: list) -> list:
        args = optree.tree_unflatten(self.in_treedef, list(flat_inputs))
        out = self.fn(*args)
        leaves, treedef = optree.tree_flatten(out, none_is_leaf=False)
        self.out_treedef = treedef
        if self.out_leaf_specs is None:
            self.out_leaf_specs = broadcast_specs(self.out_specs, out, what="local_map out_specs")
        return leaves


_regions = Registry("local_map region")


def region(rid: int) -> Region:
    """The region a ``shardfn::local_region`` node names (alive while its traced program is)."""
    return _regions[rid]


@contextlib.contextmanager
def collecting_regions():
    """Within this block, every region a trace calls is appended to the yielded list, so the
    traced program can own them (a region made inside the traced function is otherwise freed
    when that function returns).

        with collecting_regions() as regions:
            gm = make_fx(fn)(*args)
    """
    prev = getattr(_state, "regions", None)
    _state.regions = found = []
    try:
        yield found
    finally:
        _state.regions = prev


@contextlib.contextmanager
def mesh_scope(mesh):
    """Make ``mesh`` the one local_map regions use for shapes while tracing."""
    prev = getattr(_state, "mesh", None)
    _state.mesh = mesh
    try:
        yield
    finally:
        _state.mesh = prev


def current_mesh():
    return getattr(_state, "mesh", None)


def _scale(shape, spec, mesh, factor: int) -> list[int]:
    """Local -> global shape (factor=+1) or global -> local (factor=-1) under ``spec``."""
    out = list(shape)
    for dim, entry in enumerate(spec or ()):
        names = entry_axes(entry)
        for name in names:
            if name not in mesh.axes:
                raise ValueError(f"sf.local_map: unknown mesh axis {name!r} in {spec!r}; the mesh has axes "
                                 f"{tuple(mesh.axes)}")
            n = mesh.axes[name]
            out[dim] = out[dim] * n if factor > 0 else out[dim] // n
    return out


def _local_fakes(reg: Region, xs: list) -> list:
    mesh = current_mesh()
    return [
        torch.empty(_scale(x.shape, s, mesh, -1), dtype=x.dtype, device=x.device) for x, s in zip(xs, reg.in_leaf_specs)
    ]


@torch.library.custom_op("shardfn::local_region", mutates_args=())
def _local_region(xs: List[torch.Tensor], rid: int) -> List[torch.Tensor]:
    # Runs only for a one-device graph: global and local are the same there.
    return [o.clone() for o in region(rid).call_flat(xs)]


@_local_region.register_fake
def _(xs, rid):
    reg = region(rid)
    mesh = current_mesh()
    outs = reg.call_flat(_local_fakes(reg, xs)) if mesh is not None else reg.call_flat(xs)
    reg.out_meta = [(tuple(o.shape), o.dtype) for o in outs]
    if mesh is None:
        return [torch.empty_like(o) for o in outs]
    return [
        torch.empty(_scale(o.shape, s, mesh, +1), dtype=o.dtype, device=o.device)
        for o, s in zip(outs, reg.out_leaf_specs)
    ]


def vjp_flat(reg: Region, xs: list, outs: list, gs: list) -> list:
    """Input cotangents of the region at ``xs`` for output cotangents ``gs`` (zeros for
    integer inputs). Uses the region's own ``bwd`` when it has one, else plain autograd
    (``core.transforms.autograd_vjp``, which recomputes the region's forward)."""
    if reg.bwd is not None:
        args = optree.tree_unflatten(reg.in_treedef, list(xs))
        out_tree = optree.tree_unflatten(reg.out_treedef, list(outs))
        grads = reg.bwd(args, out_tree, optree.tree_unflatten(reg.out_treedef, list(gs)))
        flat = optree.tree_leaves(grads, none_is_leaf=True) if grads is not None else [None] * len(xs)
        if len(flat) != len(xs):
            raise ValueError(f"local_map bwd returned {len(flat)} cotangents for {len(xs)} inputs")
        return [torch.zeros_like(x) if g is None else g for g, x in zip(flat, xs)]
    diff = [i for i, x in enumerate(xs) if x.is_floating_point()]

    def f(*d):
        full = list(xs)
        for i, v in zip(diff, d):
            full[i] = v
        return reg.call_flat(full)

    grads = autograd_vjp(f, [xs[i] for i in diff], list(gs))
    result = [torch.zeros_like(x) for x in xs]
    for i, g in zip(diff, grads):
        result[i] = g
    return result


@torch.library.custom_op("shardfn::local_region_backward", mutates_args=())
def _local_region_backward(
    xs: List[torch.Tensor], outs: List[torch.Tensor], gs: List[torch.Tensor], rid: int
) -> List[torch.Tensor]:
    return vjp_flat(region(rid), list(xs), list(outs), list(gs))


@_local_region_backward.register_fake
def _(xs, outs, gs, rid):
    return [torch.empty_like(x) for x in xs]


def _region_setup(ctx, inputs, output):
    xs, rid = inputs
    ctx.rid = rid
    ctx.n_in = len(xs)
    ctx.save_for_backward(*xs, *output)
    ctx.mark_non_differentiable(*[o for o in output if not o.is_floating_point()])


def _region_backward(ctx, gs):
    saved = ctx.saved_tensors
    xs, outs = saved[: ctx.n_in], saved[ctx.n_in :]
    out_meta = region(ctx.rid).out_meta or []
    gs = [
        g if g is not None else torch.zeros(_out_shape(ctx.rid, i, xs), dtype=out_meta[i][1])
        for i, g in enumerate(gs)
    ]
    with torch.no_grad():
        grads = torch.ops.shardfn.local_region_backward(list(xs), list(outs), list(gs), ctx.rid)
    return [g if x.is_floating_point() else None for g, x in zip(grads, xs)], None


_local_region_fn = register_autograd(_local_region, _region_backward, setup_context=_region_setup)


def call_region(xs: list, rid: int) -> list:
    """``shardfn::local_region(xs, rid)`` made differentiable (``torch.autograd`` and ``torch.func``):
    what a pipeline stage's program calls, so its joint records the region and its backward.

        outs = call_region([x, w], rid)
    """
    return _local_region_fn(list(xs), rid)


def _out_shape(rid: int, i: int, xs) -> list[int]:
    reg = region(rid)
    shape = reg.out_meta[i][0]
    mesh = current_mesh()
    return list(shape) if mesh is None else _scale(shape, reg.out_leaf_specs[i], mesh, +1)


def local_map(fn: Callable, in_specs: Any, out_specs: Any, *, bwd: Callable | None = None,
              records: Records | None = None, flops: Callable | None = None) -> Callable:
    """A per-rank region: ``fn`` runs on local shards laid out by ``in_specs`` and its outputs
    are taken as shards under ``out_specs``.

    Args:
        fn: a function of pytrees of tensors, written for one rank's shards.
        in_specs: a ``P`` pytree, prefix of ``fn``'s arguments tuple.
        out_specs: a ``P`` pytree, prefix of ``fn``'s outputs.
        bwd: optional ``bwd(inputs, outputs, output_cotangents) -> input cotangents`` on local
            shards (None for no cotangent). Without it the backward is autograd's over ``fn``
            (``core.transforms.autograd_vjp``), which runs ``fn`` again; give ``bwd`` when
            ``fn`` communicates (an MoE exchange) or saves what its backward needs in its
            outputs.
        records: when ``fn`` (or ``bwd``) runs collectives itself, what it moved (a
            :class:`Records`): ``LoweredStep.comm_report`` lists its rows, and each call of the
            program starts them afresh.
        flops: ``flops(*args) -> float``, the forward FLOPs of one call at the arguments'
            global shapes, by which pipeline stages are balanced; without it the region counts
            as one per output element (its work is hidden in one node).

    Example:
        f = local_map(lambda x: x * 2, in_specs=(P("dp"),), out_specs=P("dp"))
        y = f(x)
    """
    reg = Region(fn, in_specs, out_specs, bwd, records, flops=flops)

    def wrapped(*args):
        if not tracing():
            return fn(*args)
        leaves, treedef = optree.tree_flatten(args, none_is_leaf=False)
        reg.in_treedef = treedef
        reg.in_leaf_specs = broadcast_specs(in_specs, args, what="local_map in_specs")
        rid = _regions.add(reg)
        found = getattr(_state, "regions", None)
        if found is not None and reg not in found:
            found.append(reg)
        outs = _local_region_fn(leaves, rid)
        return optree.tree_unflatten(reg.out_treedef, list(outs))

    wrapped.region = reg
    return wrapped
