"""Auto-sharding, part 4: the chosen layout (:class:`AutoResult`), the entry point :func:`solve`,
and :func:`apply`, which imposes a result on the traced graph so propagation runs exactly the plan.

    result = solve(traced, mesh, memory_budget=40e9, hardware="h100")
    print(result.summary()); in_specs = apply(traced, result)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import optree
import torch
import yaml
from torch.fx.node import map_arg

from shardfn.core.units import format_bytes
from shardfn.partition.auto.ilp import Solution, input_bounds, memory_rows, min_memory, relative_gap, solve_problem
from shardfn.partition.auto.problem import Cost, Problem, Reshard
from shardfn.partition.cost.hardware import Hardware, load_hardware
from shardfn.partition.spec import broadcast_specs, describe, is_auto, to_spec
from shardfn.partition.spmd.trace import Traced

aten = torch.ops.aten

DEFAULT_MIP_GAP = 0.05   # a plan proven within 5% of the solver's lower bound is returned silently


class UnprovenPlanError(RuntimeError):
    """``strict=True``: the solver stopped before proving its plan within ``mip_gap`` of the bound."""


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
        stats: sizes and timings (nodes, classes, variables, build and solve seconds), and the
            solve's ``objective_s``, ``lower_bound_s`` and ``gap`` (``(objective - bound) /
            objective``: the plan is at most that share slower than the best one, by the model).
        mip_gap: the gap a plan must be proven within; :attr:`proven` and :attr:`warning` say
            whether it was.
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
    mip_gap: float = DEFAULT_MIP_GAP
    _fixed: list = field(default=None, repr=False)
    _cuts: tuple = field(default=(), repr=False)

    @property
    def gap(self) -> float:
        """The relative gap between this plan's objective and the solver's lower bound (nan: no bound)."""
        return self.stats.get("gap", math.nan)

    @property
    def proven(self) -> bool:
        """True when the plan is proven within ``mip_gap`` of the best plan the model allows."""
        return self.gap <= self.mip_gap

    @property
    def warning(self) -> str | None:
        """Why this plan may be far from the best one, and what to do; None when :attr:`proven`.

            if not result.proven: print(result.warning)
        """
        if self.proven:
            return None
        st = self.stats
        gap = "unknown (no lower bound)" if math.isnan(self.gap) else f"{self.gap:.1%}"
        over = ""
        if self.memory_budget is not None and self.cost.memory_bytes > self.memory_budget:
            over = (f"; it peaks at {format_bytes(self.cost.memory_bytes)} per rank, over the memory budget of "
                    f"{format_bytes(self.memory_budget)}")
        return (f"auto-sharding: the plan is not proven within mip_gap={self.mip_gap:.1%} of the best: its estimated "
                f"step is {_fmt_s(st['objective_s'])} against a lower bound of {_fmt_s(st['lower_bound_s'])} "
                f"(gap {gap}, status {self.status}, {st['solve_s']:.1f} s of time_limit_s={self._time_limit_s:g})"
                f"{over}; "
                f"raise the time limit (sf.AUTO(time_limit_s=...), partition.auto_time_limit_s) or accept a larger "
                f"gap (sf.AUTO(mip_gap=...))")

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
        st = self.stats
        gap = "-" if math.isnan(self.gap) else f"{self.gap:.2%}"
        lines = [
            f"auto-sharding on mesh {_fmt_mesh(self.mesh_axes)} ({self.hardware}): {status}",
            f"  objective {_fmt_s(st['objective_s'])}, lower bound {_fmt_s(st['lower_bound_s'])}, gap {gap} "
            f"({'within' if self.proven else 'NOT within'} mip_gap {self.mip_gap:.1%})",
            f"  step {_fmt_s(c.step_s)} = compute {_fmt_s(c.compute_s)} + comm {_fmt_s(c.comm_s)} "
            f"+ reshard {_fmt_s(c.reshard_s)}; memory {format_bytes(c.memory_bytes)} per rank (budget {budget})",
            f"  {self.stats['nodes']} nodes in {self.stats['classes']} classes, {self.stats['variables']} variables; "
            f"build {self.stats['build_s']:.2f} s, solve {self.stats['solve_s']:.2f} s",
        ]
        for path, spec in zip(self.paths(), self.in_specs):
            lines.append(f"  {path}: {spec!r}")
        return "\n".join(lines)

    def candidates(self) -> dict[str, list[dict]]:
        """Node name -> the strategies the solver chose among: ``{"out", "ins", "compute_s"}``
        each (DTensor placements of the output and of each tensor input, and the estimated
        seconds of the op under it). Views follow their input and getitems their producer: they
        have the one strategy they run under this plan (``strategies()``), not a list.

            for s in result.candidates()["mm"]: print(s["out"], s["compute_s"])
        """
        prob = self._problem
        out = {}
        for i in sorted(prob.strats):
            out[prob.nodes[i].name] = [{"out": st.out, "ins": tuple(st.ins), "compute_s": float(c)}
                                       for st, c in zip(prob.strats[i], prob.node_compute[i])]
        return out

    def strategies(self) -> dict[str, dict]:
        """Node name -> the strategy it runs under this plan: ``{"out", "ins", "compute_s",
        "index"}`` (``index`` into ``candidates()[name]``; None for a view that follows its input).

            result.strategies()["mm"]["ins"]     # the placements the matmul reads its inputs in
        """
        prob = self._problem
        choice = self._choice
        out = {}
        for i in prob.computed():
            st = prob.strategy_of(i, choice)
            if i in prob.strats:
                index, compute = choice[i], prob.node_compute[i][choice[i]]
            else:
                k0, _ = prob.follow[i]
                index, compute = None, prob.node_compute[i][prob.out_map[prob.inputs[i][k0]][choice[prob.owner[i]]]]
            out[prob.nodes[i].name] = {"out": st.out, "ins": tuple(st.ins), "compute_s": float(compute),
                                       "index": index}
        return out

    def describe(self, placements) -> str:
        """Placements as text over this mesh's axes (``dp:S(0) tp:P(sum)``; ``R`` when replicated)."""
        if placements and isinstance(placements[0], (tuple, type(None))):
            return "(" + ", ".join("-" if p is None else self.describe(p) for p in placements) + ")"
        return describe(placements, self.mesh_dims) or "R"

    def export_ilp(self, path) -> "Any":
        """Write the ILP this plan solves -- objective in microseconds, one-hot and
        edge-consistency equalities, the memory budget rows at the steps the solve constrained --
        as MPS, for any MIP solver (``highs``, ``cbc``, ``gurobi_cl``). Returns the path.

            result.export_ilp("step.mps")    # then: highs step.mps
        """
        from scipy.sparse import csr_matrix

        from shardfn.partition.auto.mps import write_mps
        from shardfn.partition.auto.problem import _GIB

        prob = self._problem
        n_var = prob.n_x + prob.n_y
        a_eq = csr_matrix((prob.data, (prob.rows, prob.cols)), shape=(prob.n_rows, n_var))
        ub = input_bounds(prob, self._fixed or [None] * len(prob.placeholders))
        mem = memory_rows(prob, list(self._cuts)) if self.memory_budget is not None else None
        b_ub = None if mem is None else np.full(mem.shape[0], self.memory_budget / _GIB)
        integer = np.arange(n_var) < prob.n_x
        return write_mps(path, prob.c, a_eq, prob.rhs, mem, b_ub, ub, integer)

    def node_costs(self) -> dict[str, dict]:
        """Node name -> this plan's terms at that node: ``compute_s`` (its op), ``comm_s`` and
        ``reshard_s`` (the transitions of its inputs, and for ``"output"`` of the returned
        values), ``bytes`` (its value per rank) and ``collectives`` (``(op, axis, bytes)``).

            costs = result.node_costs(); max(costs, key=lambda n: costs[n]["comm_s"])
        """
        prob = self._problem
        out: dict[str, dict] = {}

        def row(name):
            return out.setdefault(name, {"compute_s": 0.0, "comm_s": 0.0, "reshard_s": 0.0, "bytes": 0,
                                         "collectives": []})

        for name, st in self.strategies().items():
            row(name)["compute_s"] = st["compute_s"]
        for i in prob.holds:
            row(prob.nodes[i].name)["bytes"] = int(prob.value_bytes(i)[self._choice[prob.owner[i]]])
        for m in self.reshards:
            r = row(m.consumer)
            r["comm_s"] += m.transition.comm_s
            r["reshard_s"] += m.transition.reshard_s
            r["collectives"] += [(op, self.mesh_dims[dim], int(size)) for op, dim, size in m.transition.collectives]
        return out

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
                sol = solve_problem(prob, fixed, self.memory_budget, self._time_limit_s)
            except ValueError as e:
                rows.append({"name": name, "status": f"invalid: {e}", "fits": False})
                continue
            fits = True
            if sol.choice is None and sol.status == "infeasible":
                sol = solve_problem(prob, fixed, None, self._time_limit_s)
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
    mip_gap: float = DEFAULT_MIP_GAP,
    cost_model: Any = None,
    strict: bool = False,
) -> AutoResult:
    """Choose input specs and node placements for ``traced`` on ``mesh``.

    Args:
        traced: ``shardfn.partition.spmd.trace.trace(fn, args)`` (global shapes, fake tensors).
        mesh: a ``shardfn.Mesh``; ``Mesh(..., fake=True)`` plans without a process group.
        memory_budget: bytes per rank; default the hardware's HBM. ``math.inf``: no limit.
        hardware: a profile name (``"h100"``, ``"b200"``, ...), a YAML path or a ``Hardware``.
        fixed_specs: inputs whose spec is given: a dict ``{path: P}`` (a path or a path prefix,
            ``"params.w1"`` or ``"0.w1"``; see ``to_rules_yaml``), or a pytree prefix of the
            arguments with ``P`` leaves and ``sf.AUTO`` where the solver chooses.
        time_limit_s: HiGHS' time limit; when hit, the best layout found so far is returned
            and ``result.status == "time_limit"``.
        mip_gap: the relative gap to the solver's lower bound a plan must be proven within
            (0.05: at most 5% slower than the best plan, by the model). A plan that is not has
            ``result.proven == False`` and a ``result.warning``; with ``strict`` it raises
            :class:`UnprovenPlanError` instead.
        cost_model: what prices ops and transitions: None (``partition.cost.CostModel``), a
            subclass of it, or a callable ``(mesh_shape, hardware, device_mesh,
            gathers_for_all_to_all) -> CostModel``.
        strict: raise :class:`UnprovenPlanError` for a plan not proven within ``mip_gap``.
        tie_layers: nodes with the same structure (repeated layers) share one choice, so a
            32-layer model costs about as much to solve as one layer.
        arg_names: names of the positional arguments for paths (``("params", "batch")``).

    Example:
        result = solve(trace(step, (params, x)), sf.Mesh({"dp": 2, "tp": 2}, fake=True))
        step = sf.jit(step, mesh, in_specs=result.in_specs_tree())
    """
    if not hasattr(mesh, "device_mesh"):
        raise TypeError(f"mesh must be a shardfn Mesh (sf.Mesh({{...}}, fake=True) to plan); got {type(mesh).__name__}")
    if not (isinstance(mip_gap, (int, float)) and mip_gap >= 0):
        raise ValueError(f"auto-sharding: mip_gap must be a number >= 0 (0.05: within 5% of the lower bound); "
                         f"got {mip_gap!r}")
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
        raise ValueError(f"auto-sharding: time_limit_s must be a number of seconds > 0; got {time_limit_s!r}")
    hw = load_hardware(hardware)
    budget = hw.hbm_bytes if memory_budget is None else float(memory_budget)
    if budget == math.inf:
        budget = None
    arg_names = tuple(arg_names) if arg_names is not None else None
    prob = Problem(traced, mesh, hw, tie_layers=tie_layers, cost_model=cost_model)
    fixed = _resolve_fixed(fixed_specs, traced, arg_names)
    sol = _solve_on_rank_zero(prob, mesh, lambda: solve_problem(prob, fixed, budget, time_limit_s))
    if sol.choice is None:
        if sol.status == "infeasible":
            peak, _, proven = _solve_on_rank_zero(prob, mesh, lambda: min_memory(prob, fixed, time_limit_s))
            smallest = ("the smallest budget that fits is" if proven
                        else f"a plan within time_limit_s={time_limit_s:g} fits")
            raise ValueError(
                f"auto-sharding: no layout fits memory_budget={format_bytes(budget)} per rank on mesh "
                f"{_fmt_mesh(mesh.axes)}; {smallest} memory_budget={format_bytes(peak)} ({peak} bytes) per rank. "
                f"Raise memory_budget to that, use a larger mesh, or shrink the batch or the sequence"
            )
        # HiGHS had no plan at all in time: run everything replicated, and say so
        sol = Solution(prob.replicated_choice(), "time_limit", sol.solve_s,
                        f"no plan within time_limit_s={time_limit_s}, so everything is replicated; raise it "
                        f"({sol.message})")
    result = _result(prob, sol, hw, budget, arg_names, time_limit_s, mip_gap, fixed)
    if strict and not result.proven:
        raise UnprovenPlanError(result.warning + "; or pass strict=False to take the plan as it is")
    return result


def smallest_budget(result: AutoResult, time_limit_s: float | None = None) -> tuple[int, bool]:
    """``(bytes per rank, proven)``: the smallest peak memory of any plan for ``result``'s graph,
    mesh and fixed inputs (a min-memory solve); ``proven``: no plan peaks lower.

        peak, proven = smallest_budget(result); solve(..., memory_budget=peak)
    """
    prob = result._problem
    peak, _, proven = min_memory(prob, result._fixed or [None] * len(prob.placeholders),
                                 result._time_limit_s if time_limit_s is None else time_limit_s)
    return peak, proven

def _solve_on_rank_zero(prob: Problem, mesh, solve_fn) -> Solution:
    """On a real multi-process mesh, rank 0 solves and broadcasts its plan: every rank must run
    the same plan, and a time limit could end the search at different plans on different ranks."""
    import torch.distributed as dist

    if getattr(mesh, "fake", True) or not dist.is_initialized() or dist.get_world_size() == 1:
        return solve_fn()
    payload = [solve_fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]

def _result(prob: Problem, sol: Solution, hw: Hardware, budget, arg_names, time_limit_s,
            mip_gap: float = DEFAULT_MIP_GAP, fixed: list | None = None) -> AutoResult:
    from shardfn.partition.auto.problem import _US

    cost, moves, sink_pl = prob.evaluate(sol.choice)
    objective = sol.objective if math.isfinite(sol.objective) else prob.objective(sol.choice) / _US
    in_specs = []
    for ph in prob.placeholders:
        i = prob.index[ph]
        in_specs.append(to_spec(prob.out_placement(i, sol.choice), prob.val[i].ndim, prob.names))
    out_specs = [to_spec(pl, prob.val[u].ndim, prob.names) for pl, (u, _) in zip(sink_pl, prob.sinks)]
    placements = {n.name: prob.out_placement(i, sol.choice) for i, n in enumerate(prob.nodes) if i not in prob.opaque}
    stats = {
        "nodes": len(prob.nodes), "classes": prob.n_classes, "variables": prob.n_x + prob.n_y,
        "constraints": prob.n_rows, "memory_cuts": sol.n_cuts, "build_s": prob.build_s, "solve_s": sol.solve_s,
        "objective_s": objective, "lower_bound_s": sol.bound, "message": sol.message,
        "gap": relative_gap(objective, sol.bound), "status": sol.status, "time_limit_s": time_limit_s,
        "mip_gap": mip_gap,
    }
    return AutoResult(in_specs, out_specs, placements, moves, cost, sol.status, stats, dict(prob.mesh.axes),
                      prob.names, hw.name, budget, arg_names, prob, sol.choice, time_limit_s, mip_gap, fixed,
                      tuple(sol.cuts))

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
    return [None if spec is None or is_auto(spec) else spec for spec in specs]

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
