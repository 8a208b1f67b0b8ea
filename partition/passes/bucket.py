"""Gradient bucketing: coalesce independent all-reduces and reduce-scatters into few large ones.

An after-lower pass on the per-rank program. Collectives of one kind, reduce op, process group
and dtype whose results nobody reads before the inputs of all of them exist (the gradient
reductions of a backward, typically) are grouped in program order into buckets of at most
``bucket_bytes``; each bucket becomes one collective on one flat buffer, issued right after the
last of its inputs is made (as DDP issues a bucket once its last gradient is ready):

- all-reduce: the tensors are flattened (in their memory order), concatenated, reduced once in
  place on that buffer (it is the bucket's own: the functional all-reduce would copy it first)
  and split back into views with the strides the program had; a stacked parameter's gradient,
  built by a ``stack`` of the layers' gradients that nothing else reads, enters the buffer as
  those layers' gradients (one copy, where the stack and the buffer made two);
- reduce-scatter (dim 0 over ``n`` ranks): each tensor is cut into its ``n`` row blocks, the
  blocks are interleaved so that rank ``r``'s block of every tensor lies in the ``r``-th
  contiguous chunk of the buffer, and rank ``r``'s chunk is split back into its shards.

The bytes moved are unchanged (same elements, same reduction); the number of collectives, and
with it the latency paid per collective, goes down. ``DEFAULT_BUCKET_BYTES`` is 25 MiB, the
default of PyTorch DDP's ``bucket_cap_mb``: large enough that each collective runs near link
bandwidth, small enough that the extra buffer per bucket stays a small part of a rank's memory.
Beyond that, collectives are not reordered; scheduling them against compute is a separate pass.

    gm = bucket_collectives(lowered.graph_module, 25 * 2**20)
    sf.jit(step, mesh, ..., bucket_bytes=25 * 2**20)      # the same, built into the step
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardfn.partition.passes import DEFAULT_BUCKET_BYTES
from shardfn.partition.spmd.fx import is_view, memory_order
from shardfn.partition.spmd.lower import collective_nodes

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
BUCKETED_KINDS = ("all_reduce", "reduce_scatter")


@dataclass
class _Member:
    collective: torch.fx.Node   # the functional collective
    wait: torch.fx.Node         # its wait_tensor
    nbytes: int
    ready: int                  # program position of the node that makes its input
    first_use: int              # program position of the first node that reads the result


@dataclass
class _Bucket:
    key: tuple
    members: list = field(default_factory=list)
    nbytes: int = 0
    ready: int = -1             # the latest input: the bucket is issued right after it
    first_use: int = 1 << 62


def bucket_pass(bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Callable[[torch.fx.GraphModule], torch.fx.GraphModule]:
    """The pass ``bucket_collectives(gm, bucket_bytes)`` for ``sf.jit(passes={"after_lower": [...]})``.

        step = sf.jit(fn, mesh, in_specs=..., passes={"after_lower": [bucket_pass(25 * 2**20)]})
    """
    check_bucket_bytes(bucket_bytes)

    def bucket(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return bucket_collectives(gm, bucket_bytes)

    bucket.__name__ = f"bucket_{bucket_bytes}"
    return bucket


def check_bucket_bytes(bucket_bytes) -> None:
    """Refuse a bucket size that is not a whole number of bytes >= 0 (0 turns bucketing off).

        check_bucket_bytes(25 * 2**20)   # fine
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be an int >= 0 (bytes per bucket; 0 or None: no bucketing), "
                         f"got {bucket_bytes!r}; DDP's default is 25 MiB = {DEFAULT_BUCKET_BYTES}")


def bucket_collectives(gm: torch.fx.GraphModule, bucket_bytes: int) -> torch.fx.GraphModule:
    """Coalesce ``gm``'s all-reduces and reduce-scatters into buckets of at most ``bucket_bytes``
    (in place; ``gm`` is returned). A collective larger than the cap is a bucket of its own.

        gm = bucket_collectives(gm, 25 * 2**20)
        report.comm_report(gm, mesh)   # same bytes, fewer rows counted
    """
    check_bucket_bytes(bucket_bytes)
    if not bucket_bytes:
        return gm
    buckets = plan_buckets(gm, bucket_bytes)
    for i, bucket in enumerate(buckets):
        _rewrite(gm.graph, bucket, i)
    if buckets:
        gm.graph.lint()
        gm.recompile()
    return gm


def plan_buckets(gm: torch.fx.GraphModule, bucket_bytes: int) -> list[_Bucket]:
    """The buckets of two or more collectives ``bucket_collectives`` would make, in program order.

        [len(b.members) for b in plan_buckets(gm, 25 * 2**20)]   # e.g. [38]
    """
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    open_: dict[tuple, _Bucket] = {}
    done: list[_Bucket] = []
    for node, kind in collective_nodes(gm):
        member = _member(node, kind, position)
        if member is None:
            continue
        key = _key(node, kind)
        bucket = open_.get(key)
        fits = bucket is not None and bucket.nbytes + member.nbytes <= bucket_bytes
        if not fits or max(bucket.ready, member.ready) >= min(bucket.first_use, member.first_use):
            if bucket is not None:
                done.append(bucket)
            bucket = open_[key] = _Bucket(key)
        bucket.members.append(member)
        bucket.nbytes += member.nbytes
        bucket.ready = max(bucket.ready, member.ready)
        bucket.first_use = min(bucket.first_use, member.first_use)
    done.extend(open_.values())
    done = [b for b in done if len(b.members) > 1]
    return sorted(done, key=lambda b: b.ready)


def _key(node: torch.fx.Node, kind: str) -> tuple:
    return (kind, *[a for a in node.args[1:]], node.args[0].meta["val"].dtype)


def _member(node: torch.fx.Node, kind: str, position: dict) -> _Member | None:
    """``node`` as a bucket member, or None where it cannot be one (its result not read through
    one wait, a layout that is not dense, a reduce-scatter whose rows do not split evenly)."""
    if kind not in BUCKETED_KINDS or len(node.users) != 1:
        return None
    (wait,) = node.users
    if wait.target is not _c10d.wait_tensor.default or not wait.users:
        return None
    inp, out = node.args[0].meta.get("val"), wait.meta.get("val")
    if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor) or inp.numel() == 0:
        return None
    if memory_order(out) is None:
        return None
    if kind == "reduce_scatter":
        ranks = node.args[2]
        if inp.ndim == 0 or inp.shape[0] % ranks or not out.is_contiguous():
            return None
    nbytes = inp.numel() * inp.element_size()
    return _Member(node, wait, nbytes, position[node.args[0]], min(position[u] for u in wait.users))


def _rewrite(graph: torch.fx.Graph, bucket: _Bucket, index: int) -> None:
    """Replace the bucket's collectives by one, issued as soon as its last input is made."""
    kind = bucket.key[0]
    latest = max((m.collective.args[0] for m in bucket.members), key=_order(graph).__getitem__)
    with graph.inserting_before(latest.next):
        if kind == "all_reduce":
            outs, coll, unstacked = _all_reduce_bucket(graph, bucket)
        else:
            (outs, coll), unstacked = _reduce_scatter_bucket(graph, bucket), []
    sources = [m.collective.meta.get("sf_source", "?") for m in bucket.members]
    coll.meta["sf_source"] = f"bucket{index}"
    coll.meta["sf_bucket"] = sources
    coll.meta["sf_bucket_bytes"] = [m.nbytes for m in bucket.members]
    for member, out in zip(bucket.members, outs):
        member.wait.replace_all_uses_with(out)
        graph.erase_node(member.wait)
        graph.erase_node(member.collective)
    for stack in unstacked:  # its pieces went into the buffer; the collective was its one reader
        graph.erase_node(stack)


def functional_collectives(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` (``gm`` itself where there is nothing to change) in which each bucket's
    in-place all-reduce is the functional ``all_reduce`` again, for ``torch.compile``: inductor
    refuses a custom op whose output aliases its input (``_c10d_functional.all_reduce_``), and
    lowers the functional op onto the buffer in place itself, the buffer being dead after it.

        compiled = torch.compile(functional_collectives(lowered.graph_module), backend="inductor")
        eager = lowered.graph_module                  # keeps the in-place all-reduce
    """
    if not any(n.target is _c10d.all_reduce_.default for n in gm.graph.nodes):
        return gm
    graph = copy.deepcopy(gm.graph)  # the nodes copied, their values (meta) shared
    for node in graph.nodes:
        if node.target is _c10d.all_reduce_.default:
            node.target = _c10d.all_reduce.default
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


def member_input(node: torch.fx.Node) -> torch.fx.Node:
    """The value that ``node``, an all-reduce bucket's output or a view of one, is the reduction
    of: the input of the collective the bucket replaced (the loss before its all-reduce, whose
    ancestors are the forward, where the bucket's are the whole backward); else ``node``.

        loss = member_input(outputs[i])   # what the step's loss output reduces
    """
    at = node
    while isinstance(at, torch.fx.Node):
        if "sf_bucket_input" in at.meta:
            return at.meta["sf_bucket_input"]
        if not (is_view(at) and at.args):
            break
        at = at.args[0]
    return node


def _order(graph: torch.fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _call(graph, target, args, val):
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def _all_reduce_bucket(graph, bucket):
    """The bucket's flat buffer reduced in place, and each member's result as a view of it;
    returns ``(outs, collective, unstacked)``: ``unstacked``, the stacks whose pieces went into
    the buffer directly (dead once the members' collectives are gone)."""
    flats, layouts, unstacked = [], [], []
    for m in bucket.members:
        inp, out = m.collective.args[0], m.wait.meta["val"]
        order = memory_order(out)
        permuted = [out.shape[d] for d in order]
        src = inp
        if order != list(range(out.ndim)):
            src = _call(graph, _aten.permute.default, (inp, order), _empty(permuted, out))
        pieces = [src]
        if src is inp and _is_stack_of(inp, m.collective):  # the layers' gradients, not their stack
            pieces = list(inp.args[0])
            unstacked.append(inp)
        size = out.numel() // len(pieces)
        flats.extend(_call(graph, _aten.reshape.default, (p, [-1]), _empty([size], out)) for p in pieces)
        layouts.append((order, permuted, out))
    total = sum(out.numel() for _, _, out in layouts)
    proto = layouts[0][2]
    buf = _call(graph, _aten.cat.default, (flats,), _empty([total], proto))
    # in place: the buffer is the cat's own, read by nothing else (the functional op would copy it)
    coll = _call(graph, _c10d.all_reduce_.default, (buf, *bucket.members[0].collective.args[1:]),
                 _empty([total], proto))
    done = _call(graph, _c10d.wait_tensor.default, (coll,), _empty([total], proto))
    parts = _split(graph, done, [out.numel() for _, _, out in layouts], proto)
    outs = []
    for m, part, (order, permuted, out) in zip(bucket.members, parts, layouts):
        view = _call(graph, _aten.view.default, (part, permuted), _empty(permuted, out))
        if order != list(range(out.ndim)):
            inverse = sorted(range(out.ndim), key=order.__getitem__)
            view = _call(graph, _aten.permute.default, (view, inverse), out)
        if m.collective.args[0] not in unstacked:  # (a stack goes, so member_input stops here)
            view.meta["sf_bucket_input"] = m.collective.args[0]
        outs.append(view)
    return outs, coll, unstacked


def _is_stack_of(node, collective) -> bool:
    """``node`` is a ``stack`` along dim 0 that only ``collective`` reads (a stacked
    parameter's gradient, built from the layers' own): its pieces can go into the bucket's
    buffer as they are, one copy where the stack and the buffer made two."""
    return (isinstance(node, torch.fx.Node) and node.target is _aten.stack.default
            and (len(node.args) < 2 or node.args[1] == 0) and list(node.users) == [collective])


def _reduce_scatter_bucket(graph, bucket):
    ranks = bucket.members[0].collective.args[2]
    blocks, shards = [], []
    for m in bucket.members:
        inp, out = m.collective.args[0], m.wait.meta["val"]
        per_rank = inp.meta["val"].numel() // ranks
        blocks.append(_call(graph, _aten.reshape.default, (inp, [ranks, per_rank]), _empty([ranks, per_rank], out)))
        shards.append((per_rank, out))
    proto = shards[0][1]
    width = sum(n for n, _ in shards)
    rows = _call(graph, _aten.cat.default, (blocks, 1), _empty([ranks, width], proto))
    buf = _call(graph, _aten.reshape.default, (rows, [-1]), _empty([ranks * width], proto))
    coll = _call(graph, _c10d.reduce_scatter_tensor.default, (buf, *bucket.members[0].collective.args[1:]),
                 _empty([width], proto))
    done = _call(graph, _c10d.wait_tensor.default, (coll,), _empty([width], proto))
    parts = _split(graph, done, [n for n, _ in shards], proto)
    outs = [_call(graph, _aten.view.default, (part, list(out.shape)), out) for part, (_, out) in zip(parts, shards)]
    return outs, coll


def _split(graph, flat, sizes, proto):
    pieces = [_empty([n], proto) for n in sizes]
    node = _call(graph, _aten.split_with_sizes.default, (flat, sizes), pieces)
    return [_call(graph, operator.getitem, (node, i), piece) for i, piece in enumerate(pieces)]


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """A stand-in value of ``shape`` in ``like``'s dtype, in ``like``'s fake mode when it has one."""
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return torch.empty(shape, dtype=like.dtype, device="meta")
    with mode:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
