"""DTensor's op strategy registries, as the auto-sharder asks them (private torch API; part of
``core._torch_private``, where every private torch API shardfn uses lives).

The auto-sharder asks DTensor, for one op at global shapes, for *every* placement combination the
op supports -- not just the cheapest one for given inputs, which is what DTensor itself computes
at run time. Two registries hold the answers:

- ``op_single_dim_strategy_funcs``: rules for one mesh dim (``[out, in0, in1, ...]`` with
  placeholders for "shard this tensor dim"), expanded here over every mesh dim;
- ``op_strategy_funcs``: functions of an ``OpSchema`` whose tensor args are ``OpStrategy``
  objects (the producers' candidate placements) returning an ``OpStrategy`` of ``OpSpec``.

Single-dim rules win when an op has both, as in DTensor's own propagator. An op with neither
that DTensor runs through its decomposition gets one all-replicated strategy. DTensor's
``redistribute_cost`` is not used: the auto-sharder prices transitions with its hardware model
(``partition.cost.model``).

    a, b = TensorArg(x, [(Replicate(),)]), TensorArg(w, [(Replicate(),)])
    op_strategies(aten.mm.default, (a, b), {}, mesh.device_mesh, x @ w)
    # [Strategy(out=(Replicate(),), ins=(...)), Strategy(out=(Partial(sum),), ins=((Shard(1),), (Shard(0),))), ...]
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

Placements = tuple  # tuple[Placement, ...], one per mesh dim


class NoStrategy(LookupError):
    """DTensor has no sharding strategy for this op (or it failed for these arguments)."""


class TensorArg:
    """A tensor argument of a node: its global fake value and the placements it may arrive in."""

    __slots__ = ("val", "options")

    def __init__(self, val: torch.Tensor, options: Sequence[Placements]):
        self.val = val
        self.options = tuple(options)


class Strategy(NamedTuple):
    """One way to run an op: output placements (a tuple of those, with None for non-tensor
    outputs, for multi-output ops) and the placements each tensor input must arrive in
    (in pytree order of ``(args, kwargs)``)."""

    out: Any
    ins: tuple


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def tensor_meta(val: torch.Tensor):
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    return TensorMeta(val.shape, val.stride(), val.dtype)


def _spec(device_mesh, placements, val):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return DTensorSpec(device_mesh, tuple(placements), tensor_meta=tensor_meta(val))


def _op_strategy(device_mesh, arg: TensorArg, options=None):
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    return OpStrategy([OpSpec(_spec(device_mesh, pl, arg.val)) for pl in (options or arg.options)])


def _schema(op, args, kwargs, device_mesh, choose):
    """An OpSchema with each TensorArg replaced by ``choose(arg)`` (an OpStrategy)."""
    from torch.distributed.tensor._op_schema import OpSchema, TupleStrategy

    def conv(a):
        if isinstance(a, TensorArg):
            return choose(a)
        if isinstance(a, (list, tuple)) and a and all(isinstance(b, TensorArg) for b in a):
            return TupleStrategy([choose(b) for b in a])
        if isinstance(a, (list, tuple)) and any(isinstance(b, TensorArg) for b in a):
            return [conv(b) for b in a]
        return a

    sp = _propagator()
    info = sp.op_to_schema_info.get(op) or sp.op_to_schema_info_for_single_dim_strategy.get(op)
    return OpSchema(op, tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}, schema_info=info)


def _tensor_args(args, kwargs) -> list[TensorArg]:
    return [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, TensorArg)]


def _out_metas(out_val):
    if isinstance(out_val, torch.Tensor):
        return tensor_meta(out_val)
    return tuple(tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in out_val)


def _single_dim(op, args, kwargs, device_mesh, out_val) -> list[Strategy]:
    """Expand one-mesh-dim rules over every mesh dim (what DTensor's
    ``expand_to_full_mesh_op_strategy`` does, without building specs and costs we do not use)."""
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _fill_single_dim_strategy_placeholders,
        _insert_single_dim_replication_strategy,
    )

    info = _propagator().op_single_dim_strategy_funcs[op]
    replicated = (Replicate(),) * device_mesh.ndim
    schema = _schema(op, args, kwargs, device_mesh, lambda a: _op_strategy(device_mesh, a, [replicated]))
    out_meta = _out_metas(out_val)
    n_in = len(_tensor_args(args, kwargs))
    rules = info.func(op, schema.args_meta, schema.kwargs_meta)
    n_out = len(rules[0]) - n_in if rules else (1 if isinstance(out_val, torch.Tensor) else len(out_val))
    rules = _insert_single_dim_replication_strategy(rules, n_out, n_in, out_meta)
    rules = _fill_single_dim_strategy_placeholders({Shard(0)}, rules)
    multi_out = not isinstance(out_val, torch.Tensor)
    found = []
    for combo in itertools.product(rules, repeat=device_mesh.ndim):
        columns = [tuple(rule[pos] for rule in combo) for pos in range(n_out + n_in)]
        if any(_mixed(col) for col in columns):
            continue
        outs = tuple(None if any(p is None for p in col) else col for col in columns[:n_out])
        ins = tuple(columns[n_out:])
        if any(any(p is None for p in col) for col in ins):
            continue
        found.append(Strategy(outs if multi_out else outs[0], ins))
    return found


def _mixed(placements) -> bool:
    """Different kinds of partial sums on one tensor (sum with avg is fine), which DTensor skips."""
    kinds = {(type(p), p.reduce_op) for p in placements if isinstance(p, Partial)}
    if len(kinds) <= 1:
        return False
    return not (len({t for t, _ in kinds}) == 1 and {r for _, r in kinds} == {"sum", "avg"})


def _registered(op, args, kwargs, device_mesh):
    """Call the op's strategy function; one call per input option when there is one tensor
    input (the function maps each input placement to its outputs), else one call with all."""
    fn = _propagator().op_strategy_funcs[op]
    tensors = _tensor_args(args, kwargs)
    if len(tensors) == 1:
        out, error = [], None
        for pl in tensors[0].options:
            schema = _schema(op, args, kwargs, device_mesh, lambda a: _op_strategy(device_mesh, a, [pl]))
            try:
                out.extend(_flatten_strategy(fn(schema)))
            except NoStrategy:
                raise
            except Exception as e:  # this input placement cannot be read (e.g. an uneven view)
                error = e
        if not out and error is not None:
            raise error
        return out
    # Several functions follow one input and index the others' strategies by the same position,
    # so every input gets the same number of options (cycled).
    longest = max(len(a.options) for a in tensors)
    padded = {id(a): [a.options[j % len(a.options)] for j in range(longest)] for a in tensors}
    schema = _schema(op, args, kwargs, device_mesh, lambda a: _op_strategy(device_mesh, a, padded[id(a)]))
    return _flatten_strategy(fn(schema))


def _flatten_strategy(strategy):
    from torch.distributed.tensor._op_schema import OpStrategy

    if not isinstance(strategy, OpStrategy):
        raise NoStrategy(f"strategy of type {type(strategy).__name__} (tuple strategies are not supported)")
    return strategy.strategies


def op_strategies(op, args: tuple, kwargs: dict, device_mesh, out_val) -> list[Strategy]:
    """Every placement combination DTensor allows for ``op`` on these arguments.

    ``args``/``kwargs`` are the node's arguments with each tensor replaced by a ``TensorArg``.
    Raises NoStrategy when DTensor has no rule for the op.
    """
    sp = _propagator()
    try:
        if op in sp.op_single_dim_strategy_funcs:
            return _single_dim(op, args, kwargs, device_mesh, out_val)
        if op in sp.op_strategy_funcs:
            specs = _registered(op, args, kwargs, device_mesh)
        elif _has_decomposition(op):
            # DTensor runs it through its decomposition; on replicated inputs that is replicated
            return [_replicated_strategy(args, kwargs, device_mesh, out_val)]
        else:
            raise NoStrategy(f"DTensor has no sharding strategy for {op}")
    except NoStrategy:
        raise
    except Exception as e:  # a strategy function that cannot handle these arguments
        raise NoStrategy(f"DTensor's strategy for {op} failed: {type(e).__name__}: {e}") from e
    n_in = len(_tensor_args(args, kwargs))
    out = []
    for spec in specs:
        outs = spec.output_specs
        if isinstance(outs, (tuple, list)):
            out_pl = tuple(None if s is None else tuple(s.placements) for s in outs)
        elif outs is None:
            out_pl = None
        else:
            out_pl = tuple(outs.placements)
        if spec.input_specs is None:
            ins = tuple(out_pl for _ in range(n_in))
        else:
            ins = tuple(tuple(s.placements) for s in spec.input_specs)
        if len(ins) != n_in:
            raise NoStrategy(f"DTensor's strategy for {op} lists {len(ins)} inputs but the node has {n_in} tensors")
        out.append(Strategy(out_pl, ins))
    return out


def _has_decomposition(op) -> bool:
    decomp = getattr(_propagator(), "decomp_strategy", None)
    try:
        return bool(decomp is not None and decomp.has_decomp(op))
    except Exception:
        return False


def _replicated_strategy(args, kwargs, device_mesh, out_val) -> Strategy:
    rep = (Replicate(),) * device_mesh.ndim
    outs = (
        rep
        if isinstance(out_val, torch.Tensor)
        else tuple(rep if isinstance(v, torch.Tensor) else None for v in out_val)
    )
    return Strategy(outs, tuple(rep for _ in _tensor_args(args, kwargs)))


def placement_options(shape: Sequence[int], mesh_shape: Sequence[int]) -> list[Placements]:
    """Every Replicate/Shard(d) combination over the mesh that divides ``shape`` evenly
    (size-1 mesh dims are always Replicate)."""
    per_dim = [[Replicate()] + ([Shard(d) for d in range(len(shape))] if size > 1 else []) for size in mesh_shape]
    return [pl for pl in itertools.product(*per_dim) if divides(shape, pl, mesh_shape)]


def divides(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim splits evenly over its mesh dims."""
    split = [1] * len(shape)
    for pl, size in zip(placements, mesh_shape):
        if isinstance(pl, Shard):
            if pl.dim >= len(shape):
                return False
            split[pl.dim] *= size
    return all(s % k == 0 for s, k in zip(shape, split))


def is_strided(p: Placement) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(p, _StridedShard)


def is_partial(p: Placement) -> bool:
    return isinstance(p, Partial)
