"""Auto-sharding, part 1: every node's candidate strategies and their compute cost.

For each node of the traced joint graph, DTensor's op strategies list every way the op can run
(output and input placements); each input may be stored in any placement that divides it.
Views follow their input's choice; getitems their tuple producer's. The result is what the ILP
(``auto.problem``) chooses among.

    cands = Candidates(traced, mesh, load_hardware("h100"))
    cands.strats[i]      # the Strategy tuple of owner node i
"""

from __future__ import annotations

import operator

import numpy as np
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.node import map_arg

from shardfn.core._torch_private import OpOverload, strategies
from shardfn.partition import constrain as _constrain_ops  # noqa: F401  (registers shardfn::constrain)
from shardfn.partition import local_map as _local_map_ops  # noqa: F401  (registers shardfn::local_region)
from shardfn.partition.cost.hardware import Hardware
from shardfn.partition.cost.model import CostModel
from shardfn.partition.spec import to_placements
from shardfn.partition.spmd.fx import is_view
from shardfn.partition.spmd.trace import Traced

aten = torch.ops.aten

_TIE_BREAK = 1e-3      # an input's bytes / HBM bandwidth, times this, is added to its cost


def make_cost_model(cost_model, mesh_shape: tuple, hardware: Hardware, device_mesh, gloo: bool) -> CostModel:
    """The cost model that prices the candidates: ``CostModel`` itself (``cost_model=None``), a
    subclass of it, or any callable ``(mesh_shape, hardware, device_mesh, gathers_for_all_to_all)``
    that returns an object with ``CostModel``'s methods.

        class SlowLinks(CostModel): ...       # override transition() or compute_time()
        solve(traced, mesh, cost_model=SlowLinks)
    """
    if cost_model is None:
        cost_model = CostModel
    if not callable(cost_model):
        raise TypeError(f"cost_model must be a CostModel subclass or a callable (mesh_shape, hardware, device_mesh, "
                        f"gathers_for_all_to_all) -> CostModel; got {type(cost_model).__name__} {cost_model!r}")
    model = cost_model(mesh_shape, hardware, device_mesh, gathers_for_all_to_all=gloo)
    missing = [m for m in ("compute_time", "transition", "local_bytes") if not callable(getattr(model, m, None))]
    if missing or not hasattr(model, "rates"):
        raise TypeError(f"cost_model {cost_model!r} returned {type(model).__name__}, which lacks "
                        f"{missing or ['rates']}; subclass shardfn.partition.cost.model.CostModel")
    return model


class Candidates:
    """The traced graph's nodes with their candidate strategies, owners and compute costs."""

    def __init__(self, traced: Traced, mesh, hardware: Hardware, cost_model=None):
        from shardfn.partition.spmd import op_rules as rules

        rules.register_all()  # shardfn's own DTensor rules (CPU fused attention)
        self.traced = traced
        self.mesh = mesh
        # DTensor placements are over the device mesh's dims (size-1 axes have none)
        self.names = tuple(getattr(mesh, "dims", mesh.names))
        self.mesh_shape = tuple(mesh.axes[a] for a in self.names)
        self.dmesh = mesh.device_mesh
        # a real CPU (gloo) mesh runs DTensor's all-to-alls as all-gathers; a fake one plans for
        # the hardware profile's collectives
        gloo = self.dmesh.device_type == "cpu" and not getattr(mesh, "fake", True)
        self.model = make_cost_model(cost_model, self.mesh_shape, hardware, self.dmesh, gloo)
        gm = traced.graph_module
        self.nodes = [n for n in gm.graph.nodes if n.op != "output"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self._interned: dict = {}
        self._by_ids: dict = {}
        self._cache: dict = {}
        self._analyse()

    def _norm(self, pl):
        """Placements on size-1 mesh dims are all the same: call them Replicate."""
        if pl is None:
            return None
        if pl and isinstance(pl[0], (tuple, type(None))):
            return self._intern(tuple(self._norm(p) for p in pl))
        return self._intern(tuple(Replicate() if size == 1 else p for p, size in zip(pl, self.mesh_shape)))

    def _placements(self, spec, ndim: int, *, where: str) -> tuple:
        return to_placements(spec, ndim, self.names, where=where, known=tuple(self.mesh.names))

    def _intern(self, value):
        """One object per distinct placement tuple (and per tuple of them), so that the hot
        paths compare and hash by identity (torch's Placement hashing is Python code)."""
        return self._interned.setdefault(value, value)

    def _intern_ids(self, items: tuple) -> tuple:
        """Intern a tuple of already interned objects, keyed by their identities."""
        return self._by_ids.setdefault(tuple(map(id, items)), items)

    def _distinct(self, items) -> tuple:
        return self._intern_ids(tuple({id(p): p for p in items}.values()))

    def _analyse(self) -> None:
        """Candidates per node, in three kinds.

        - An *owner* has its own choice among its strategies (ILP variables).
        - A getitem takes its tuple producer's choice.
        - A *follower* -- an op with one input that has several options (or an element-wise op,
          whose largest such input it follows) -- runs, for each option of that input, the
          strategy that reads it as it is (or, when none can, the cheapest redistribution).
          Views, casts, element-wise ops and reductions follow; matmuls own.

        Followers and getitems add no variables: their placements are functions of their
        owner's choice, and their cost is added to the owner's strategies.
        """
        n_nodes = len(self.nodes)
        self.val: list = [None] * n_nodes
        self.owner = list(range(n_nodes))      # the node whose choice decides this value
        self.item: list = [None] * n_nodes     # getitem's index
        self.follow: dict[int, tuple] = {}     # follower -> (input position, Strategy per option of that input)
        self.inputs: list[list[int]] = [[] for _ in range(n_nodes)]
        self.strats: dict[int, tuple] = {}     # owner -> its Strategy tuple
        self.node_compute: dict[int, np.ndarray] = {}  # owner/follower -> compute seconds per own strategy
        self.obj: dict[int, np.ndarray] = {}   # owner -> seconds per strategy, its followers included
        self.opts: list = [None] * n_nodes     # distinct output placements of each value
        self.out_map: list = [None] * n_nodes  # owner strategy -> index into opts
        replicated = self._intern((Replicate(),) * len(self.mesh_shape))
        self.opaque: set[int] = set()          # nodes without tensors (profiler handles, ...)
        for i, n in enumerate(self.nodes):
            self.val[i] = n.meta.get("val") if n.op != "get_attr" else getattr(self.traced.graph_module, n.target)
            self.inputs[i] = [self.index[a] for a in _node_args(n) if self.index[a] not in self.opaque]
            if not _has_tensor(self.val[i]):
                self.opaque.add(i)
                self.inputs[i] = []
                continue
            if n.op == "call_function" and n.target is operator.getitem:
                src = self.inputs[i][0]
                self.owner[i] = self.owner[src]
                self.item[i] = n.args[1]
                outs = [o[n.args[1]] if o is not None else None for o in self.opts[src]]
                self._set_outputs(i, outs, self.out_map[src])
                continue
            strats, compute = self._candidates(i, n, replicated)
            if self._try_follow(i, n, strats, compute):
                continue
            self.strats[i] = strats
            self.node_compute[i] = compute
            self.obj[i] = compute.copy()
            self._set_outputs(i, [s.out for s in strats], np.arange(len(strats)))

    def _set_outputs(self, i: int, outs: list, through: np.ndarray) -> None:
        """Value ``i`` is in placement ``outs[j]`` when its owner's strategy maps to ``j`` by
        ``through`` (an array over the owner's strategies)."""
        opts = self._distinct(outs)
        index = {id(p): j for j, p in enumerate(opts)}
        self.opts[i] = opts
        self.out_map[i] = np.array([index[id(p)] for p in outs], dtype=np.int64)[through]

    def _try_follow(self, i: int, n: torch.fx.Node, strats: tuple, compute: np.ndarray) -> bool:
        """Make ``i`` a follower when it is a view whose one multi-option input can be read in
        every one of its placements as it is (a view moves no bytes, so taking the input as it
        comes loses nothing; any other op could do better by slicing or resharding first, and
        stays an owner)."""
        if n.op != "call_function" or not isinstance(n.target, OpOverload) or not is_view(n.target):
            return False
        if not isinstance(self.val[i], torch.Tensor):
            return False
        ins = self.inputs[i]
        multi = [k for k, j in enumerate(ins) if len(self.opts[j]) > 1]
        if len(multi) != 1:
            return False
        k0 = multi[0]
        u = ins[k0]
        fixed = {k: self.opts[j][0] for k, j in enumerate(ins) if k != k0}
        best: dict = {}
        for s, c in zip(strats, compute):
            a = id(s.ins[k0])
            if all(s.ins[k] is p for k, p in fixed.items()) and (a not in best or c < best[a][1]):
                best[a] = (s, c)
        if any(id(a) not in best for a in self.opts[u]):
            return False
        per_opt = tuple(best[id(a)][0] for a in self.opts[u])
        costs = np.array([best[id(a)][1] for a in self.opts[u]])
        o = self.owner[u]
        self.owner[i] = o
        self.follow[i] = (k0, per_opt)
        self.node_compute[i] = costs
        self.obj[o] = self.obj[o] + costs[self.out_map[u]]
        self._set_outputs(i, [s.out for s in per_opt], self.out_map[u])
        return True

    def strategy_of(self, i: int, choice: dict) -> "strategies.Strategy":
        """The strategy owner or follower ``i`` runs under ``choice`` (owner -> strategy index)."""
        if i in self.strats:
            return self.strats[i][choice[i]]
        k0, per_opt = self.follow[i]
        return per_opt[self.out_map[self.inputs[i][k0]][choice[self.owner[i]]]]

    def _needs(self, i: int, k: int) -> tuple:
        """The placement owner/follower ``i`` reads its input ``k`` in, per strategy of its owner."""
        if i in self.strats:
            return tuple(s.ins[k] for s in self.strats[i])
        k0, per_opt = self.follow[i]
        return tuple(per_opt[j].ins[k] for j in self.out_map[self.inputs[i][k0]])

    def _candidates(self, i: int, n: torch.fx.Node, replicated: tuple):
        val = self.val[i]
        if n.op == "placeholder":
            opts = [self._intern(p) for p in strategies.placement_options(val.shape, self.mesh_shape)]
            # a tie-breaker: among plans of equal time, store inputs in fewer bytes per rank
            hold = np.array([self.model.rates.memory_s(self.model.local_bytes(val, p)) for p in opts])
            return self._intern(tuple(strategies.Strategy(p, ()) for p in opts)), _TIE_BREAK * hold
        target = n.target
        if n.op == "get_attr" or not self.inputs[i]:
            out = (
                replicated
                if isinstance(val, torch.Tensor)
                else tuple(replicated if isinstance(v, torch.Tensor) else None for v in val)
            )
            return (strategies.Strategy(out, ()),), np.zeros(1)
        key = self._key(n)
        hit = self._cache.get(key) if key is not None else None
        if hit is not None:
            return hit
        if target is torch.ops.shardfn.constrain.default:
            from shardfn.partition.constrain import decode_spec

            pl = self._norm(self._placements(decode_spec(n.args[1]), val.ndim, where=f"sf.constrain at {n.name}"))
            found = (strategies.Strategy(pl, (pl,)),)
        elif target is torch.ops.shardfn.pipeline_split.default:
            found = tuple(strategies.Strategy(p, (p,)) for p in self.opts[self.inputs[i][0]])
        elif target in (torch.ops.shardfn.local_region.default, torch.ops.shardfn.local_region_backward.default):
            found = (self._region_strategy(n),)
        elif target is aten.stack.default:
            found = self._stack_strategies(i, n)
        else:
            found = self._dtensor_strategies(i, n, replicated)
        args, kwargs = map_arg((n.args, n.kwargs), lambda a: self.val[self.index[a]])
        compute = np.array(
            [
                self.model.compute_time(target, args, kwargs, val, s.ins, s.out)
                if isinstance(target, OpOverload)
                else 0.0
                for s in found
            ]
        )
        found = self._intern(found)
        if key is not None:
            self._cache[key] = (found, compute)
        return found, compute

    def _key(self, n: torch.fx.Node):
        """Cache key: the op and its arguments, tensors by (shape, dtype, stride, options)."""
        def conv(a):
            i = self.index[a]
            v = self.val[i]
            if i in self.opaque:
                return ("opaque", type(v).__name__)
            return ("T", tuple(v.shape), v.dtype, tuple(v.stride()), id(self.opts[i]))

        args = list(n.args)
        if n.target is aten.select.int and len(args) > 2:
            args[2] = None  # which layer is selected does not change the strategies
        elif n.target is aten.select_backward.default and len(args) > 3:
            args[3] = None
        try:
            key = (
                n.target,
                _freeze(map_arg((tuple(args), n.kwargs), conv)),
                tuple(self.val[self.index[n]].shape) if isinstance(self.val[self.index[n]], torch.Tensor) else None,
            )
            hash(key)
            return key
        except TypeError:
            return None

    def _dtensor_strategies(self, i: int, n: torch.fx.Node, replicated: tuple) -> tuple:
        def targ(a):
            j = self.index[a]
            if j in self.opaque:
                return self.val[j]
            opts = self.opts[j]
            if replicated not in opts:
                opts = opts + (replicated,)  # a replicated copy is always reachable
            return strategies.TensorArg(
                self.val[j],
                [p for p in opts if p is not None and not _has_partial(p)]
                + [p for p in opts if p is not None and _has_partial(p)],
            )

        args, kwargs = map_arg((n.args, n.kwargs), targ)
        try:
            found = strategies.op_strategies(n.target, args, kwargs, self.dmesh, self.val[i])
        except strategies.NoStrategy as e:
            raise ValueError(
                f"auto-sharding: graph node {n.name!r} ({n.target}) has no DTensor sharding strategy ({e}); "
                f"register one with torch.distributed.tensor.experimental.register_sharding, wrap the code "
                f"in sf.local_map, or pin its input with sf.constrain"
            ) from None
        in_shapes = [self.val[j].shape for j in self.inputs[i]]
        out_val = self.val[i]
        keep = []
        for s in found:
            ins = tuple(self._norm(p) for p in s.ins)
            out = self._norm(s.out)
            if any(_strided(p) for p in ins) or _strided_out(out):
                continue
            if not all(strategies.divides(shape, p, self.mesh_shape) for shape, p in zip(in_shapes, ins)):
                continue
            if not _out_divides(out_val, out, self.mesh_shape):
                continue
            keep.append(strategies.Strategy(out, ins))
        keep = tuple(dict.fromkeys(keep))
        # A strategy that reads a partial sum its producer can never make (it would turn a
        # replicated value into a "share") is left out when there are others.
        made = [set(self.opts[j]) for j in self.inputs[i]]
        honest = tuple(s for s in keep if all(not _has_partial(p) or p in m for p, m in zip(s.ins, made)))
        keep = honest or keep
        if not keep:
            raise ValueError(f"auto-sharding: no evenly divisible strategy for graph node {n.name!r} ({n.target})")
        return keep

    def _stack_strategies(self, i: int, n: torch.fx.Node) -> tuple:
        """``stack`` keeps any layout its parts share (a Shard at or after the new dim moves one
        dim on). DTensor's own rule offers only the one layout its first input has, which
        would leave the auto-sharder no choice for a stacked gradient."""
        parts = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else 0
        dim = dim % self.val[i].ndim
        replicated = self._norm((Replicate(),) * len(self.mesh_shape))
        first = tuple(self.opts[self.index[parts[0]]])
        shared = set(first + (replicated,))
        for a in parts[1:]:
            shared &= set(self.opts[self.index[a]]) | {replicated}
        found = []
        for pl in dict.fromkeys(first + (replicated,)):  # in the first part's order, so plans are stable
            if pl is None or pl not in shared:
                continue
            out = tuple(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= dim else p for p in pl)
            if _out_divides(self.val[i], out, self.mesh_shape):
                found.append(strategies.Strategy(out, (pl,) * len(parts)))
        if not found:
            raise ValueError(f"auto-sharding: the parts of {n.name!r} (aten.stack) share no layout")
        return tuple(found)

    def _region_strategy(self, n: torch.fx.Node):
        from shardfn.partition import local_map

        reg = local_map.region(n.args[-1])
        xs = [self.val[self.index[a]] for a in n.args[0]]

        def pls(specs, vals):
            return [
                self._norm(self._placements(s, v.ndim, where=f"sf.local_map at {n.name}")) for s, v in zip(specs, vals)
            ]

        if n.target is torch.ops.shardfn.local_region.default:
            ins = pls(reg.in_leaf_specs, xs)
            outs = pls(reg.out_leaf_specs, self.val[self.index[n]])
            return strategies.Strategy(tuple(outs), tuple(ins))
        outs_v = [self.val[self.index[a]] for a in n.args[1]]
        gs_v = [self.val[self.index[a]] for a in n.args[2]]
        ins = pls(reg.in_leaf_specs, xs) + pls(reg.out_leaf_specs, outs_v) + pls(reg.out_leaf_specs, gs_v)
        varying = {self.names.index(a) for s in reg.in_leaf_specs for a in s.axes() if a in self.names}
        grads = []
        for spec, v in zip(reg.in_leaf_specs, xs):
            pl = list(self._placements(spec, v.ndim, where="sf.local_map cotangent"))
            grads.append(
                self._norm(
                    tuple(Partial() if d in varying and isinstance(p, Replicate) else p for d, p in enumerate(pl))
                )
            )
        return strategies.Strategy(tuple(grads), tuple(ins))


def _node_args(n: torch.fx.Node) -> list[torch.fx.Node]:
    """Node inputs in pytree order of ``(args, kwargs)`` (duplicates kept)."""
    out: list = []
    map_arg((n.args, n.kwargs), lambda a: out.append(a))
    return out

def _has_tensor(val) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)

def _freeze(x):
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    return x

def _has_partial(pl) -> bool:
    return any(isinstance(p, Partial) for p in pl)

def _strided(pl) -> bool:
    """Placements the auto-sharder leaves out: strided shards, and partial max/min (only
    amax-style reductions make them; they would double every element-wise op's options)."""
    return pl is not None and any(
        strategies.is_strided(p) or (isinstance(p, Partial) and p.reduce_op not in ("sum", "avg")) for p in pl
    )

def _strided_out(out) -> bool:
    if out is None:
        return False
    if out and isinstance(out[0], (tuple, type(None))):
        return any(_strided(p) for p in out)
    return _strided(out)

def _out_divides(val, out, mesh_shape) -> bool:
    if out is None:
        return True
    if isinstance(val, torch.Tensor):
        return strategies.divides(val.shape, out, mesh_shape)
    return all(
        p is None or not isinstance(v, torch.Tensor) or strategies.divides(v.shape, p, mesh_shape)
        for v, p in zip(val, out)
    )
