"""Auto-sharding, part 4: the chosen layout (:class:`AutoResult`), the entry point :func:`solve`,
and :func:`apply`, which imposes a result on the traced graph so propagation runs exactly the plan.

    result = solve(traced, mesh, memory_budget=40e9, hardware="h100")
    print(result.summary()); in_specs = apply(traced, result)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import optree
import torch
import yaml
from torch.fx.node import map_arg

from shardfn.core.units import format_bytes
from shardfn.partition.auto.ilp import Solution, solve_problem
from shardfn.partition.auto.problem import Cost, Problem, Reshard
from shardfn.partition.cost.hardware import Hardware, load_hardware
from shardfn.partition.spec import AUTO, broadcast_specs, to_spec
from shardfn.partition.spmd.trace import Traced

aten = torch.ops.aten


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
    prob = Problem(traced, mesh, hw, tie_layers=tie_layers)
    fixed = _resolve_fixed(fixed_specs, traced, arg_names)
    sol = _solve_on_rank_zero(prob, mesh, lambda: solve_problem(prob, fixed, budget, time_limit_s))
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
        sol = Solution(prob.replicated_choice(), "time_limit", sol.solve_s,
                        f"no plan within time_limit_s={time_limit_s}, so everything is replicated; raise it "
                        f"({sol.message})")
    return _result(prob, sol, hw, budget, arg_names, time_limit_s)

def _solve_on_rank_zero(prob: Problem, mesh, solve_fn) -> Solution:
    """On a real multi-process mesh, rank 0 solves and broadcasts its plan: every rank must run
    the same plan, and a time limit could end the search at different plans on different ranks."""
    import torch.distributed as dist

    if getattr(mesh, "fake", True) or not dist.is_initialized() or dist.get_world_size() == 1:
        return solve_fn()
    payload = [solve_fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]

def _result(prob: Problem, sol: Solution, hw: Hardware, budget, arg_names, time_limit_s) -> AutoResult:
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
