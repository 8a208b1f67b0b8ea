"""Auto-sharding: choose every input spec and every node's placements with a cost model and an ILP.

The traced joint graph (forward, backward, optimizer) is one FX graph at global shapes. For each
node, torch's DTensor op strategies list every way the op can run (output and input placements);
each input may be stored in any placement that divides it. A 0/1 integer linear program picks
one strategy per node so that the estimated step time -- compute, partial-sum reductions and
redistributions between producers and consumers -- is smallest while the bytes per rank fit the
memory budget (Alpa / meta-pytorch autoparallel formulation, solved with HiGHS through
``scipy.optimize.milp``). Nodes that play the same role in repeated layers share one choice.

    traced = trace(train_step, (params, batch))
    result = solve(traced, mesh, memory_budget=40e9, hardware="h100")
    print(result.summary()); print(result.to_rules_yaml(arg_names=("params", "batch")))
    in_specs = apply(traced, result)     # imposes the plan on the graph (node.meta["sf_force"])

``sf.jit(..., in_specs=sf.AUTO)`` does trace -> solve -> apply -> lower in one call
(``partition.api.jit_auto``). See docs/autoshard.md for the formulation.
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np
import optree
import torch
import yaml
from torch.distributed.tensor import Partial, Replicate
from torch.fx.node import map_arg

from shardfn.core.units import format_bytes
from shardfn.partition import _strategies as strategies
from shardfn.partition import constrain as _constrain_ops  # noqa: F401  (registers shardfn::constrain)
from shardfn.partition import local_map as _local_map_ops  # noqa: F401  (registers shardfn::local_region)
from shardfn.partition.cost import CostModel, Transition, is_view
from shardfn.partition.hardware import Hardware, load_hardware
from shardfn.partition.spec import AUTO, P, broadcast_specs, entry_axes, to_placements, to_spec
from shardfn.partition.trace import Traced

aten = torch.ops.aten

_TIE_ROUNDS = 2        # neighbourhood radius (in graph hops) that must match for two nodes to tie
_LAGRANGE_STEPS = 10   # memory-price multipliers tried when branch and bound does not finish
_MEMORY_ROUNDS = 8     # at most this many memory cuts are added after the first solve
_US = 1e6              # the ILP's objective is in microseconds (keeps HiGHS' tolerances sane)
_GIB = float(1 << 30)  # and its memory rows in GiB
_TIE_BREAK = 1e-3      # an input's bytes / HBM bandwidth, times this, is added to its cost
_GAP = 1e-3            # HiGHS stops when the plan is within 0.1% of the best possible
_DISP = False          # HiGHS' log


class Cost(NamedTuple):
    """An estimated step on one rank. Seconds do not overlap (a conservative sum)."""

    compute_s: float    # FLOPs / peak + bytes / HBM bandwidth, over every op
    comm_s: float       # reducing partial sums: all-reduce, reduce-scatter
    reshard_s: float    # moving values between layouts: all-gather, all-to-all
    memory_bytes: int   # peak bytes per rank (inputs + live values)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s


class Reshard(NamedTuple):
    """A value redistributed on its way to one consumer (``arg``: index among its tensor inputs)."""

    producer: str
    consumer: str
    arg: int
    src: tuple
    dst: tuple
    transition: Transition


# ============================================================================ graph analysis


class _Problem:
    """The traced graph as an assignment problem: candidates, costs, tied classes, ILP matrices.

    Built once per (graph, mesh, hardware); :meth:`solve` runs for any fixed inputs and budget.
    """

    def __init__(self, traced: Traced, mesh, hardware: Hardware, *, tie_layers: bool):
        from shardfn.partition import rules

        rules.register_all()  # shardfn's own DTensor rules (CPU fused attention)
        t0 = time.perf_counter()
        self.traced = traced
        self.mesh = mesh
        # DTensor placements are over the device mesh's dims (size-1 axes have none)
        self.names = tuple(getattr(mesh, "dims", mesh.names))
        self.mesh_shape = tuple(mesh.axes[a] for a in self.names)
        self.dmesh = mesh.device_mesh
        self.model = CostModel(self.mesh_shape, hardware)
        gm = traced.graph_module
        self.nodes = [n for n in gm.graph.nodes if n.op != "output"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self._interned: dict = {}
        self._by_ids: dict = {}
        self._tables: dict = {}
        self._cache: dict = {}
        self._analyse()
        self._tie(tie_layers)
        self._build()
        self.build_s = time.perf_counter() - t0

    # -- per-node candidates -----------------------------------------------------------------
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
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or not is_view(n.target):
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
            hold = np.array([self.model.local_bytes(val, p) for p in opts]) / self.model.hardware.hbm_bandwidth
            return self._intern(tuple(strategies.Strategy(p, ()) for p in opts)), _TIE_BREAK * hold
        target = n.target
        if n.op == "get_attr" or not self.inputs[i]:
            out = replicated if isinstance(val, torch.Tensor) else tuple(replicated if isinstance(v, torch.Tensor) else None for v in val)
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
        else:
            found = self._dtensor_strategies(i, n, replicated)
        args, kwargs = map_arg((n.args, n.kwargs), lambda a: self.val[self.index[a]])
        compute = np.array([self.model.compute_time(target, args, kwargs, val, s.ins, s.out) if isinstance(target, torch._ops.OpOverload) else 0.0 for s in found])
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
            key = (n.target, _freeze(map_arg((tuple(args), n.kwargs), conv)), tuple(self.val[self.index[n]].shape) if isinstance(self.val[self.index[n]], torch.Tensor) else None)
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
            return strategies.TensorArg(self.val[j], [p for p in opts if p is not None and not _has_partial(p)] + [p for p in opts if p is not None and _has_partial(p)])

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

    def _region_strategy(self, n: torch.fx.Node):
        from shardfn.partition import local_map

        reg = local_map.region(n.args[-1])
        xs = [self.val[self.index[a]] for a in n.args[0]]

        def pls(specs, vals):
            return [self._norm(self._placements(s, v.ndim, where=f"sf.local_map at {n.name}")) for s, v in zip(specs, vals)]

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
            grads.append(self._norm(tuple(Partial() if d in varying and isinstance(p, Replicate) else p for d, p in enumerate(pl))))
        return strategies.Strategy(tuple(grads), tuple(ins))

    # -- tying repeated layers ---------------------------------------------------------------
    def _tie(self, tie_layers: bool) -> None:
        """Owners with the same local structure (op, shapes and constants within
        ``_TIE_ROUNDS`` hops, both directions) and the same candidates share one class."""
        owners = sorted(self.strats)
        if not tie_layers:
            self.cls = {o: c for c, o in enumerate(owners)}
        else:
            colour = self._colours()
            keys: dict = {}
            self.cls = {}
            for o in owners:
                n = self.nodes[o]
                key = ("own", o) if n.op == "placeholder" else (colour[o], id(self.strats[o]), np.round(self.obj[o] * _US, 6).tobytes())
                self.cls[o] = keys.setdefault(key, len(keys))
        self.n_classes = max(self.cls.values()) + 1 if self.cls else 0
        self.members: list[list[int]] = [[] for _ in range(self.n_classes)]
        for o, c in self.cls.items():
            self.members[c].append(o)
        self.rep = [m[0] for m in self.members]

    def _colours(self) -> list[int]:
        users: list[list[tuple[int, int]]] = [[] for _ in self.nodes]
        for i in range(len(self.nodes)):
            for k, j in enumerate(self.inputs[i]):
                users[j].append((i, k))
        for k, a in enumerate(_node_args(self.output)):
            users[self.index[a]].append((-1, k))
        colour = [hash(_base_colour(n, self.val[i])) for i, n in enumerate(self.nodes)]
        for _ in range(_TIE_ROUNDS):
            new = []
            for i, n in enumerate(self.nodes):
                ins = self.inputs[i]
                us = sorted((colour[u] if u >= 0 else -1, k) for u, k in users[i])
                new.append(hash((colour[i], tuple(colour[j] for j in ins), tuple(us))))
            colour = new
        return colour

    # -- the ILP -----------------------------------------------------------------------------
    def _build(self) -> None:
        """Objective and one-hot / edge-consistency constraints (fixed across solves)."""
        self.offset = np.zeros(self.n_classes + 1, dtype=np.int64)
        for c in range(self.n_classes):
            self.offset[c + 1] = self.offset[c] + len(self.strats[self.rep[c]])
        n_x = int(self.offset[-1])
        cost = np.zeros(n_x)
        for c, members in enumerate(self.members):
            cost[self.offset[c]:self.offset[c + 1]] += len(members) * self.obj[self.rep[c]] * _US
        self.forbid = np.zeros(n_x, dtype=bool)
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        data: list[np.ndarray] = []
        n_rows = 0
        # one-hot: sum_s x[c, s] = 1
        for c in range(self.n_classes):
            k = self.offset[c + 1] - self.offset[c]
            rows.append(np.full(k, n_rows))
            cols.append(np.arange(self.offset[c], self.offset[c + 1]))
            data.append(np.ones(k))
            n_rows += 1
        self.n_onehot = n_rows
        # edges, grouped by (producer class, value, consumer class, what the consumer reads)
        groups: dict = {}
        for v in list(self.strats) + list(self.follow):
            skip = self.follow[v][0] if v in self.follow else None
            cv = self.cls[self.owner[v]]
            for k, u in enumerate(self.inputs[v]):
                if k == skip:
                    continue  # a follower reads its followed input as it is (or pays inside obj)
                needs = self._intern_ids(self._needs(v, k))
                key = (self.cls[self.owner[u]], self._vsig(u), cv, id(needs))
                groups.setdefault(key, [u, cv, needs, 0])[3] += 1
        self.sinks = self._sinks()
        for u, target in self.sinks:
            if isinstance(target, int):  # mirrored output: must come back as the input is
                cv, needs = self.cls[target], self._intern_ids(tuple(s.out for s in self.strats[target]))
            else:
                cv, needs = None, (target,)
            key = (self.cls[self.owner[u]], self._vsig(u), cv, id(needs))
            groups.setdefault(key, [u, cv, needs, 0])[3] += 1
        y_cost: list[float] = []
        n_y = 0
        self.transport: list = []  # (producer class, its map, consumer class, its map, table in us)
        for u, cv, needs, mult in groups.values():
            cu = self.cls[self.owner[u]]
            src_opts = self.opts[u]
            src_map = self.out_map[u]
            dst_opts = self._distinct(needs)
            dst_index = {id(p): j for j, p in enumerate(dst_opts)}
            dst_map = np.array([dst_index[id(p)] for p in needs], dtype=np.int64)
            val = self.val[u]
            table = self._table(val, src_opts, dst_opts) * mult * _US
            xs_u = np.arange(self.offset[cu], self.offset[cu + 1])
            if cv is None or len(dst_opts) == 1:  # the need is fixed: linear in the producer's choice
                self._linear(cost, xs_u, table[src_map, 0])
                continue
            xs_v = np.arange(self.offset[cv], self.offset[cv + 1])
            if len(src_opts) == 1:  # the producer is fixed: linear in the consumer's choice
                self._linear(cost, xs_v, table[0, dst_map])
                continue
            # transport: y[a, b] >= 0 with rows summing to the producer's choice and columns to
            # the consumer's; only finite pairs get a variable
            finite = np.argwhere(np.isfinite(table))
            self.transport.append((cu, src_map, cv, dst_map, table))
            ids = n_x + n_y + np.arange(len(finite))
            y_cost.extend(table[finite[:, 0], finite[:, 1]].tolist())
            n_y += len(finite)
            for a in range(len(src_opts)):
                sel = ids[finite[:, 0] == a]
                xsel = xs_u[src_map == a]
                rows.append(np.full(len(sel) + len(xsel), n_rows))
                cols.append(np.concatenate([sel, xsel]))
                data.append(np.concatenate([np.ones(len(sel)), -np.ones(len(xsel))]))
                n_rows += 1
            for b in range(len(dst_opts)):
                sel = ids[finite[:, 1] == b]
                xsel = xs_v[dst_map == b]
                rows.append(np.full(len(sel) + len(xsel), n_rows))
                cols.append(np.concatenate([sel, xsel]))
                data.append(np.concatenate([np.ones(len(sel)), -np.ones(len(xsel))]))
                n_rows += 1
        self.n_x, self.n_y, self.n_rows = n_x, n_y, n_rows
        self.c = np.concatenate([cost, np.array(y_cost)])
        self.forbid |= ~np.isfinite(cost)
        self.c[: n_x][self.forbid] = 0.0
        self.rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        self.cols = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
        self.data = np.concatenate(data) if data else np.zeros(0)
        self.rhs = np.zeros(n_rows)
        self.rhs[: self.n_onehot] = 1.0
        self._liveness()

    def _table(self, val, src_opts: tuple, dst_opts: tuple) -> np.ndarray:
        """Transition seconds from each producer option to each consumer need."""
        key = (tuple(val.shape), val.dtype, id(src_opts), id(dst_opts))
        hit = self._tables.get(key)
        if hit is None:
            hit = np.array([[0.0 if a is b else self.model.transition(val, a, b).seconds for b in dst_opts]
                            for a in src_opts])
            self._tables[key] = hit
        return hit

    def _vsig(self, u: int) -> tuple:
        """What identifies value ``u`` within its owner's class: shape and placement map."""
        v = self.val[u]
        return (tuple(v.shape), v.dtype, id(self.opts[u]), self.out_map[u].tobytes())

    def _linear(self, cost: np.ndarray, xs: np.ndarray, per: np.ndarray) -> None:
        inf = ~np.isfinite(per)
        self.forbid[xs[inf]] = True
        cost[xs[~inf]] += per[~inf]

    def _sinks(self) -> list:
        """Per output leaf: (value index, what it must become). An output that mirrors an input
        (same path, shape and dtype: the new params of a train step) must come back in that
        input's placement; every other output is returned replicated."""
        out_nodes = list(_node_args(self.output))
        paths = [".".join(str(k) for k in p) for p in optree.treespec_paths(self.traced.out_treedef)]
        by_path = {p: ph for p, ph in zip(self.traced.in_paths, self.placeholders)}
        sinks = []
        for node, path in zip(out_nodes, paths):
            u = self.index[node]
            ph = by_path.get(path)
            val = self.val[u]
            if ph is not None and tuple(ph.meta["val"].shape) == tuple(val.shape) and ph.meta["val"].dtype == val.dtype:
                sinks.append((u, self.index[ph]))
            else:
                sinks.append((u, self._intern((Replicate(),) * len(self.mesh_shape))))
        return sinks

    # -- memory ------------------------------------------------------------------------------
    def _liveness(self) -> None:
        """Each value's lifetime [def, last use]; inputs and outputs live for the whole step;
        views are free but keep their base alive."""
        n = len(self.nodes)
        last = np.arange(n)
        for i in range(n):
            for j in self.inputs[i]:
                last[j] = max(last[j], i)
        for u, _ in self.sinks:
            last[u] = n
        for i in reversed(range(n)):
            node = self.nodes[i]
            if node.op == "call_function" and is_view(node.target) and self.inputs[i]:
                base = self.inputs[i][0]
                last[base] = max(last[base], last[i])
        for ph in self.placeholders:
            last[self.index[ph]] = n
        self.last = last
        self.holds = []  # value indices that own memory
        for i, node in enumerate(self.nodes):
            val = self.val[i]
            if not isinstance(val, torch.Tensor):
                continue
            if node.op == "call_function" and is_view(node.target):
                continue
            self.holds.append(i)
        self._bytes: dict[int, np.ndarray] = {}

    def value_bytes(self, i: int) -> np.ndarray:
        """Bytes per rank of value ``i`` under each of its owner's strategies."""
        hit = self._bytes.get(i)
        if hit is None:
            val = self.val[i]
            per_opt = np.array([self.model.local_bytes(val, p) for p in self.opts[i]], dtype=float)
            hit = self._bytes[i] = per_opt[self.out_map[i]]
        return hit

    def live_at(self, t: int) -> list[int]:
        return [i for i in self.holds if i <= t <= self.last[i]]

    def memory_row(self, t: int) -> np.ndarray:
        """Coefficients (GiB) of the live bytes at step ``t`` over the x variables."""
        row = np.zeros(self.n_x)
        for i in self.live_at(t):
            o = self.owner[i]
            c = self.cls[o]
            row[self.offset[c]:self.offset[c + 1]] += self.value_bytes(i) / _GIB
        return row

    def peak(self, choice: dict[int, int]) -> tuple[int, int]:
        """``(peak bytes, step index)`` under a choice of strategy per owner."""
        n = len(self.nodes)
        delta = np.zeros(n + 2)
        for i in self.holds:
            b = self.value_bytes(i)[choice[self.owner[i]]]
            delta[i] += b
            delta[self.last[i] + 1] -= b
        live = np.cumsum(delta)[: n + 1]
        t = int(np.argmax(live))
        return int(live[t]), t

    def reference_peaks(self) -> list[int]:
        """Where memory peaks under the all-replicated and under the most-sharded choice."""
        sizes = {o: np.zeros(len(st)) for o, st in self.strats.items()}
        for i in self.holds:
            sizes[self.owner[i]] += self.value_bytes(i)
        out = {self.peak({o: int(pick(v)) for o, v in sizes.items()})[1] for pick in (np.argmax, np.argmin)}
        return sorted(out)

    # -- solving -----------------------------------------------------------------------------
    def solve(self, fixed: list, budget: float | None, time_limit_s: float) -> "_Solution":
        from scipy.sparse import csr_matrix

        t0 = time.perf_counter()
        n_var = self.n_x + self.n_y
        ub = np.ones(n_var)
        ub[self.n_x:] = np.inf
        ub[: self.n_x][self.forbid] = 0
        for ph, path, spec in zip(self.placeholders, self.traced.in_paths, fixed):
            if spec is None:
                continue
            i = self.index[ph]
            c = self.cls[i]
            want = self._norm(self._placements(spec, self.val[i].ndim, where=f"fixed_specs for input {path!r}"))
            allowed = [s.out == want for s in self.strats[i]]
            if not any(allowed):
                raise ValueError(
                    f"fixed_specs for input {path!r}: {spec!r} does not divide its shape {tuple(self.val[i].shape)} "
                    f"over the mesh {dict(zip(self.names, self.mesh_shape))}; pick a spec whose axes divide each dim"
                )
            ub[self.offset[c]:self.offset[c + 1]][~np.array(allowed)] = 0
        a_eq = csr_matrix((self.data, (self.rows, self.cols)), shape=(self.n_rows, n_var))
        cuts: list[int] = self.reference_peaks() if budget is not None else []
        last = None
        while True:
            mem = None
            if cuts:
                mem = csr_matrix(np.hstack([np.array([self.memory_row(t) for t in cuts]), np.zeros((len(cuts), self.n_y))]))
            left = time_limit_s - (time.perf_counter() - t0)
            sol = self._solve_once(a_eq, mem, None if budget is None else budget / _GIB, ub, left)
            sol.solve_s = time.perf_counter() - t0
            sol.n_cuts = len(cuts)
            if sol.choice is None and last is not None and sol.status == "time_limit":
                # out of time re-solving with a new memory cut: the last plan, which may peak
                # above the budget where the cut was (its cost says how much)
                last.status, last.solve_s = "time_limit", sol.solve_s
                return last
            if sol.choice is None or budget is None or len(cuts) >= _MEMORY_ROUNDS + 2:
                return sol
            last = sol
            peak, t = self.peak(sol.choice)
            if peak <= budget * (1 + 1e-9) or t in cuts:
                return sol
            cuts.append(t)  # the true peak is elsewhere: constrain it there too and solve again

    def _solve_once(self, a_eq, mem, mem_ub, ub, left: float) -> "_Solution":
        """The LP relaxation first -- when it is integral (usual: edge-consistency is a
        transport polytope) it is the ILP optimum -- else HiGHS' branch and bound."""
        from scipy.optimize import Bounds, LinearConstraint, linprog, milp

        t0 = time.perf_counter()
        n_var = self.n_x + self.n_y
        bounds = np.stack([np.zeros(n_var), ub], axis=1)
        lp = linprog(self.c, A_eq=a_eq, b_eq=self.rhs, A_ub=mem,
                     b_ub=None if mem is None else np.full(mem.shape[0], mem_ub), bounds=bounds,
                     method="highs", options={"time_limit": max(0.5, left), "disp": _DISP})
        if lp.status == 2:
            return _Solution(None, "infeasible", 0.0, lp.message)
        if lp.x is None:
            return _Solution(None, "time_limit", 0.0, lp.message)
        x = lp.x[: self.n_x]
        if np.all(np.minimum(x, 1 - x) < 1e-6):
            return _Solution(self._decode(lp.x), "optimal", 0.0, "LP relaxation is integral", objective=lp.fun / _US,
                             bound=lp.fun / _US)
        bound = lp.fun
        deadline = t0 + left
        integrality = np.zeros(n_var)
        integrality[: self.n_x] = 1
        constraints = [LinearConstraint(a_eq, self.rhs, self.rhs)]
        if mem is not None:
            constraints.append(LinearConstraint(mem, -np.inf, mem_ub))
        # A fractional LP comes from the memory rows (a knapsack): branch and bound gets 70% of the
        # time; if it does not finish, memory is priced into the objective at a multiplier,
        # bisected until the plan fits, and the better of the two plans is kept.
        share = 1.0 if mem is None else 0.7
        res = milp(self.c, integrality=integrality, bounds=Bounds(np.zeros(n_var), ub), constraints=constraints,
                   options={"time_limit": max(0.5, share * (deadline - time.perf_counter())), "disp": _DISP,
                            "mip_rel_gap": _GAP})
        found = None if res.x is None else (self._decode(res.x), res.fun)
        if res.status == 0 and found is not None:
            return _Solution(found[0], "optimal", 0.0, res.message, objective=found[1] / _US, bound=bound / _US)
        if res.status == 2:
            return _Solution(None, "infeasible", 0.0, res.message)
        priced = self._lagrange(a_eq, mem, mem_ub, bounds, bound, deadline) if mem is not None else None
        if priced is not None and (found is None or priced[1] < found[1]):
            found = priced
        if found is None:  # no plan in time: round the LP (each class takes its largest strategy)
            return _Solution(self._decode(lp.x), "time_limit", 0.0, "rounded LP relaxation: " + res.message,
                             bound=bound / _US)
        return _Solution(found[0], "time_limit", 0.0, res.message, objective=found[1] / _US, bound=bound / _US)

    def _lagrange(self, a_eq, mem, mem_ub, bounds, bound: float, deadline: float):
        """``(choice, objective)`` of the best plan that fits the memory rows, found by pricing
        memory at multipliers ``lam`` (us per GiB) and bisecting ``lam``; None if none fits."""
        from scipy.optimize import linprog

        weight = np.asarray(mem.sum(axis=0)).ravel()
        lam = max(abs(bound), 1.0) / max(mem_ub, 1e-9)
        lo, hi, best = 0.0, None, None
        for _ in range(_LAGRANGE_STEPS):
            left = deadline - time.perf_counter()
            if left <= 0.5:
                break
            res = linprog(self.c + lam * weight, A_eq=a_eq, b_eq=self.rhs, bounds=bounds, method="highs",
                          options={"time_limit": left, "disp": _DISP})
            if res.x is None:
                break
            choice = self._decode(res.x)
            x = self._onehot(choice)
            fits = bool(np.all(mem @ x <= mem_ub * (1 + 1e-9)))
            if fits:
                value = self.objective(choice)
                if best is None or value < best[1]:
                    best = (choice, value)
                hi = lam
            else:
                lo = lam
            lam = lam * 8 if hi is None else (lo + hi) / 2
        return best

    def replicated_choice(self) -> dict[int, int]:
        """Each owner's all-replicated strategy (its first strategy if it has none)."""
        choice = {}
        for c, members in enumerate(self.members):
            strats = self.strats[self.rep[c]]
            s = next((j for j, st in enumerate(strats) if not _sharded(st.out) and not any(_sharded(p) for p in st.ins)), 0)
            for o in members:
                choice[o] = s
        return choice

    def _onehot(self, choice: dict) -> np.ndarray:
        x = np.zeros(self.n_x + self.n_y)
        for c, rep in enumerate(self.rep):
            x[self.offset[c] + choice[rep]] = 1.0
        return x

    def objective(self, choice: dict) -> float:
        """The ILP objective (us) of a plan: compute and linear costs plus every edge's table."""
        s = np.array([choice[rep] for rep in self.rep], dtype=np.int64)
        value = float(self.c[self.offset[:-1] + s].sum())
        for cu, src_map, cv, dst_map, table in self.transport:
            value += table[src_map[s[cu]], dst_map[s[cv]]]
        return value

    def _decode(self, x: np.ndarray) -> dict[int, int]:
        choice = {}
        for c, members in enumerate(self.members):
            s = int(np.argmax(x[self.offset[c]:self.offset[c + 1]]))
            for o in members:
                choice[o] = s
        return choice

    # -- evaluating a choice ------------------------------------------------------------------
    def out_placement(self, i: int, choice: dict[int, int]):
        return self.opts[i][self.out_map[i][choice[self.owner[i]]]]

    def computed(self) -> list[int]:
        """Owners and followers: the nodes that run an op under a strategy, in graph order."""
        return sorted(list(self.strats) + list(self.follow))

    def moves(self, choice: dict[int, int]) -> list[Reshard]:
        """Every (value, consumer input) whose placement must change, under ``choice``."""
        out = []
        for v in self.computed():
            need = self.strategy_of(v, choice).ins
            for k, u in enumerate(self.inputs[v]):
                src = self.out_placement(u, choice)
                if src != need[k]:
                    tr = self.model.transition(self.val[u], src, need[k])
                    out.append(Reshard(self.nodes[u].name, self.nodes[v].name, k, src, need[k], tr))
        return out

    def evaluate(self, choice: dict[int, int]) -> tuple[Cost, list[Reshard], list]:
        compute = 0.0
        for v in self.computed():
            if v in self.strats:
                compute += float(self.node_compute[v][choice[v]])
            else:
                k0, _ = self.follow[v]
                compute += float(self.node_compute[v][self.out_map[self.inputs[v][k0]][choice[self.owner[v]]]])
        moves = self.moves(choice)
        comm = sum(m.transition.comm_s for m in moves)
        reshard = sum(m.transition.reshard_s for m in moves)
        sink_moves = []
        for j, (u, target) in enumerate(self.sinks):
            dst = self.out_placement(target, choice) if isinstance(target, int) else target
            src = self.out_placement(u, choice)
            tr = self.model.transition(self.val[u], src, dst)
            comm += tr.comm_s
            reshard += tr.reshard_s
            sink_moves.append(dst)
            if src != dst:
                moves.append(Reshard(self.nodes[u].name, "output", j, src, dst, tr))
        memory, _ = self.peak(choice)
        return Cost(compute, comm, reshard, memory), moves, sink_moves


@dataclass
class _Solution:
    choice: dict | None
    status: str
    solve_s: float
    message: str
    objective: float = math.nan   # the ILP objective (seconds) of choice
    bound: float = math.nan       # the LP relaxation's (a lower bound on any plan's)
    n_cuts: int = 0


# ============================================================================ the result


@dataclass
class AutoResult:
    """A chosen layout and its estimated cost.

    Attributes:
        in_specs: one ``P`` per input leaf (in ``traced.in_paths`` order).
        out_specs: one ``P`` per output leaf.
        placements: node name -> DTensor placements of its output (a tuple of them for
            multi-output nodes).
        reshards: every value redistributed between its producer and one consumer.
        cost: the estimated step (compute, comm, reshard seconds; peak bytes per rank).
        status: ``"optimal"``, or ``"time_limit"`` when HiGHS stopped at ``time_limit_s`` with
            the best layout found so far.
        stats: sizes and timings (nodes, classes, variables, build and solve seconds).
        mesh_axes / mesh_dims: the mesh's axes, and those with a device-mesh dim (the axes
            DTensor placements are indexed by).

    Example:
        result = solve(traced, mesh, memory_budget=16e9)
        print(result.summary())
    """

    in_specs: list
    out_specs: list
    placements: dict
    reshards: list
    cost: Cost
    status: str
    stats: dict
    mesh_axes: dict
    mesh_dims: tuple
    hardware: str
    memory_budget: float | None
    arg_names: tuple | None = None
    _problem: Any = field(default=None, repr=False)
    _choice: dict = field(default=None, repr=False)
    _time_limit_s: float = 10.0

    def in_specs_tree(self) -> Any:
        """``in_specs`` as a pytree shaped like the arguments (for ``sf.jit(in_specs=...)``)."""
        return optree.tree_unflatten(self._problem.traced.in_treedef, list(self.in_specs))

    def paths(self) -> list[str]:
        """Input paths with argument names (``params.layers.wq``) when ``arg_names`` were given."""
        return [_pretty(p, self.arg_names) for p in self._problem.traced.in_paths]

    def collectives(self) -> list[dict]:
        """The collectives the plan implies, per step per rank, as ``comm_report()`` rows."""
        total: dict = {}
        names = list(self.mesh_dims)
        for r in self.reshards:
            for op, dim, size in r.transition.collectives:
                acc = total.setdefault((op, names[dim]), [0, 0])
                acc[0] += int(size)
                acc[1] += 1
        return [{"op": op, "axis": axis, "bytes": b, "count": c} for (op, axis), (b, c) in sorted(total.items())]

    def summary(self) -> str:
        """A few lines: status, estimated step, memory, the chosen input specs."""
        c = self.cost
        budget = "none" if self.memory_budget is None else format_bytes(self.memory_budget)
        status = self.status if self.status == "optimal" else f"{self.status} ({self.stats.get('message', '')})"
        lines = [
            f"auto-sharding on mesh {_fmt_mesh(self.mesh_axes)} ({self.hardware}): {status}",
            f"  step {_fmt_s(c.step_s)} = compute {_fmt_s(c.compute_s)} + comm {_fmt_s(c.comm_s)} "
            f"+ reshard {_fmt_s(c.reshard_s)}; memory {format_bytes(c.memory_bytes)} per rank (budget {budget})",
            f"  {self.stats['nodes']} nodes in {self.stats['classes']} classes, {self.stats['variables']} variables; "
            f"build {self.stats['build_s']:.2f} s, solve {self.stats['solve_s']:.2f} s",
        ]
        for path, spec in zip(self.paths(), self.in_specs):
            lines.append(f"  {path}: {spec!r}")
        return "\n".join(lines)

    def to_rules_yaml(self, arg_names: Sequence[str] | None = None) -> str:
        """The chosen input specs as YAML, one line per input path: ``params.w1: [null, tp]``.

        Read it back with :func:`load_specs_yaml` and pass it as ``fixed_specs`` (or turn it
        into ``in_specs``) to reuse the plan.
        """
        names = tuple(arg_names) if arg_names is not None else self.arg_names
        c = self.cost
        lines = [
            f"# shardfn auto-sharding plan: mesh {_fmt_mesh(self.mesh_axes)} on {self.hardware} ({self.status})",
            f"# estimated step {_fmt_s(c.step_s)}, memory {format_bytes(c.memory_bytes)} per rank",
        ]
        for path, spec in zip(self._problem.traced.in_paths, self.in_specs):
            key = _yaml_key(_pretty(path, names))
            entries = []
            for e in spec:
                if e is None:
                    entries.append("null")
                elif isinstance(e, tuple):
                    entries.append("[" + ", ".join(e) + "]")
                else:
                    entries.append(e)
            lines.append(f"{key}: [{', '.join(entries)}]")
        return "\n".join(lines) + "\n"

    def compare(self, presets: dict) -> list[dict]:
        """Rows ``{name, step_s, compute_s, comm_s, reshard_s, memory_bytes, fits, status}``
        for this result (``name="auto"``) and each preset.

        A preset is anything ``fixed_specs`` accepts (usually the ``in_specs`` of a textbook
        layout); its cost is the same model's optimum with those inputs fixed, under the same
        memory budget (``fits=False``: it only fits without the budget).
        """
        rows = [_row("auto", self.cost, self.status, True)]
        prob = self._problem
        for name, specs in presets.items():
            fixed = _resolve_fixed(specs, prob.traced, self.arg_names)
            try:
                sol = prob.solve(fixed, self.memory_budget, self._time_limit_s)
            except ValueError as e:
                rows.append({"name": name, "status": f"invalid: {e}", "fits": False})
                continue
            fits = True
            if sol.choice is None and sol.status == "infeasible":
                sol = prob.solve(fixed, None, self._time_limit_s)
                fits = False
            if sol.choice is None:
                rows.append({"name": name, "status": sol.status, "fits": False})
                continue
            cost, _, _ = prob.evaluate(sol.choice)
            if self.memory_budget is not None and cost.memory_bytes > self.memory_budget:
                fits = False
            rows.append(_row(name, cost, sol.status, fits))
        return rows

    def comparison_table(self, presets: dict) -> str:
        """:meth:`compare` as a text table.

            print(result.comparison_table(presets(mesh, args, param_axes)))
        """
        rows = self.compare(presets)
        head = f"{'layout':<10} {'step':>10} {'compute':>10} {'comm':>10} {'reshard':>10} {'memory/rank':>12}  status"
        lines = [head, "-" * len(head)]
        for r in rows:
            if "step_s" not in r:
                lines.append(f"{r['name']:<10} {'-':>10} {'-':>10} {'-':>10} {'-':>10} {'-':>12}  {r['status']}")
                continue
            note = r["status"] + ("" if r["fits"] else ", over the memory budget")
            lines.append(
                f"{r['name']:<10} {_fmt_s(r['step_s']):>10} {_fmt_s(r['compute_s']):>10} {_fmt_s(r['comm_s']):>10} "
                f"{_fmt_s(r['reshard_s']):>10} {format_bytes(r['memory_bytes']):>12}  {note}"
            )
        return "\n".join(lines)


def _row(name, cost: Cost, status, fits) -> dict:
    return {"name": name, "step_s": cost.step_s, "compute_s": cost.compute_s, "comm_s": cost.comm_s,
            "reshard_s": cost.reshard_s, "memory_bytes": cost.memory_bytes, "fits": fits, "status": status}


# ============================================================================ public entry points


def solve(
    traced: Traced,
    mesh,
    *,
    memory_budget: float | None = None,
    hardware: "str | Hardware" = "h100",
    fixed_specs: Any = None,
    time_limit_s: float = 10.0,
    tie_layers: bool = True,
    arg_names: Sequence[str] | None = None,
) -> AutoResult:
    """Choose input specs and node placements for ``traced`` on ``mesh``.

    Args:
        traced: ``shardfn.partition.trace.trace(fn, args)`` (global shapes, fake tensors).
        mesh: a ``shardfn.Mesh``; ``Mesh(..., fake=True)`` plans without a process group.
        memory_budget: bytes per rank; default the hardware's HBM. ``math.inf``: no limit.
        hardware: a profile name (``"h100"``, ``"b200"``, ...), a YAML path or a ``Hardware``.
        fixed_specs: inputs whose spec is given: a dict ``{path: P}`` (a path or a path prefix,
            ``"params.w1"`` or ``"0.w1"``; see ``to_rules_yaml``), or a pytree prefix of the
            arguments with ``P`` leaves and ``sf.AUTO`` where the solver chooses.
        time_limit_s: HiGHS' time limit; when hit, the best layout found so far is returned
            and ``result.status == "time_limit"``.
        tie_layers: nodes with the same structure (repeated layers) share one choice, so a
            32-layer model costs about as much to solve as one layer.
        arg_names: names of the positional arguments for paths (``("params", "batch")``).

    Example:
        result = solve(trace(step, (params, x)), sf.Mesh({"dp": 2, "tp": 2}, fake=True))
        step = sf.jit(step, mesh, in_specs=result.in_specs_tree())
    """
    if not hasattr(mesh, "device_mesh"):
        raise TypeError(f"mesh must be a shardfn Mesh (sf.Mesh({{...}}, fake=True) to plan); got {type(mesh).__name__}")
    hw = load_hardware(hardware)
    budget = hw.hbm_bytes if memory_budget is None else float(memory_budget)
    if budget == math.inf:
        budget = None
    arg_names = tuple(arg_names) if arg_names is not None else None
    prob = _Problem(traced, mesh, hw, tie_layers=tie_layers)
    fixed = _resolve_fixed(fixed_specs, traced, arg_names)
    sol = _solve_on_rank_zero(prob, mesh, lambda: prob.solve(fixed, budget, time_limit_s))
    if sol.choice is None:
        if sol.status == "infeasible":
            smallest = sum(int(prob.value_bytes(prob.index[ph]).min()) for ph in prob.placeholders)
            raise ValueError(
                f"auto-sharding: no layout fits memory_budget={format_bytes(budget)} per rank on mesh "
                f"{_fmt_mesh(mesh.axes)}; the inputs alone need at least {format_bytes(smallest)} per rank, and the "
                f"step's activations and gradients come on top. Raise memory_budget, use a larger mesh, or "
                f"shrink the batch or the sequence"
            )
        # HiGHS had no plan at all in time: run everything replicated, and say so
        sol = _Solution(prob.replicated_choice(), "time_limit", sol.solve_s,
                        f"no plan within time_limit_s={time_limit_s}, so everything is replicated; raise it ({sol.message})")
    return _result(prob, sol, hw, budget, arg_names, time_limit_s)


def _solve_on_rank_zero(prob: "_Problem", mesh, solve_fn) -> "_Solution":
    """On a real multi-process mesh, rank 0 solves and broadcasts its plan: every rank must run
    the same plan, and a time limit could end the search at different plans on different ranks."""
    import torch.distributed as dist

    if getattr(mesh, "fake", True) or not dist.is_initialized() or dist.get_world_size() == 1:
        return solve_fn()
    payload = [solve_fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _result(prob: _Problem, sol: _Solution, hw: Hardware, budget, arg_names, time_limit_s) -> AutoResult:
    cost, moves, sink_pl = prob.evaluate(sol.choice)
    in_specs = []
    for ph in prob.placeholders:
        i = prob.index[ph]
        in_specs.append(to_spec(prob.out_placement(i, sol.choice), prob.val[i].ndim, prob.names))
    out_specs = [to_spec(pl, prob.val[u].ndim, prob.names) for pl, (u, _) in zip(sink_pl, prob.sinks)]
    placements = {n.name: prob.out_placement(i, sol.choice) for i, n in enumerate(prob.nodes) if i not in prob.opaque}
    stats = {
        "nodes": len(prob.nodes), "classes": prob.n_classes, "variables": prob.n_x + prob.n_y,
        "constraints": prob.n_rows, "memory_cuts": sol.n_cuts, "build_s": prob.build_s, "solve_s": sol.solve_s,
        "objective_s": sol.objective, "lower_bound_s": sol.bound, "message": sol.message,
    }
    return AutoResult(in_specs, out_specs, placements, moves, cost, sol.status, stats, dict(prob.mesh.axes),
                      prob.names, hw.name, budget, arg_names, prob, sol.choice, time_limit_s)


def apply(traced: Traced, result: AutoResult) -> list:
    """Impose ``result`` on ``traced``'s graph and return its ``in_specs`` (one ``P`` per leaf).

    Every node gets ``node.meta["sf_force"]`` (its chosen output placements), and each value
    that must be redistributed for a consumer goes through a new ``aten.alias`` node forced to
    the placement that consumer's strategy reads, so propagation runs exactly the plan.

        in_specs = apply(traced, result)
        lowered = lower(traced, mesh, in_placements, out_placements)
    """
    prob = result._problem
    if prob is None or prob.traced is not traced:
        raise ValueError("apply(traced, result): result was solved for another traced graph; solve(traced, ...) first")
    gm = traced.graph_module
    if gm.meta.get("sf_auto_applied"):
        raise ValueError("this graph already carries an auto-sharding plan; trace the function again to apply another")
    choice = result._choice
    for i, n in enumerate(prob.nodes):
        if isinstance(prob.val[i], torch.Tensor):
            n.meta["sf_force"] = prob.out_placement(i, choice)
    graph = gm.graph
    nodes = {n.name: n for n in prob.nodes}
    by_consumer: dict[str, dict[int, Reshard]] = {}
    for m in result.reshards:
        if m.consumer != "output":
            by_consumer.setdefault(m.consumer, {})[m.arg] = m
    for name, moves in by_consumer.items():
        consumer = nodes[name]
        replace = {}
        for k, m in moves.items():
            with graph.inserting_before(consumer):
                alias = graph.call_function(aten.alias.default, (nodes[m.producer],))
            alias.meta["val"] = nodes[m.producer].meta.get("val")
            alias.meta["sf_force"] = m.dst
            alias.meta["sf_reshard"] = True
            replace[k] = alias
        counter = iter(range(len(prob.inputs[prob.index[consumer]])))

        def swap(a, replace=replace, counter=counter):
            return a if prob.index[a] in prob.opaque else replace.get(next(counter), a)

        consumer.args, consumer.kwargs = map_arg((consumer.args, consumer.kwargs), swap)
    gm.meta["sf_auto_applied"] = True
    graph.lint()
    gm.recompile()
    return list(result.in_specs)


# ============================================================================ presets and YAML


def preset_rules(kind: str, mesh) -> dict:
    """Logical-axis rules of a textbook layout over every axis of ``mesh``.

    ``dp``: batch split, weights replicated. ``fsdp``: also every weight's ``embed`` dim split
    (ZeRO-3). ``tp``: Megatron column-then-row (``heads``, ``kv_heads``, ``mlp``, ``expert_mlp``),
    batch replicated. ``fsdp_tp``: the last mesh axis does tp, the others fsdp.

        preset_rules("fsdp_tp", sf.Mesh({"dp": 4, "tp": 2}, fake=True))
    """
    axes = [a for a, s in mesh.axes.items() if s > 1] or list(mesh.axes)
    every = axes[0] if len(axes) == 1 else list(axes)
    tp_dims = ("heads", "kv_heads", "mlp", "expert_mlp")
    if kind == "dp":
        return {"batch": every}
    if kind == "fsdp":
        return {"batch": every, "embed": every}
    if kind == "tp":
        return {d: every for d in tp_dims}
    if kind == "fsdp_tp":
        if len(axes) < 2:
            raise ValueError(f"preset fsdp_tp needs a mesh with two axes of size > 1; got {_fmt_mesh(mesh.axes)}")
        data = axes[0] if len(axes) == 2 else list(axes[:-1])
        return {"batch": data, "embed": data, **{d: axes[-1] for d in tp_dims}}
    raise ValueError(f"unknown preset {kind!r}; valid presets are dp, fsdp, tp, fsdp_tp")


def presets(mesh, args: tuple, param_axes: Any, *, params_argnum: int = 0, batch_argnums: Sequence[int] = (-1,),
            kinds: Sequence[str] = ("dp", "fsdp", "tp", "fsdp_tp")) -> dict:
    """``{name: in_specs}`` of textbook layouts for a train step's arguments.

    ``args[params_argnum]`` gets specs from ``param_axes`` (a tree of logical-axis tuples); any
    subtree of another argument shaped like the params (optimizer moments) takes the same specs;
    batch arguments split dim 0 as the rules' ``batch`` says; everything else is replicated.
    A dim keeps only the leading axes whose sizes divide it (a batch of 8 on a 64-device mesh
    splits over the first axis of 8). Presets that need more mesh axes than there are are left out.

        table = result.comparison_table(presets(mesh, (params, opt_state, batch), model.param_axes(cfg)))
    """
    from shardfn.partition.layouts import state_specs
    from shardfn.partition.spec import specs_from_rules

    from shardfn.core.pytree import tree_map

    out = {}
    n = len(args)
    batch = {b % n for b in batch_argnums}
    for kind in kinds:
        try:
            rules = preset_rules(kind, mesh)
        except ValueError:
            continue
        pspecs = specs_from_rules(param_axes, {k: v for k, v in rules.items() if k != "batch"}, mesh.axes)
        pspecs = tree_map(lambda spec, x: _fit(spec, x.shape, mesh.axes), pspecs, args[params_argnum],
                          is_leaf=lambda v: isinstance(v, P))
        target = rules.get("batch")
        names = entry_axes(target)
        specs = []
        for i, a in enumerate(args):
            if i == params_argnum % n:
                specs.append(pspecs)
            elif i in batch:
                specs.append(tree_map(lambda x: _fit(P(tuple(names)) if names else P(), x.shape, mesh.axes), a))
            else:
                specs.append(state_specs(a, args[params_argnum], pspecs))
        out[kind] = tuple(specs)
    return out


def _fit(spec: P, shape, axis_sizes: dict) -> P:
    """``spec`` keeping, per dim, the leading axes whose product divides that dim."""
    entries = []
    for dim, entry in enumerate(spec):
        kept, size = [], 1
        for name in entry_axes(entry):
            if dim < len(shape) and shape[dim] % (size * axis_sizes[name]) == 0:
                kept.append(name)
                size *= axis_sizes[name]
        entries.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def load_specs_yaml(path_or_text: "str | Path") -> dict:
    """``{path: P}`` from a file written by :meth:`AutoResult.to_rules_yaml` (or its text).

        fixed = load_specs_yaml("plan.yaml"); result = solve(traced, mesh, fixed_specs=fixed)
    """
    text = str(path_or_text)
    if "\n" not in text and Path(text).is_file():
        text = Path(text).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"a specs file maps input paths to lists of axes; got {type(data).__name__}")
    out = {}
    for path, entries in data.items():
        if not isinstance(entries, list):
            raise ValueError(f"specs file: {path}: expected a list with one entry per dim (null, an axis or a list of axes), got {entries!r}")
        out[str(path)] = P(*[tuple(e) if isinstance(e, list) else e for e in entries])
    return out


def _resolve_fixed(fixed_specs: Any, traced: Traced, arg_names) -> list:
    """One entry per input leaf: placements to fix, or None (the solver chooses)."""
    n = len(traced.in_paths)
    if fixed_specs is None:
        return [None] * n
    if isinstance(fixed_specs, dict) and all(isinstance(k, str) for k in fixed_specs):
        specs: list = [None] * n
        used = set()
        for i, path in enumerate(traced.in_paths):
            pretty = _pretty(path, arg_names)
            best = None
            for key in fixed_specs:
                for cand in (path, pretty):
                    if cand == key or cand.startswith(key + "."):
                        if best is None or len(key) > len(best):
                            best = key
            if best is not None:
                specs[i] = fixed_specs[best]
                used.add(best)
        unknown = sorted(set(fixed_specs) - used)
        if unknown:
            shown = [_pretty(p, arg_names) for p in traced.in_paths]
            raise ValueError(f"fixed_specs: no input at path(s) {unknown}; the inputs are {shown}")
    else:
        tree = optree.tree_unflatten(traced.in_treedef, list(traced.in_meta))
        specs = broadcast_specs(fixed_specs, tree, what="fixed_specs")
    return [None if spec is None or spec is AUTO else spec for spec in specs]


# ============================================================================ helpers


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


def _base_colour(n: torch.fx.Node, val) -> tuple:
    """What a node is, without which layer it belongs to: op, shapes, constant arguments (the
    layer index of ``select`` and of ``select_backward`` is left out; a local_map region by
    its specs)."""
    shapes = tuple((tuple(v.shape), v.dtype) for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor))
    if n.op == "placeholder":
        return ("placeholder", n.name, shapes)
    args = list(n.args)
    if n.target is aten.select.int and len(args) > 2:
        args[2] = "?"
    elif n.target is aten.select_backward.default and len(args) > 3:
        args[3] = "?"
    elif n.target in (torch.ops.shardfn.local_region.default, torch.ops.shardfn.local_region_backward.default):
        from shardfn.partition import local_map

        reg = local_map.region(args[-1])
        args[-1] = repr((reg.in_leaf_specs, reg.out_leaf_specs))
    consts = tuple(repr(a) for a in args if not isinstance(a, torch.fx.Node) and not _has_node(a))
    return (n.op, str(n.target), shapes, consts, tuple(sorted((k, repr(v)) for k, v in n.kwargs.items() if not _has_node(v))))


def _has_node(a) -> bool:
    found = []
    map_arg(a, lambda x: found.append(x))
    return bool(found)


def _sharded(pl) -> bool:
    """True when placements (or a tuple of them) split or partially sum anything."""
    if pl is None:
        return False
    if pl and isinstance(pl[0], (tuple, type(None))):
        return any(_sharded(p) for p in pl)
    return any(not isinstance(p, Replicate) for p in pl)


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
    return all(p is None or not isinstance(v, torch.Tensor) or strategies.divides(v.shape, p, mesh_shape) for v, p in zip(val, out))


def _pretty(path: str, arg_names) -> str:
    head, _, rest = path.partition(".")
    if arg_names and head.isdigit() and int(head) < len(arg_names):
        head = arg_names[int(head)]
    return f"{head}.{rest}" if rest else head


def _yaml_key(path: str) -> str:
    try:
        if yaml.safe_load(f"{path}: 0") == {path: 0}:
            return path
    except yaml.YAMLError:
        pass
    return '"' + path.replace('"', '\\"') + '"'


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _fmt_mesh(axes: dict) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in axes.items()) + ")"
