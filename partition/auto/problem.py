"""Auto-sharding, part 2: the assignment problem over the candidates -- tied classes of repeated
layers, the ILP's objective and edge-consistency constraints, liveness and memory rows -- and the
cost of any choice.

A 0/1 variable per (class, strategy) picks one strategy per tied class of owner nodes; a
transport variable per (producer option, consumer need) prices each redistribution. The solver
(``auto.ilp``) minimises the step time under the memory budget.

    prob = Problem(traced, mesh, load_hardware("h100"), tie_layers=True)
    cost, reshards, out_placements = prob.evaluate(prob.replicated_choice())
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import optree
import torch
from torch.distributed.tensor import Replicate
from torch.fx.node import map_arg

from shardfn.partition.auto.candidates import Candidates, _node_args
from shardfn.partition.cost.hardware import Hardware
from shardfn.partition.cost.model import Transition
from shardfn.partition.spmd.fx import is_view
from shardfn.partition.spmd.trace import Traced

aten = torch.ops.aten

_TIE_ROUNDS = 2        # neighbourhood radius (in graph hops) that must match for two nodes to tie
_US = 1e6              # the ILP's objective is in microseconds (keeps HiGHS' tolerances sane)
_GIB = float(1 << 30)  # and its memory rows in GiB


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


class Problem(Candidates):
    """The traced graph as an assignment problem: candidates, costs, tied classes, ILP matrices.

    Built once per (graph, mesh, hardware); ``auto.ilp.solve_problem`` runs for any fixed inputs
    and budget.
    """

    def __init__(self, traced: Traced, mesh, hardware: Hardware, *, tie_layers: bool, cost_model=None):
        t0 = time.perf_counter()
        super().__init__(traced, mesh, hardware, cost_model)
        self._tables: dict = {}
        self._tie(tie_layers)
        self._build()
        self.build_s = time.perf_counter() - t0

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
                key = (
                    ("own", o)
                    if n.op == "placeholder"
                    else (colour[o], id(self.strats[o]), np.round(self.obj[o] * _US, 6).tobytes())
                )
                self.cls[o] = keys.setdefault(key, len(keys))
        self.n_classes = max(self.cls.values()) + 1 if self.cls else 0
        self.members: list[list[int]] = [[] for _ in range(self.n_classes)]
        for o, c in self.cls.items():
            self.members[c].append(o)
        self.rep = [m[0] for m in self.members]

    def _colours(self) -> list[int]:
        users: list[list[tuple[int, int]]] = [[] for _ in self.nodes]
        for i in range(len(self.nodes)):
            stacked = self.nodes[i].target is aten.stack.default  # a stacked gradient: its parts are alike
            for k, j in enumerate(self.inputs[i]):
                users[j].append((i, 0 if stacked else k))
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
            # sum_b y[a, b] = x_u[a] for each producer option a, sum_a y[a, b] = x_v[b] for each need b
            for side, xs, xmap, n_opts in ((0, xs_u, src_map, len(src_opts)), (1, xs_v, dst_map, len(dst_opts))):
                for a in range(n_opts):
                    sel, xsel = ids[finite[:, side] == a], xs[xmap == a]
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

    def replicated_choice(self) -> dict[int, int]:
        """Each owner's all-replicated strategy (its first strategy if it has none)."""
        choice = {}
        for c, members in enumerate(self.members):
            strats = self.strats[self.rep[c]]
            s = next(
                (j for j, st in enumerate(strats) if not _sharded(st.out) and not any(_sharded(p) for p in st.ins)), 0
            )
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


def _base_colour(n: torch.fx.Node, val) -> tuple:
    """What a node is, without which layer it belongs to: op, shapes, constant arguments (the
    layer index of ``select`` and of ``select_backward`` is left out; a local_map region by
    its specs)."""
    shapes = tuple(
        (tuple(v.shape), v.dtype)
        for v in (val if isinstance(val, (tuple, list)) else [val])
        if isinstance(v, torch.Tensor)
    )
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
    return (
        n.op,
        str(n.target),
        shapes,
        consts,
        tuple(sorted((k, repr(v)) for k, v in n.kwargs.items() if not _has_node(v))),
    )


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
