"""Propagate: give every node of the global graph DTensor placements.

Each node runs on DTensors, so torch's own DTensor op strategies choose its placements (the
cheapest strategy for the inputs it is given). Three policies sit on top:

1. **Partial sums stay Partial** through linear ops (views, sums, scaling, adding a replicated
   value, which DTensor turns into a share of the sum without communication) until a consumer
   needs the value reduced. Then it is reduced *once* (on that mesh axis: one reduce-scatter or
   all-reduce) and every later consumer sees the reduced value. So the three input-gradient
   partial sums of separate q/k/v projections are added first and reduced together, as Megatron
   does with a fused QKV. The sum is reduced to what that consumer wants on the mesh dim -- a shard
   (one reduce-scatter: a ZeRO-3 gradient meeting its stored parameter) or the whole value -- and
   an op reading one partial value twice reduces it once.
2. **Gather on use** (ZeRO-3 / FSDP): inputs named by ``fsdp_argnums`` are stored sharded over the
   ``fsdp_axes``; each *use* of such a value by a compute op all-gathers it over those axes, so
   the forward and the backward each gather it and nothing gathered lives across the two.
   Slicing a layer out of a stacked weight (``select``) and casting it to the compute dtype (mixed
   precision) happen on the shard first, so the gather moves the compute dtype. Element-wise
   ops that keep the value's shape (the optimizer update) run on the shard. With
   ``reuse_gathers`` (``partition.reshard_after_forward=false``) each stored value is gathered
   once and the gathered copy serves the backward too: fewer bytes moved, more held.
3. **Sequence parallelism** (``sequence_parallel=("tp",)``, Megatron-SP): a partial sum over such
   an axis of a ``[batch, seq, features]`` activation is reduced to a shard of its sequence dim (one
   reduce-scatter, not an all-reduce), so the residual stream and the norms between the matmul
   blocks hold ``1/tp`` of the tokens; the next column-parallel matmul gathers the shard, once
   however many consumers (q, k, v; gate and up) read it.
4. **Constraints** (``sf.constrain``) redistribute to exactly their spec; so does a node whose
   ``meta["sf_force"]`` holds placements (how the auto-sharder imposes its solution).

Run it under ``make_fx`` (see ``lower``) and the DTensor ops become local ops plus functional
collectives: that is the per-rank program.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardfn.core import _torch_private as private
from shardfn.partition import local_map
from shardfn.partition.constrain import decode_spec
from shardfn.partition.spec import check_divisible, describe
from shardfn.partition.spmd import op_rules as rules

aten = torch.ops.aten

# Ops that take a slice out of a stored parameter without touching its sharded dims.
_SLICING_OPS = {aten.select.int, aten.slice.Tensor}

# Dtype casts: a stored parameter cast to the compute dtype (mixed precision) is cast on its shard
# and stays stored, so it is gathered in the compute dtype.
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}


# Views that may flatten a [batch, seq, ...] activation into rows (before a matmul).
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}

_CONSTANT_COPIES = {aten.lift_fresh_copy.default, aten.lift_fresh.default}

# Arguments an op reads for their shape only (LayerNorm's bias in its backward: the bias gradient
# is a sum of the output gradient): a stored parameter there is not gathered; an empty replicated
# stand-in of its shape is passed instead.
_SHAPE_ONLY_ARGS = {aten.native_layer_norm_backward.default: (6,)}

# Ops whose output can be far larger than a partial-sum input (weight gradients from a partial
# output gradient): a partial input is reduced before them when that moves fewer bytes.
_CONTRACTIONS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
                 aten.embedding_dense_backward.default}

# Cross-entropy pieces DTensor can run vocab-parallel when the class dim is sharded.
_LOSS_OPS = {
    aten._log_softmax.default, aten._log_softmax_backward_data.default,
    aten.nll_loss_forward.default, aten.nll_loss_backward.default,
}


def _class_dim_sharded(target, args) -> bool:
    """True when the logits (or log-probs) of a loss op are sharded on their class dim (1)."""
    x = args[1] if target is aten.nll_loss_backward.default else args[0]
    if target is aten._log_softmax_backward_data.default:
        x = args[1]
    if not isinstance(x, DTensor) or x.ndim < 2 or x.device_mesh.ndim != 1:
        return False  # torch's mean-reduced parallel loss supports one mesh dim; else logits are gathered
    return sum(1 for p in x.placements if isinstance(p, Shard) and p.dim == 1) == 1


class ShardingError(ValueError):
    """A node of the traced graph cannot be sharded as asked; the message names the node."""


def _where(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    line = [s.strip() for s in trace.strip().splitlines() if s.strip().startswith("File")]
    at = f" (from {line[-1]})" if line else ""
    return f"graph node {node.name!r} ({node.target}){at}"


class ShardingInterpreter(torch.fx.Interpreter):
    """Runs the global graph on DTensors, recording each node's placements in ``node.meta``.

    Args:
        gm: the global graph from ``trace``.
        mesh: a ``shardfn.Mesh``.
        stored: per placeholder, True when the input is a ZeRO-3 stored-sharded value.
        fsdp_axes: mesh-axis names a stored value is gathered over for use.
    """

    def __init__(self, gm, mesh, stored: Sequence[bool], fsdp_axes: Sequence[str], *, reuse_gathers: bool = False,
                 sequence_parallel: Sequence[str] = ()):
        super().__init__(gm)
        self.reuse_gathers = reuse_gathers
        self.gathered: dict[torch.fx.Node, DTensor] = {}  # stored value -> its gathered copy (reuse_gathers)
        self.reduce_like_input = rules.register_all()  # op -> {output index: input index}
        self.mesh = mesh
        self.dmesh = mesh.device_mesh
        self.names = mesh.dims  # mesh-dim index -> axis name
        self.fsdp_dims = [self.names.index(a) for a in fsdp_axes if a in self.names]
        self.sp_dims = {self.names.index(a) for a in sequence_parallel if a in self.names}
        self.sp_gathered: dict = {}  # (value's node, placements) -> its gathered copy (sequence parallel)
        self.stored_nodes: set[torch.fx.Node] = set()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.stored_nodes.update(n for n, s in zip(placeholders, stored) if s)
        self.constrained: dict[torch.fx.Node, tuple[str, Any]] = {}
        self.trace_graph = None

    # -- the node loop -------------------------------------------------------------------
    def run_node(self, n: torch.fx.Node) -> Any:
        graph = private.current_trace_graph()
        before = len(graph.nodes) if graph is not None else 0
        self.node = n
        out = super().run_node(n)
        if n.op in ("call_function", "get_attr") and isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
            out = self._replicated(out)  # factory ops (zeros, arange, ...) and constants
        forced = n.meta.get("sf_force")
        if forced is not None and isinstance(out, DTensor) and tuple(out.placements) != tuple(forced):
            out = out.redistribute(self.dmesh, forced)  # a placement chosen by the auto-sharder
        placements = _placements_of(out)
        if placements is not None:
            n.meta["sf_placements"] = placements
        if graph is not None:
            emitted = list(graph.nodes)[before:]
            for local in emitted:
                local.meta["sf_source"] = n.name
        return out

    def call_function(self, target, args, kwargs):
        n = self.node
        if target is torch.ops.shardfn.constrain.default:
            return self._constrain(n, args[0], decode_spec(args[1]))
        if target is torch.ops.shardfn.pipeline_split.default:
            return args[0]
        if target is torch.ops.shardfn.local_region.default:
            return self._local_region(n, args[0], args[1])
        if target is torch.ops.shardfn.local_region_backward.default:
            return self._local_region_backward(n, *args)
        if not isinstance(target, private.OpOverload):
            return target(*args, **kwargs)
        if target in _CONSTANT_COPIES:
            return args[0]  # a constant captured by the trace: already a replicated value
        args, kwargs = self._gather_stored(n, target, args, kwargs)
        args, kwargs = self._reduce_partials(n, target, args, kwargs)
        if self.sp_dims:
            args, kwargs = self._gather_sequence_once(n, target, args, kwargs)
        try:
            if target in _LOSS_OPS and _class_dim_sharded(target, args):
                if target is aten.nll_loss_backward.default and isinstance(args[6], DTensor):
                    args = (*args[:6], args[6].to_local(), *args[7:])  # total_weight: a plain scalar there
                with private.vocab_parallel_loss():
                    return target(*args, **kwargs)
            out = target(*args, **kwargs)
            onto = self.reduce_like_input.get(target)
            if onto is not None:  # partial sums reduced onto an input's layout
                out = type(out)(o.redistribute(self.dmesh, args[onto[i]].placements)
                                if i in onto and _has_partial(o) else o
                                for i, o in enumerate(out))
            return out
        except NotImplementedError as e:
            raise ShardingError(
                f"{_where(n)}: torch's DTensor has no sharding rule for {target} with inputs "
                f"{_describe_args(args, self.names)}; register one with "
                f"torch.distributed.tensor.experimental.register_sharding, or wrap this code in "
                f"sf.local_map ({e})"
            ) from None
        except RuntimeError as e:
            if "sharding strategy" in str(e) or "Sharding propagation failed" in str(e):
                raise ShardingError(f"{_where(n)}: sharding propagation failed: {e}") from None
            raise

    # -- policies ------------------------------------------------------------------------
    def _constrain(self, n, x: DTensor, spec) -> DTensor:
        src = n.args[0]
        key = str(spec)
        if src in self.constrained and self.constrained[src][0] != key:
            other_node, other_spec = self.constrained[src][1], self.constrained[src][0]
            raise ShardingError(
                f"conflicting constraints on graph node {src.name!r}: {other_spec} at "
                f"{other_node.name!r} and {key} at {n.name!r}; constrain a value to one spec"
            )
        self.constrained[src] = (key, n)
        placements = self.mesh.placements(spec, x.ndim, where=f"sf.constrain at {_where(n)}")
        check_divisible(x.shape, spec, self.mesh.axes, where=f"sf.constrain at {_where(n)}")
        return x.redistribute(self.dmesh, placements)

    def _to_local(self, xs, specs, n) -> list:
        out = []
        for x, spec in zip(xs, specs):
            pl = self.mesh.placements(spec, x.ndim, where=f"sf.local_map input at {_where(n)}")
            check_divisible(x.shape, spec, self.mesh.axes, where=f"sf.local_map input at {_where(n)}")
            out.append(x.redistribute(self.dmesh, pl).to_local())
        return out

    def _from_local(self, locals_, specs, metas) -> list:
        out = []
        for t, spec, meta in zip(locals_, specs, metas):
            pl = self.mesh.placements(spec, t.ndim, where="sf.local_map output")
            out.append(DTensor.from_local(t, self.dmesh, pl, run_check=False, shape=meta.shape, stride=meta.stride()))
        return out

    def _local_region(self, n, xs, rid):
        reg = local_map.region(rid)
        outs = reg.call_flat(self._to_local(xs, reg.in_leaf_specs, n))
        return self._from_local(outs, reg.out_leaf_specs, n.meta["val"])

    def _local_region_backward(self, n, xs, outs, gs, rid):
        reg = local_map.region(rid)
        local_xs = self._to_local(xs, reg.in_leaf_specs, n)
        local_outs = self._to_local(outs, reg.out_leaf_specs, n)
        local_gs = self._to_local(gs, reg.out_leaf_specs, n)
        grads = local_map.vjp_flat(reg, local_xs, local_outs, local_gs)
        # The region varies along every axis some input is split over; an input replicated
        # along such an axis gets per-rank cotangent contributions, i.e. a Partial sum there.
        varying = {self.names.index(a) for s in reg.in_leaf_specs for a in s.axes() if a in self.names}
        out = []
        for g, spec, meta in zip(grads, reg.in_leaf_specs, n.meta["val"]):
            pl = list(self.mesh.placements(spec, g.ndim, where="sf.local_map cotangent"))
            pl = [Partial() if d in varying and isinstance(p, Replicate) else p for d, p in enumerate(pl)]
            out.append(DTensor.from_local(g, self.dmesh, pl, run_check=False, shape=meta.shape, stride=meta.stride()))
        return out

    def _gather_stored(self, n, target, args, kwargs):
        if not self.fsdp_dims:
            return args, kwargs
        for pos in _SHAPE_ONLY_ARGS.get(target, ()):
            if pos < len(args) and isinstance(args[pos], DTensor) and n.args[pos] in self.stored_nodes:
                args = (*args[:pos], self._shape_stand_in(args[pos]), *args[pos + 1:])
        flat, spec = private.tree_flatten((args, kwargs))
        sources = private.tree_leaves((n.args, n.kwargs))
        if len(sources) != len(flat):  # defensive: structure mismatch means no stored inputs here
            return args, kwargs
        stored_in = [i for i, src in enumerate(sources) if isinstance(src, torch.fx.Node) and src in self.stored_nodes]
        if not stored_in:
            return args, kwargs
        if target in _SLICING_OPS or (target in _CASTS and len(stored_in) == 1):
            self.stored_nodes.add(n)  # slicing a layer out of the shard, or casting it, keeps it stored
            return args, kwargs
        out_shape = n.meta.get("val").shape if isinstance(n.meta.get("val"), torch.Tensor) else None
        elementwise = torch.Tag.pointwise in target.tags
        for i in stored_in:
            x = flat[i]
            if elementwise and out_shape == x.shape:
                continue  # optimizer-style update on the shard
            if self.reuse_gathers and sources[i] in self.gathered:
                flat[i] = self.gathered[sources[i]]
                continue
            placements = list(x.placements)
            if any(isinstance(placements[d], Shard) for d in self.fsdp_dims):
                for d in self.fsdp_dims:
                    placements[d] = Replicate()
                flat[i] = x.redistribute(self.dmesh, placements)
                if self.reuse_gathers:
                    self.gathered[sources[i]] = flat[i]
        return private.tree_unflatten(flat, spec)

    def _shape_stand_in(self, x: DTensor) -> DTensor:
        """An uninitialized replicated value of ``x``'s global shape (read for its shape only)."""
        local = torch.empty(x.shape, dtype=x.dtype, device=x.to_local().device)
        return DTensor.from_local(local, self.dmesh, [Replicate()] * self.dmesh.ndim, run_check=False)

    def _reduce_partials(self, n, target, args, kwargs):
        flat, spec = private.tree_flatten((args, kwargs))
        sources = private.tree_leaves((n.args, n.kwargs))
        tensor_idx = [i for i, x in enumerate(flat) if isinstance(x, DTensor)]
        if not any(_has_partial(flat[i]) for i in tensor_idx):
            return args, kwargs
        if target in _LOSS_OPS and _class_dim_sharded(target, args):
            return args, kwargs
        wanted, outs = private.planned_sharding(target, args, kwargs)
        if wanted is None:
            wanted = [private.dtensor_spec(flat[i]) for i in tensor_idx]
        if len(wanted) != len(tensor_idx):
            return args, kwargs
        partial_dims = {d for i in tensor_idx for d, p in enumerate(flat[i].placements) if isinstance(p, Partial)}
        dims: set[int] = set()
        for i, w in zip(tensor_idx, wanted):
            for d, (now, want) in enumerate(zip(flat[i].placements, w.placements)):
                if isinstance(now, Partial) and not isinstance(want, Partial):
                    dims.add(d)  # the op needs the sum
                elif d in partial_dims and not isinstance(want, Partial) and now != want:
                    dims.add(d)  # it would move another operand (gather a weight) to keep a partial
        out_val = n.meta.get("val")
        if isinstance(out_val, torch.Tensor) and outs and target in _CONTRACTIONS:
            partial_in = max((flat[i].numel() for i in tensor_idx if _has_partial(flat[i])), default=0)
            for d in partial_dims:
                if any(isinstance(o[d], Partial) for o in outs) and out_val.numel() > partial_in:
                    dims.add(d)  # reduce a partial sum where it is smallest, not after a contraction grows it
        if not dims:
            return args, kwargs
        done: dict = {}  # (value, placements) -> reduced: an op reading one partial twice reduces it once
        for i, w in zip(tensor_idx, wanted):
            x = flat[i]
            if not any(isinstance(x.placements[d], Partial) for d in dims):
                continue
            # reduce to what the op wants on that mesh dim: a shard (reduce-scatter) where the op
            # meets it with another value sharded on that dim (a ZeRO-3 gradient and its stored
            # parameter or state), else the whole value (all-reduce): a shard that every later
            # consumer would gather again costs more than the one all-reduce
            sharded_by_others = {d for j in tensor_idx if flat[j] is not x
                                 for d, q in enumerate(flat[j].placements) if isinstance(q, Shard)}
            placements = tuple(
                (w.placements[d] if isinstance(w.placements[d], Shard) and d in sharded_by_others
                 else Shard(1) if d in self.sp_dims and x.ndim == 3 else Replicate())
                if d in dims and isinstance(p, Partial) else p for d, p in enumerate(x.placements)
            )
            placements = _even(placements, dims, x.shape, self.dmesh.shape)
            key = (id(x), placements)
            if key not in done:
                done[key] = x.redistribute(self.dmesh, list(placements))
            reduced = flat[i] = done[key]
            src = sources[i] if len(sources) == len(flat) else None
            if isinstance(src, torch.fx.Node) and self.env.get(src) is x:
                self.env[src] = reduced  # reduce once: later consumers see the reduced value
        return private.tree_unflatten(flat, spec)

    def _gather_sequence_once(self, n, target, args, kwargs):
        """Sequence parallelism: the gather of a sequence-split value that an op needs whole
        (the column-parallel matmuls after a norm) is made once and serves every consumer."""
        flat, spec = private.tree_flatten((args, kwargs))
        sources = private.tree_leaves((n.args, n.kwargs))
        tensor_idx = [i for i, x in enumerate(flat) if isinstance(x, DTensor)]
        split = [i for i in tensor_idx if self._sequence_split(flat[i])]
        if not split or len(sources) != len(flat):
            return args, kwargs
        wanted, outs = private.planned_sharding(target, args, kwargs)
        if target in _VIEWS and outs and split == tensor_idx[:1] and any(
                not (type(outs[0][d]) is Shard and outs[0][d].dim == 1) for d in self.sp_dims):
            # flattening [batch, seq, ...] to rows for a matmul: gather the sequence first (once
            # for the value), rather than carry a strided shard each matmul gathers again
            x = flat[tensor_idx[0]]
            wanted = [_with_replicated(x, self.sp_dims)]  # the view's only tensor input
        if wanted is None or len(wanted) != len(tensor_idx):
            return args, kwargs
        for i, w in zip(tensor_idx, wanted):
            x, src = flat[i], sources[i]
            if i not in split or not isinstance(src, torch.fx.Node) or src in self.stored_nodes:
                continue
            want = tuple(w) if isinstance(w, tuple) else tuple(w.placements)
            gathers = [d for d, (now, to) in enumerate(zip(x.placements, want)) if now != to]
            if not gathers or any(d not in self.sp_dims or not isinstance(x.placements[d], Shard)
                                  or not isinstance(want[d], Replicate) for d in gathers):
                continue  # only gathers over the sequence axes are shared
            key = (src, want)
            if key not in self.sp_gathered:
                self.sp_gathered[key] = x.redistribute(self.dmesh, list(want))
            flat[i] = self.sp_gathered[key]
        return private.tree_unflatten(flat, spec)

    def _sequence_split(self, x: DTensor) -> bool:
        """``x`` is a ``[batch, seq, features]`` activation split over its sequence on a sequence-parallel axis."""
        return x.ndim == 3 and any(type(x.placements[d]) is Shard and x.placements[d].dim == 1 for d in self.sp_dims)

    def _replicated(self, t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t, self.dmesh, [Replicate()] * self.dmesh.ndim, run_check=False)


def _with_replicated(x: DTensor, dims: set) -> tuple:
    """``x``'s placements with a sequence shard on ``dims`` replaced by ``Replicate``."""
    return tuple(Replicate() if d in dims and isinstance(p, Shard) else p for d, p in enumerate(x.placements))


def _even(placements: tuple, dims: set, shape, mesh_shape) -> tuple:
    """``placements`` (a partial sum's, reduced on the mesh dims ``dims``) with each ``Shard``
    on such a dim made ``Replicate`` where it would either split its tensor dim unevenly (a
    global batch of 120 rows over 64 ranks) or add itself to a tensor dim some other mesh dim
    already splits (rows split over dp and fsdp, then over tp too): that sum is all-reduced
    rather than reduce-scattered, since DTensor's views cannot address shards of unequal size,
    nor a dim split three ways once it is reshaped."""
    out = list(placements)
    for d in sorted(dims):
        p = out[d]
        if not isinstance(p, Shard):
            continue
        on_dim = [e for e, q in enumerate(out) if isinstance(q, Shard) and q.dim == p.dim]
        ways = 1
        for e in on_dim:
            ways *= mesh_shape[e]
        if shape[p.dim] % ways or any(e not in dims for e in on_dim):
            out[d] = Replicate()
    return tuple(out)


def _has_partial(x: DTensor) -> bool:
    return any(isinstance(p, Partial) for p in x.placements)


def _placements_of(out: Any):
    if isinstance(out, DTensor):
        return tuple(out.placements)
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, DTensor) or o is None for o in out):
        return tuple(None if o is None else tuple(o.placements) for o in out)
    return None


def _describe_args(args, names) -> str:
    parts = []
    for a in private.tree_leaves(args):
        if isinstance(a, DTensor):
            parts.append(f"{tuple(a.shape)}[{describe(a.placements, names)}]")
    return ", ".join(parts) or "(no tensors)"
