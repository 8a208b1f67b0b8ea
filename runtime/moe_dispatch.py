"""Expert-parallel MoE dispatch and combine: the all-to-all exchanges, run by the runtime.

How many tokens each rank sends each expert is known only once the router has run, so the
exchange cannot live in a statically shaped compiled graph. It runs here, eagerly, behind one
opaque op whose output shape is static (``[T, D]``, like its input): the compiled program calls
it, and it

1. sorts this rank's ``T * top_k`` assignments by expert and counts them,
2. exchanges the per-expert counts (one small all-to-all),
3. moves the tokens to the ranks that hold their experts (``all_to_all_single``, uneven splits),
4. runs the local experts on them with one grouped GEMM per projection,
5. sends the results back, weights them by the router scores and sums over top-k.

Its backward (another op) sends output cotangents the same way and input cotangents back: two
token all-to-alls each way. What the backward needs is kept in this process between the two
ops, keyed by a handle tensor that the forward returns, so nothing is exchanged twice: the
experts' inputs and their two pre-activations (``xs @ w1``, ``xs @ w3``; the shared experts'
likewise), so the backward runs none of the forward's GEMMs again, as autograd would not. Its
bytes are in the program's ``memory_report``: the handle the forward returns and the backward
takes is a stand-in of that size (:func:`kept_bytes`). The
shared experts are computed while the first exchange is in flight (``async_op=True``). Every
wait on an exchange is a ``runtime.interleave.handoff``: in DualPipeV's overlapped pairs the
other member of the pair computes while it is in flight.

Each exchange belongs to an :class:`Exchange`, which records the bytes every call moved (what
leaves the rank; tokens that stay on-rank move nothing) and keeps what the backward needs. The
program that runs it owns it: a lowered step starts its records afresh at each call and lists
them in its ``comm_report`` (``sf.local_map(..., records=exchange)``).

    routed = ExpertRegion(mesh, ("dp", "ep"), "ep", n_experts)
    y = routed(x, idx, weights, w1, w2, w3)                  # inside a traced function
    routed.exchange.stats    # [{"layer", "phase", "bytes", "tokens", "dropped", "group"}, ...]
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardfn.core.expert_ffn import SWIGLU, ExpertFFN, _silu_mul_backward, ffn_from
from shardfn.core.registry import Registry
from shardfn.runtime.interleave import handoff


@dataclass
class _Saved:
    """What one chunk of a layer's tokens keeps for the backward."""

    rows: slice                # the chunk's tokens among the rank's [T] (the layer's whole range unchunked)
    tok: torch.Tensor          # [A] int64: source token (within the chunk) of each kept assignment, expert-sorted
    keep_pos: torch.Tensor     # [A] int64: flat assignment index (t * k + j) of each kept one
    in_splits: list[int]       # rows sent to each rank
    out_splits: list[int]      # rows received from each rank
    perm: torch.Tensor         # [R] received row -> expert-major row
    offs: torch.Tensor         # [E_local] int32 cumulative rows per local expert
    xs: torch.Tensor           # [R, D] expert inputs, expert-major
    kept: tuple                # what the experts' FFN keeps for its backward (SwiGLU: xs @ w1, xs @ w3)
    y_assign: torch.Tensor     # [t * k, D] expert output per assignment (0 where dropped)


@dataclass
class _Layer:
    """What one layer call keeps for its backward: its chunks, and the shared experts' input."""

    x_shape: tuple
    chunks: list
    weights: torch.Tensor      # [T, k]
    group: object
    layer: int
    x: torch.Tensor | None = None   # [T, D] kept for the shared experts' backward
    a1: torch.Tensor | None = None  # [T, Hs] x @ s1 (before the SiLU)
    a3: torch.Tensor | None = None  # [T, Hs] x @ s3


class Exchange:
    """The records of one family of expert-parallel exchanges (the MoE layers of one program),
    and what each forward keeps for its backward, by handle.

    ``stats`` has one row per token exchange since :meth:`reset`; layers are numbered in call
    order from 0 again after each reset (one training step).

        ex = Exchange(); ex.reset(); ...; ex.rows(mesh)   # comm-report rows, one per MoE layer
    """

    def __init__(self):
        self.stats: list[dict] = []
        self.saved: dict[int, _Saved] = {}
        self._handles = itertools.count(1)
        self._layers = itertools.count()

    def reset(self) -> None:
        """Start a new step: forget recorded exchanges and number layers from 0 again."""
        self.stats.clear()
        self._layers = itertools.count()

    def next_layer(self) -> int:
        return next(self._layers)

    def keep(self, saved: "_Saved") -> int:
        handle = next(self._handles)
        self.saved[handle] = saved
        return handle

    def rows(self, mesh) -> list[dict]:
        """The recorded exchanges as comm-report rows, one per MoE layer call:
        ``{op: "all_to_all", axis, layer, bytes, count}`` (four token exchanges a layer a step)."""
        rows: dict[tuple, dict] = {}
        for s in self.stats:
            key = (mesh.axis_of_group(s["group"]), s["layer"])
            row = rows.setdefault(key, {"op": "all_to_all", "axis": key[0], "layer": key[1], "bytes": 0, "count": 0})
            row["bytes"] += s["bytes"]
            row["count"] += 1
        return list(rows.values())

    def _record(self, layer, phase, x, in_splits, me, group, **extra) -> None:
        row_bytes = x[0].numel() * x.element_size() if x.shape[0] else x.shape[-1] * x.element_size()
        off_rank = sum(n for r, n in enumerate(in_splits) if r != me)
        self.stats.append({"layer": layer, "phase": phase, "bytes": off_rank * row_bytes, "tokens": sum(in_splits),
                           "group": group.group_name, **extra})


_exchanges = Registry("expert exchange")


def _swiglu(x, w1, w2, w3):
    """The shared experts' SwiGLU: ``(y [T, D], a1, a3)``, the pre-activations kept for the backward."""
    a1, a3 = x @ w1, x @ w3                                  # [T, Hs]
    return (F.silu(a1) * a3) @ w2, a1, a3


def _swiglu_backward(g, x, a1, a3, w1, w2, w3):
    """``(dx, dw1, dw2, dw3)`` of :func:`_swiglu` for ``g [T, D]`` from what its forward kept
    (``x``, ``a1``, ``a3``): no matmul of the forward again. Bitwise autograd's."""
    dh = g @ w2.t()                                          # [T, Hs]
    h, da1, da3 = _silu_mul_backward(dh, a1, a3)
    return da1 @ w1.t() + da3 @ w3.t(), x.t() @ da1, h.t() @ g, x.t() @ da3


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, *, async_op=False):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=async_op)
    return (out, work) if async_op else out


def _wait(work) -> None:
    """Wait on an issued exchange; in an overlapped pair, the other member computes meanwhile."""
    with handoff():
        work.wait()


def _route(x, idx, n_experts: int, capacity_factor: float, group):
    """This rank's assignments sorted by expert (capacity applied) and the exchange's splits:
    ``(order, tok, send, in_splits, out_splits, recv_counts, dropped)``; the per-expert counts
    are exchanged here (one small all-to-all)."""
    T, k = idx.shape
    n = dist.get_world_size(group)
    e_local = n_experts // n
    flat_e = idx.reshape(-1)
    order = torch.argsort(flat_e, stable=True)                   # [T*k] assignments by expert
    counts = torch.bincount(flat_e, minlength=n_experts)         # [E]
    dropped = 0
    if capacity_factor > 0:
        cap = max(1, int(capacity_factor * T * k / n_experts + 0.999999))
        sorted_e = flat_e[order]
        start = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(order.numel()) - start[sorted_e]
        keep = rank_in_expert < cap
        dropped = int((~keep).sum())
        order = order[keep]
        counts = torch.clamp(counts, max=cap)
    tok = order // k
    send = x[tok]                                                # [A, D] grouped by dest rank
    in_splits = counts.view(n, e_local).sum(1).tolist()
    recv_counts = torch.empty_like(counts)
    work = dist.all_to_all_single(recv_counts, counts, group=group, async_op=True)  # [n*E_local]: from s for my e
    _wait(work)
    recv_counts = recv_counts.view(n, e_local)
    return order, tok, send, in_splits, recv_counts.sum(1).tolist(), recv_counts, dropped


def _chunk_rows(T: int, chunks: int) -> list[slice]:
    """``chunks`` contiguous ranges of ``T`` tokens (as equal as they come; empty ones left out)."""
    bounds = [T * c // chunks for c in range(chunks + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a] or [slice(0, T)]


def ep_forward(x, idx, weights, expert_weights, group, n_experts: int, capacity_factor: float = 0.0,
               shared=None, *, exchange: Exchange, chunks: int = 1, ffn: ExpertFFN = SWIGLU):
    """Eager EP forward on this rank's tokens, recorded in ``exchange``: the local experts
    (``expert_weights``, this rank's ``[E_local, ...]`` slices) through ``ffn``. Returns
    ``(y [T, D], handle, dropped)``.

    The shared experts run while the dispatch is in flight. With ``chunks > 1`` the tokens are
    cut into that many groups, each routed and exchanged on its own: every dispatch is issued at
    once, and while a later chunk's tokens are still travelling the experts run on an earlier
    chunk's, whose combine then travels behind the next chunk's expert compute (capacity, if
    any, applies per chunk)."""
    T, D = x.shape
    k = idx.shape[1]
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    e_local = n_experts // n
    layer = exchange.next_layer()
    parts, dropped = [], 0
    for rows in _chunk_rows(T, chunks):
        order, tok, send, in_splits, out_splits, recv_counts, d = _route(
            x[rows], idx[rows], n_experts, capacity_factor, group)
        dropped += d
        parts.append([rows, order, tok, send, in_splits, out_splits, recv_counts])
        exchange._record(layer, "dispatch", send, in_splits, me, group, assignments=(rows.stop - rows.start) * k,
                         dropped=d)
    pending = [_a2a(send, out_splits, in_splits, group, async_op=True)
               for rows, order, tok, send, in_splits, out_splits, recv_counts in parts]
    y_shared, a1, a3 = _swiglu(x, *shared) if shared is not None else (None, None, None)  # overlaps the exchange
    combines, saved = [], []
    for (rows, order, tok, send, in_splits, out_splits, recv_counts), (recv, work) in zip(parts, pending):
        _wait(work)
        expert_of_row = torch.arange(e_local).repeat(n).repeat_interleave(recv_counts.reshape(-1))
        perm = torch.argsort(expert_of_row, stable=True)         # received -> expert-major
        offs = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)
        xs = recv[perm]
        out, kept = ffn.forward(xs, offs, *expert_weights)       # overlaps the earlier chunks' combines
        back_src = torch.empty_like(out)
        back_src[perm] = out
        exchange._record(layer, "combine", back_src, out_splits, me, group)
        combines.append(_a2a(back_src, in_splits, out_splits, group, async_op=True))
        saved.append([rows, tok, order, in_splits, out_splits, perm, offs, xs, kept])
    y_assign = x.new_zeros((T * k, D))
    for (back, work), (rows, tok, order, *rest) in zip(combines, saved):
        _wait(work)
        part = y_assign[rows.start * k:rows.stop * k]            # [A, D] back in `order` order
        part[order] = back
    y = (y_assign.view(T, k, D) * weights.unsqueeze(-1)).sum(1)
    if y_shared is not None:
        y = y + y_shared
    chunk_saved = [_Saved(rows, tok, order, in_splits, out_splits, perm, offs, xs, kept,
                          y_assign[rows.start * k:rows.stop * k])
                   for rows, tok, order, in_splits, out_splits, perm, offs, xs, kept in saved]
    handle = exchange.keep(_Layer((T, D), chunk_saved, weights, group, layer, x if shared is not None else None,
                                  a1, a3))
    return y, handle, dropped


def ep_backward(handle: int, grad_y, expert_weights, shared=None, *, exchange: Exchange, ffn: ExpertFFN = SWIGLU):
    """Cotangents ``(dx, dweights, *d_expert_weights[, ds1, ds2, ds3])`` of ``ep_forward``, chunk by
    chunk as the forward ran: every output cotangent sent at once, the shared experts'
    backward behind them, each chunk's expert backward behind the later chunks' exchanges."""
    s = exchange.saved.pop(handle)
    T, D = s.x_shape
    k = s.weights.shape[1]
    me = dist.get_rank(s.group)
    d_assign = (grad_y.unsqueeze(1) * s.weights.unsqueeze(-1)).reshape(T * k, D)
    y_assign = torch.cat([c.y_assign for c in s.chunks]) if len(s.chunks) > 1 else s.chunks[0].y_assign
    dweights = (y_assign.view(T, k, D) * grad_y.unsqueeze(1)).sum(-1)
    pending = []
    for c in s.chunks:
        d_send = d_assign[c.rows.start * k:c.rows.stop * k][c.keep_pos]
        exchange._record(s.layer, "dispatch_grad", d_send, c.in_splits, me, s.group)
        pending.append(_a2a(d_send, c.out_splits, c.in_splits, s.group, async_op=True))
    shared_grads = None
    if shared is not None:  # overlaps the exchange
        shared_grads = _swiglu_backward(grad_y, s.x, s.a1, s.a3, *shared)
    dw, combines = None, []
    for c, (d_recv, work) in zip(s.chunks, pending):
        _wait(work)
        d_out = d_recv[c.perm]
        dxs, *dw_c = ffn.backward(d_out, c.xs, c.kept, c.offs, *expert_weights)
        dw = dw_c if dw is None else [a + b for a, b in zip(dw, dw_c)]
        d_back = torch.empty_like(dxs)
        d_back[c.perm] = dxs
        exchange._record(s.layer, "combine_grad", d_back, c.out_splits, me, s.group)
        combines.append(_a2a(d_back, c.in_splits, c.out_splits, s.group, async_op=True))
    dx = torch.zeros((T, D), dtype=grad_y.dtype)
    for c, (d_src, work) in zip(s.chunks, combines):
        _wait(work)
        dx.index_add_(0, c.tok + c.rows.start, d_src)
    if shared_grads is None:
        return (dx, dweights, *dw)
    dxs_shared, ds1, ds2, ds3 = shared_grads
    return dx + dxs_shared, dweights, *dw, ds1, ds2, ds3


# --- the two opaque ops the compiled per-rank program calls -------------------------------


@torch.library.custom_op("shardfn::ep_experts", mutates_args=())
def _ep_experts(
    x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, expert_weights: List[torch.Tensor],
    shared: List[torch.Tensor], group_name: str, n_experts: int, capacity_factor: float, exchange: int,
    chunks: int, ffn: str, ffn_args: List[float],
) -> List[torch.Tensor]:
    kind = ffn_from(ffn, ffn_args)
    y, handle, dropped = ep_forward(x, idx, weights, expert_weights, _group(group_name), n_experts, capacity_factor,
                                    shared or None, exchange=_exchanges[exchange], chunks=chunks, ffn=kind)
    return [y, _handle_tensor(handle, x, idx, expert_weights[0], shared[0] if shared else None, kind)]


@_ep_experts.register_fake
def _(x, idx, weights, expert_weights, shared, group_name, n_experts, capacity_factor, exchange, chunks, ffn,
      ffn_args):
    return [torch.empty_like(x),
            _handle_tensor(0, x, idx, expert_weights[0], shared[0] if shared else None, ffn_from(ffn, ffn_args))]


def kept_bytes(x, idx, w1, shared_w1=None, ffn: ExpertFFN = SWIGLU) -> int:
    """Bytes one rank's exchange keeps from its forward for its backward (shapes or tensors:
    ``x [T, D]``, ``idx [T, k]``, ``w1 [E_local, D, F]`` the experts' first weight,
    ``shared_w1 [D, Hs]``), as if its experts received an even share of the assignments
    (``T * k`` rows, dropless): the experts' inputs and per-assignment outputs ``[T*k, D]`` each,
    the pre-activations ``ffn`` keeps (SwiGLU: two ``[T*k, F]``), the routing's three int64
    indices per row, and with shared experts their input ``[T, D]`` and pre-activations
    ``[T, Hs]`` two.

        kept_bytes((512, 256), (512, 2), (4, 256, 256), (256, 256))   # 512 * (2*(2*256 + 2*256) + 3*2 + 768)
    """
    shape = lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)  # noqa: E731
    (T, D), (_, k) = shape(x), shape(idx)
    size = x.element_size() if isinstance(x, torch.Tensor) else 4
    kept = T * k * (2 * D + ffn.kept_width(w1)) * size + T * k * 3 * 8
    if shared_w1 is not None:
        kept += T * (D + 2 * shape(shared_w1)[1]) * size
    return kept


def _handle_tensor(handle: int, x, idx, w1, s1, ffn: ExpertFFN) -> torch.Tensor:
    """The forward's second output: its handle, as an int64 tensor of :func:`kept_bytes` (one
    element stored, the rest a stride-0 view of it). The backward takes it, so the program holds
    it from forward to backward, and ``memory_report`` counts those bytes where the exchange
    keeps them in this process."""
    n = max(1, -(-kept_bytes(x, idx, w1, s1, ffn) // 8))
    return torch.full((1,), handle, dtype=torch.int64, device=x.device).expand(n)


@torch.library.custom_op("shardfn::ep_experts_backward", mutates_args=())
def _ep_experts_backward(
    handle: torch.Tensor, grad_y: torch.Tensor, weights: torch.Tensor, expert_weights: List[torch.Tensor],
    shared: List[torch.Tensor], exchange: int, ffn: str, ffn_args: List[float],
) -> List[torch.Tensor]:
    return list(ep_backward(int(handle[0]), grad_y, expert_weights, shared or None, exchange=_exchanges[exchange],
                            ffn=ffn_from(ffn, ffn_args)))


@_ep_experts_backward.register_fake
def _(handle, grad_y, weights, expert_weights, shared, exchange, ffn, ffn_args):
    return [torch.empty_like(t) for t in (grad_y, weights, *expert_weights, *shared)]


def register_exchange(exchange: Exchange) -> int:
    """The id the exchange ops take for ``exchange`` (held weakly: its owner keeps it alive)."""
    return _exchanges.add(exchange)


def _group(name: str):
    from shardfn.core._torch_private import resolve_group

    return resolve_group(name)


# --- the per-rank region the partitioned MoE layer calls -----------------------------------


def _token_spec(data_axes: tuple[str, ...]):
    from shardfn.partition.spec import P

    return P(tuple(data_axes)) if len(data_axes) > 1 else P(data_axes[0])


class ExpertRegion:
    """``routed(x, idx, weights, *expert_weights[, s1, s2, s3], ffn=SWIGLU) -> y`` as an
    ``sf.local_map`` region.

    Tokens (``x [T, D]``, ``idx``/``weights [T, k]``) are split over ``data_axes`` (which include
    ``ep_axis``); routed-expert weights ``[E, ...]`` (``ffn.n_weights`` of them: SwiGLU's
    ``w1, w2, w3``, gpt-oss's ``w13, b13, w2, b2``; ``core.expert_ffn``) over ``ep_axis``. With
    ``shared``, the shared experts' SwiGLU weights ``s1 [D, Hs], s2 [Hs, D], s3 [D, Hs]`` come
    last and their output is added, computed while the dispatch exchange is in flight. The
    exchange runs in the runtime (``ep_forward``/``ep_backward``), once forward and once
    backward; :attr:`exchange` records it, and :attr:`takes_shared` tells the model layer to
    hand the shared experts over. ``chunks``: the tokens are exchanged in that many groups, one's
    exchange behind another's expert compute (``partition.ep_chunks``).

        routed = ExpertRegion(mesh, ("ep",), "ep", 8)
        y = routed(x, idx, weights, w1, w2, w3)
    """

    def __init__(self, mesh, data_axes: tuple[str, ...], ep_axis: str, n_experts: int,
                 capacity_factor: float = 0.0, shared: bool = False, chunks: int = 1):
        from shardfn.partition.layouts.axes import check_divides

        check_divides([ep_axis], mesh.axes, "n_experts", n_experts)
        self._group_name = mesh.device_mesh.get_group(ep_axis).group_name
        self._tokens, self._ep_axis = _token_spec(data_axes), ep_axis
        self._n_experts, self._capacity_factor, self._chunks = n_experts, capacity_factor, chunks
        self.exchange = Exchange()
        self.takes_shared = shared
        self._exchange_id = register_exchange(self.exchange)
        self._regions: dict = {}

    def _region(self, ffn: ExpertFFN, with_shared: bool):
        from shardfn.partition.local_map import local_map
        from shardfn.partition.spec import P

        n, exchange, ffn_args = ffn.n_weights, self._exchange_id, ffn.args()

        def forward(x, idx, weights, *ws):
            return tuple(torch.ops.shardfn.ep_experts(
                x, idx, weights, list(ws[:n]), list(ws[n:]), self._group_name, self._n_experts,
                self._capacity_factor, exchange, self._chunks, ffn.name, ffn_args))

        def backward(inputs, outputs, cotangents):
            x, idx, weights, *ws = inputs
            dx, dweights, *dw = torch.ops.shardfn.ep_experts_backward(
                outputs[1], cotangents[0], weights, list(ws[:n]), list(ws[n:]), exchange, ffn.name, ffn_args)
            return (dx, None, dweights, *dw)

        tokens = self._tokens
        in_specs = (tokens, tokens, tokens) + (P(self._ep_axis),) * n + ((P(), P(), P()) if with_shared else ())
        return local_map(forward, in_specs=in_specs, out_specs=(tokens, tokens), bwd=backward,
                         records=self.exchange, flops=_region_flops(ffn))

    def __call__(self, x, idx, weights, *ws, ffn: ExpertFFN = SWIGLU):
        if len(ws) not in (ffn.n_weights, ffn.n_weights + 3) or (len(ws) > ffn.n_weights and not self.takes_shared):
            raise TypeError(f"the expert-parallel region takes {ffn.n_weights} expert weights for {ffn!r}"
                            f"{' and optionally 3 shared-expert weights' if self.takes_shared else ''}; got {len(ws)}")
        key = (ffn, len(ws) > ffn.n_weights)
        if key not in self._regions:
            self._regions[key] = self._region(*key)
        return self._regions[key](x, idx, weights, *ws)[0]


def _region_flops(ffn: ExpertFFN):
    def flops(x, idx, weights, *ws) -> float:
        from shardfn.partition.cost.flops import expert_flops

        shared = ws[ffn.n_weights:]
        return expert_flops(x, idx, ws[0], shared[0] if shared else None, ffn=ffn)
    return flops


def data_parallel_region(data_axes: tuple[str, ...]):
    """The one-device routed experts (``core.moe.routed_experts``) on each rank's own tokens,
    with every expert whole on every rank (gathered for use when stored sharded):
    ``routed(x, idx, weights, *expert_weights, ffn=SWIGLU)``."""
    from shardfn.core import moe
    from shardfn.partition.local_map import local_map
    from shardfn.partition.spec import P

    tokens, regions = _token_spec(data_axes), {}

    def routed(x, idx, weights, *ws, ffn: ExpertFFN = SWIGLU):
        key = (ffn, len(ws))
        if key not in regions:
            fn = functools.partial(moe.routed_experts, ffn=ffn)
            regions[key] = local_map(fn, in_specs=(tokens, tokens, tokens) + (P(),) * len(ws), out_specs=tokens,
                                     flops=_region_flops(ffn))
        return regions[key](x, idx, weights, *ws)
    return routed


# --- the exchanges a lowered program will run, before it runs ------------------------------

EXCHANGES_PER_LAYER = 4
"""Token all-to-alls of one MoE layer call per chunk and step: dispatch and combine forward, and
their cotangents backward."""


def planned_rows(gm: torch.fx.GraphModule, mesh) -> list[dict]:
    """The all-to-alls a lowered per-rank program's MoE layers will run, per step, as comm-report
    rows (the runtime runs them, so the program's own collectives leave them out): for each
    exchange axis, ``{op: "all_to_all", axis, what: "moe tokens", bytes, count}`` -- four token
    exchanges a layer and chunk, each moving the ``(n-1)/n`` of the rank's ``T * top_k``
    assignment rows that leave it when routing is uniform and nothing is dropped -- and
    ``{..., what: "moe counts", ...}``, the tokens per expert exchanged once a layer and chunk
    (``E / n`` int64 to each other rank, exactly). Token bytes are an estimate: the real ones
    depend on routing, and appear in ``comm_report`` after a step has run.

        planned_rows(lowered.graph_module, lowered.mesh)
        # [{"op": "all_to_all", "axis": "ep", "what": "moe tokens", "bytes": 1048576, "count": 8}, ...]
    """
    rows: dict[tuple[str, str], dict] = {}

    def add(axis, what, nbytes, count):
        row = rows.setdefault((axis, what), {"op": "all_to_all", "axis": axis, "what": what, "bytes": 0, "count": 0})
        row["bytes"] += nbytes
        row["count"] += count

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.shardfn.ep_experts.default:
            continue
        x, idx = (a.meta["val"] for a in node.args[:2])
        group_name, n_experts, chunks = node.args[5], node.args[6], node.args[9]
        axis = mesh.axis_of_group(group_name)
        n = mesh.axes[axis]
        (T, D), k = x.shape, idx.shape[1]
        n_chunks = len(_chunk_rows(T, chunks))
        off_rank_rows = T * k * (n - 1) // n
        add(axis, "moe tokens", EXCHANGES_PER_LAYER * off_rank_rows * D * x.element_size(),
            EXCHANGES_PER_LAYER * n_chunks)
        add(axis, "moe counts", n_chunks * (n_experts // n) * (n - 1) * 8, n_chunks)
    return list(rows.values())
