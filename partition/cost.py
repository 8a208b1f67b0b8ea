"""The auto-sharder's cost model: seconds per op, per redistribution, and bytes per rank.

Everything is per rank, from global fake shapes and DTensor placements (one per mesh dim):

- **compute** of an op under a strategy: ``FLOPs(local shapes) / peak + bytes moved / HBM
  bandwidth``. FLOPs come from ``torch.utils.flop_counter``'s registry evaluated on the local
  (per-rank) shapes, so a matmul split over ``n`` ranks costs ``1/n`` and one that is run
  redundantly on replicated inputs costs the full amount; a Partial input is a full-size local
  tensor. Views cost nothing.
- **transition** of a value from one placement to another: the collectives DTensor's
  ``redistribute`` issues, mesh dim by mesh dim, priced by the hardware's alpha-beta model.
  Reducing a partial sum (all-reduce, reduce-scatter) is *comm*; moving data between layouts
  (all-gather, all-to-all) is *reshard*. Replicate -> Shard is a local slice (free).
- **memory** of a value: its local bytes (a Partial value is full size).

A mesh dim is intra-node when the product of its size and every more-minor dim's size fits in
``hardware.gpus_per_node`` (the last mesh axes vary fastest, as in ``init_device_mesh``).

    model = CostModel(mesh.shape, load_hardware("h100"))
    model.transition(val, (Partial(),), (Replicate(),))   # Transition(comm_s=..., reshard_s=0.0, ...)
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardfn.core import _torch_private as private
from shardfn.partition.flops import op_flops
from shardfn.partition.fx import is_view
from shardfn.partition.hardware import Hardware

aten = torch.ops.aten

INFEASIBLE = math.inf


class Transition(NamedTuple):
    """The price of moving one value between placements; ``collectives`` lists
    ``(op, mesh_dim, bytes)`` in issue order."""

    comm_s: float
    reshard_s: float
    collectives: tuple

    @property
    def seconds(self) -> float:
        return self.comm_s + self.reshard_s


FREE = Transition(0.0, 0.0, ())


def local_shape(shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int]) -> list[int]:
    """Per-rank shape of an evenly divisible tensor under ``placements`` (a strided shard, which
    DTensor's redistribute may pass through, divides its dim like a shard)."""
    out = list(shape)
    for pl, size in zip(placements, mesh_shape):
        if isinstance(pl, Shard) or private.strided_shard(pl):
            out[pl.dim] //= size
    return out


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype not in _ITEMSIZE else _ITEMSIZE[dtype]


_ITEMSIZE = {
    torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8, torch.int64: 8,
    torch.int32: 4, torch.bool: 1, torch.uint8: 1, torch.int8: 1,
}


class CostModel:
    """Prices ops, transitions and memory for one mesh shape on one hardware profile.

    Args:
        mesh_shape: sizes of the mesh dims, major to minor.
        hardware: a :class:`~shardfn.partition.hardware.Hardware`.
        device_mesh: the ``DeviceMesh``; with it, a transition is priced step by step as
            DTensor's ``redistribute`` plans it (a dim split over two mesh dims is regathered when
            its order changes); without it, by the per-dim rule of :meth:`_transition_by_rule`.
        gathers_for_all_to_all: price Shard -> Shard as the all-gather DTensor issues instead of
            an all-to-all on a CPU (gloo) mesh.

    Example:
        model = CostModel((8, 8), load_hardware("h100"))
        model.intra_node     # (False, True): the minor axis of 8 stays inside a node
    """

    def __init__(self, mesh_shape: Sequence[int], hardware: Hardware, device_mesh=None,
                 gathers_for_all_to_all: bool = False):
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        self.hardware = hardware
        self.device_mesh = device_mesh
        self.gathers_for_all_to_all = gathers_for_all_to_all
        intra = []
        span = 1
        for size in reversed(self.mesh_shape):
            span *= size
            intra.append(span <= hardware.gpus_per_node)
        self.intra_node = tuple(reversed(intra))
        self._transitions: dict = {}

    # -- memory ------------------------------------------------------------------------------
    def local_bytes(self, val: torch.Tensor, placements) -> int:
        """Bytes one rank holds of ``val`` under ``placements``."""
        return nbytes(local_shape(val.shape, placements, self.mesh_shape), val.dtype)

    # -- compute -----------------------------------------------------------------------------
    def compute_time(self, op, args: tuple, kwargs: dict, out_val, in_placements: Sequence, out_placements) -> float:
        """Seconds for one rank to run ``op`` under one strategy.

        ``args``/``kwargs`` hold fake global tensors; ``in_placements`` gives the placements of
        each tensor among them in pytree order; ``out_placements`` those of the output (a tuple
        of them for multi-output ops).
        """
        if is_view(op):
            return 0.0
        flat, spec = private.tree_flatten((args, kwargs))
        it = iter(in_placements)
        moved = 0
        shapes = []
        dtype = None
        for x in flat:
            if isinstance(x, torch.Tensor):
                pl = next(it)
                shape = local_shape(x.shape, pl, self.mesh_shape)
                moved += nbytes(shape, x.dtype)
                dtype = dtype or x.dtype
                shapes.append(torch.Size(shape))
            else:
                shapes.append(x)
        largs, lkwargs = private.tree_unflatten(shapes, spec)
        outs = out_val if isinstance(out_val, (tuple, list)) else (out_val,)
        outs_pl = out_placements if isinstance(out_val, (tuple, list)) else (out_placements,)
        out_shapes = []
        for o, pl in zip(outs, outs_pl):
            if isinstance(o, torch.Tensor) and pl is not None:
                shape = local_shape(o.shape, pl, self.mesh_shape)
                moved += nbytes(shape, o.dtype)
                out_shapes.append(torch.Size(shape))
                dtype = dtype or o.dtype
            else:
                out_shapes.append(None)
        out_shape = out_shapes[0] if not isinstance(out_val, (tuple, list)) else tuple(out_shapes)
        flops = op_flops(op, largs, lkwargs, out_shape)
        peak = self.hardware.peak_flops(dtype or torch.float32)
        return flops / peak + moved / self.hardware.hbm_bandwidth

    # -- transitions -------------------------------------------------------------------------
    def collective(self, op: str, nbytes_: float, mesh_dim: int) -> float:
        return self.hardware.collective_time(op, nbytes_, self.mesh_shape[mesh_dim], self.intra_node[mesh_dim])

    def transition(self, val: torch.Tensor, src, dst) -> Transition:
        """The cost of redistributing ``val`` from placements ``src`` to ``dst``.

        With a device mesh, the steps are DTensor's own redistribute plan, each priced on what
        a rank holds at that step; without one, mesh dims are taken in the order that keeps
        buffers small (:meth:`_transition_by_rule`). Returns a Transition with infinite comm
        for a move nothing can lower: into a partial sum (DTensor's ``redistribute`` makes
        none) or between different kinds of partial sums.
        """
        src, dst = tuple(src), tuple(dst)
        if src == dst:
            return FREE
        key = (tuple(val.shape), val.dtype, src, dst)
        hit = self._transitions.get(key)
        if hit is None:
            hit = self._transitions[key] = self._transition(val, src, dst)
        return hit

    def _transition(self, val, src, dst) -> Transition:
        if any(isinstance(b, Partial) and a != b for a, b in zip(src, dst)):
            # DTensor's redistribute makes no partial sum (and none of another kind): nothing can
            # lower such a move, so a plan may not contain one
            return Transition(INFEASIBLE, 0.0, ())
        if self.device_mesh is None:
            return self._transition_by_rule(val, src, dst)
        comm = reshard = 0.0
        done = []
        now = list(src)
        for d, a, b in private.redistribute_steps(self.device_mesh, val.shape, val.dtype, src, dst):
            held = nbytes(local_shape(val.shape, now, self.mesh_shape), val.dtype)  # this rank's buffer now
            now[d] = b
            if a.is_partial():
                kind = "reduce_scatter" if b.is_shard() or private.strided_shard(b) else "all_reduce"
                comm += self.collective(kind, held, d)
                done.append((kind, d, held))
            elif a.is_replicate():
                continue  # R -> S: a local slice
            elif b.is_replicate() or self.gathers_for_all_to_all:  # S -> R, or S -> S on gloo
                gathered = held * self.mesh_shape[d]
                reshard += self.collective("all_gather", gathered, d)
                done.append(("all_gather", d, gathered))
            else:
                reshard += self.collective("all_to_all", held, d)
                done.append(("all_to_all", d, held))
        return Transition(comm, reshard, tuple(done))

    def _transition_by_rule(self, val, src, dst) -> Transition:
        """Without a device mesh: local slices and reduce-scatters first (major mesh dim
        first), then all-to-alls, all-reduces, and all-gathers last (minor mesh dim first: a dim
        split over several mesh dims is reassembled from the inside out, as DTensor does)."""
        shape = local_shape(val.shape, src, self.mesh_shape)
        steps = []  # (order, mesh_dim, kind)
        for d, (a, b) in enumerate(zip(src, dst)):
            if a == b or self.mesh_shape[d] == 1:
                continue
            if isinstance(a, Partial):
                steps.append(
                    (0 if isinstance(b, Shard) else 2, d, "reduce_scatter" if isinstance(b, Shard) else "all_reduce")
                )
            elif isinstance(a, Shard) and isinstance(b, Shard):
                steps.append((1, d, "all_to_all"))
            elif isinstance(a, Shard):
                steps.append((3, -d, "all_gather"))
            else:
                steps.append((0, d, "slice"))
        comm = reshard = 0.0
        done = []
        for _, d, kind in sorted(steps):
            d = abs(d)
            n = self.mesh_shape[d]
            size = nbytes(shape, val.dtype)
            a, b = src[d], dst[d]
            if kind == "slice":
                shape[b.dim] //= n
            elif kind == "reduce_scatter":
                comm += self.collective(kind, size, d)
                done.append((kind, d, size))
                shape[b.dim] //= n
            elif kind == "all_reduce":
                comm += self.collective(kind, size, d)
                done.append((kind, d, size))
            elif kind == "all_to_all":
                reshard += self.collective(kind, size, d)
                done.append((kind, d, size))
                shape[a.dim] *= n
                shape[b.dim] //= n
            else:  # all_gather
                shape[a.dim] *= n
                size = nbytes(shape, val.dtype)
                reshard += self.collective(kind, size, d)
                done.append((kind, d, size))
        return Transition(comm, reshard, tuple(done))


def replicated(ndim: int) -> tuple:
    return (Replicate(),) * ndim
