"""The cost model: what kernels, collectives and bytes cost one rank on a hardware profile.

One model serves every estimate in shardfn. :class:`Rates` turns work into seconds from a
profile's datasheet peaks and its achieved-rate table (``partition.cost.hardware.efficiency``): a GEMM
at its shape's share of peak, other FLOPs at the sustained clock, streamed bytes at the HBM
bandwidth a kernel reaches, collectives by the ring alpha-beta model at NCCL's bus bandwidth. The
planner's traced step (``plan.estimate``), its GPU run model (``plan.runmodel``) and the
auto-sharder (:class:`CostModel` here) all price through it, so they differ only in what they
count, never in what a unit of work costs.

:class:`CostModel` is the auto-sharder's per-op view, everything per rank from global fake shapes
and DTensor placements (one per mesh dim):

- **compute** of an op under a strategy: its FLOPs on the local (per-rank) shapes
  (``torch.utils.flop_counter``'s registry; a GEMM at its local shape's share of peak) plus the
  bytes it reads and writes. A matmul split over ``n`` ranks costs ``1/n``; one run redundantly
  on replicated inputs costs the full amount; a Partial input is a full-size local tensor. Views
  cost nothing.
- **transition** of a value from one placement to another: the collectives DTensor's
  ``redistribute`` issues, mesh dim by mesh dim. Reducing a partial sum (all-reduce,
  reduce-scatter) is *comm*; moving data between layouts (all-gather, all-to-all) is *reshard*.
  Replicate -> Shard is a local slice (free).
- **memory** of a value: its local bytes (a Partial value is full size).

A mesh dim is intra-node when the product of its size and every more-minor dim's size fits in
``hardware.gpus_per_node`` (the last mesh axes vary fastest, as in ``init_device_mesh``).

    rates = Rates.of("h100"); rates.collective_s("all_gather", 1 << 30, 8, intra_node=True)
    CostModel(mesh.shape, rates.hardware).transition(val, (Partial(),), (Replicate(),))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardfn.core import _torch_private as private
from shardfn.partition.cost.flops import op_flops
from shardfn.partition.cost.hardware import DEFAULT_EFFICIENCY, Efficiency, Hardware, efficiency, load_hardware
from shardfn.partition.spmd.fx import is_view

aten = torch.ops.aten

INFEASIBLE = math.inf

GEMMS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
"""Ops priced at their GEMM shape's achieved share of peak (others at the sustained clock)."""


@dataclass(frozen=True)
class Rates:
    """Seconds for a unit of work on one device of a hardware profile: its datasheet peaks times
    the shares its kernels and links achieve (:class:`~shardfn.partition.cost.hardware.Efficiency`;
    a profile without a table runs at its peaks).

    Example:
        rates = Rates.of("h100")
        rates.gemm_s(8192, 4096, 4096, torch.bfloat16), rates.memory_s(1 << 30)
    """

    hardware: Hardware
    efficiency: Efficiency

    @classmethod
    def of(cls, hardware: "str | Hardware", *, achieved: bool = True) -> "Rates":
        """The rates of a profile (by name, path or :class:`Hardware`); ``achieved=False``: at its
        datasheet peaks (a lower bound on time)."""
        hw = load_hardware(hardware)
        return cls(hw, efficiency(hw) if achieved else DEFAULT_EFFICIENCY)

    def peak(self, dtype: torch.dtype) -> float:
        """Datasheet peak FLOP/s for ``dtype`` (what MFU divides by)."""
        return self.hardware.peak_flops(dtype)

    def gemm_s(self, m: float, n: float, k: float, dtype: torch.dtype, flops: float | None = None) -> float:
        """An ``[m, k] @ [k, n]`` GEMM (``flops`` defaults to ``2 m n k``) at its shape's share."""
        flops = 2.0 * m * n * k if flops is None else flops
        share = self.efficiency.matmul_share(m, n, k)
        return flops / (self.peak(dtype) * self.efficiency.clock * share)

    def flops_s(self, flops: float, dtype: torch.dtype) -> float:
        """FLOPs of a kernel whose shape is not known, at the sustained clock."""
        return flops / (self.peak(dtype) * self.efficiency.clock)

    def attention_s(self, flops: float, dtype: torch.dtype) -> float:
        """A flash-attention kernel's FLOPs (causal counted as half the square)."""
        return flops / (self.peak(dtype) * self.efficiency.clock * self.efficiency.attention)

    def memory_s(self, nbytes: float) -> float:
        """Bytes a memory-bound kernel streams through HBM."""
        return nbytes / (self.hardware.hbm_bandwidth * self.efficiency.hbm)

    @functools.cached_property
    def links(self) -> Hardware:
        """The profile with its link bandwidths at the bus bandwidth NCCL reaches (made once)."""
        hw, eff = self.hardware, self.efficiency
        return dataclasses.replace(hw, intra_node_bandwidth=hw.intra_node_bandwidth * eff.intra_bus,
                                   inter_node_bandwidth=hw.inter_node_bandwidth * eff.inter_bus)

    def collective_s(self, op: str, nbytes: float, group: int, intra_node: bool) -> float:
        """One collective (sizes as :meth:`Hardware.collective_time`) at the bus bandwidth NCCL
        reaches."""
        return self.links.collective_time(op, nbytes, group, intra_node)

    def all_to_all_s(self, nbytes: float, group: int, intra_node: bool) -> float:
        """An all-to-all of ``nbytes`` per rank under uniform routing: the share bound for other
        nodes crosses the NIC, the rest NVLink, at the same time."""
        if group <= 1:
            return 0.0
        if intra_node:
            return self.collective_s("all_to_all", nbytes, group, intra_node)
        links = self.links
        off_node = nbytes * (1 - links.gpus_per_node / group)
        on_node = nbytes * (links.gpus_per_node - 1) / group
        return (max(off_node / links.inter_node_bandwidth, on_node / links.intra_node_bandwidth)
                + (group - 1) * links.inter_node_latency)

    def p2p_s(self, nbytes: float, intra_node: bool) -> float:
        """One point-to-point send of ``nbytes`` (a pipeline stage's activations)."""
        if nbytes <= 0:
            return 0.0
        bw, alpha = self.links.link(intra_node)
        return nbytes / bw + alpha


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


def intra_node_dims(sizes: Sequence[int], gpus_per_node: int) -> tuple[bool, ...]:
    """Per mesh dim, major to minor: does its group stay inside one node? It does when its size
    times every more-minor dim's size fits in ``gpus_per_node`` (minor dims vary fastest).

        intra_node_dims((4, 8), 8)   # (False, True)
    """
    out, span = [], 1
    for size in reversed(sizes):
        span *= size
        out.append(span <= gpus_per_node)
    return tuple(reversed(out))


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
        hardware: a :class:`~shardfn.partition.cost.hardware.Hardware`, priced by its :class:`Rates`.
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
        self.rates = Rates.of(hardware)
        self.hardware = self.rates.hardware
        self.device_mesh = device_mesh
        self.gathers_for_all_to_all = gathers_for_all_to_all
        self.intra_node = intra_node_dims(self.mesh_shape, self.hardware.gpus_per_node)
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
        dtype = dtype or torch.float32
        if op in GEMMS and flops:
            *_, m, k = largs[-2] if op in (aten.addmm.default, aten.baddbmm.default) else largs[0]
            n = largs[-1][-1]
            seconds = self.rates.gemm_s(m, n, k, dtype, flops)
        else:
            seconds = self.rates.flops_s(flops, dtype)
        return seconds + self.rates.memory_s(moved)

    # -- transitions -------------------------------------------------------------------------
    def collective(self, op: str, nbytes_: float, mesh_dim: int) -> float:
        return self.rates.collective_s(op, nbytes_, self.mesh_shape[mesh_dim], self.intra_node[mesh_dim])

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
