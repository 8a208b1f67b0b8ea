"""Auto-sharding a researcher can trust and steer: the gap to the solver's bound, AUTO's options,
the cost model and hardware it prices with, and the plan's candidates, strategies, ILP and costs."""

import dataclasses
import logging
import math
import warnings

import numpy as np
import pytest
import torch
from test_auto import fake, mlp_step

import shardfn as sf
from shardfn import P
from shardfn.core.units import format_bytes
from shardfn.partition import auto
from shardfn.partition.auto import result as auto_result
from shardfn.partition.auto.ilp import Solution
from shardfn.partition.auto.problem import _US
from shardfn.partition.cost.hardware import Hardware, efficiency, load_hardware
from shardfn.partition.cost.model import CostModel
from shardfn.partition.spmd.trace import trace


def mlp_args(d=256, h=1024, tokens=64):
    return {"w1": fake(d, h), "w2": fake(h, d)}, fake(tokens // 8, 8, d)


def mesh22():
    return sf.Mesh({"dp": 2, "tp": 2}, fake=True)


# ------------------------------------------------------------------ trust: the gap to the bound


@pytest.fixture
def replicated_plan_at_time_limit(monkeypatch):
    """The solver stops "at its time limit" with the all-replicated plan, while its bound is the
    true optimum: a stand-in for a time-limited HiGHS run, deterministic on any machine."""
    real = auto_result.solve_problem

    def stopped_early(prob, fixed, budget, time_limit_s):
        best = real(prob, fixed, budget, time_limit_s)
        bad = prob.replicated_choice()
        return Solution(bad, "time_limit", 0.25, "Time limit reached", objective=prob.objective(bad) / _US,
                        bound=best.bound)

    monkeypatch.setattr(auto_result, "solve_problem", stopped_early)


def test_every_solve_reports_objective_bound_gap_status_and_time(clean_process_group):
    result = auto.solve(trace(mlp_step, mlp_args()), mesh22())
    st = result.stats
    assert st["status"] == result.status == "optimal"
    assert st["objective_s"] == pytest.approx(st["lower_bound_s"], rel=1e-3)
    assert 0.0 <= st["gap"] == result.gap <= 1e-3 and st["mip_gap"] == 0.05 and st["time_limit_s"] == 10.0
    assert st["solve_s"] > 0 and result.proven and result.warning is None
    assert "gap 0.0" in result.summary().splitlines()[1] and "within mip_gap 5.0%" in result.summary()


def test_a_plan_far_from_its_bound_is_flagged(clean_process_group, replicated_plan_at_time_limit):
    traced = trace(mlp_step, mlp_args())
    result = auto.solve(traced, mesh22(), time_limit_s=3)
    st = result.stats
    assert result.status == "time_limit" and not result.proven
    assert st["gap"] == pytest.approx((st["objective_s"] - st["lower_bound_s"]) / st["objective_s"])
    assert st["gap"] > 0.3  # everything replicated: far slower than the bound
    assert f"gap {st['gap']:.1%}" in result.warning and "time_limit_s=3" in result.warning
    assert "raise the time limit (sf.AUTO(time_limit_s=...)" in result.warning
    assert "NOT within mip_gap 5.0%" in result.summary()
    assert "over the memory budget" not in result.warning
    # replicated does not fit a budget the solver's plans do: the warning says so
    tight = auto.solve(traced, mesh22(), memory_budget=result.cost.memory_bytes - 1)
    assert f"it peaks at {format_bytes(result.cost.memory_bytes)} per rank, over the memory budget" in tight.warning
    # a gap the user accepts is no warning
    assert auto.solve(traced, mesh22(), mip_gap=1.0).proven
    with pytest.raises(auto.UnprovenPlanError, match=r"not proven within mip_gap=5.0%.*strict=False"):
        auto.solve(traced, mesh22(), strict=True)


def test_sf_jit_warns_or_raises_for_an_unproven_plan(clean_process_group, replicated_plan_at_time_limit, caplog):
    p, x = mlp_args()
    with caplog.at_level(logging.WARNING, logger="shardfn.jit"), pytest.warns(UserWarning, match=r"gap \d+\.\d%"):
        lowered = sf.jit(mlp_step, mesh22(), in_specs=sf.AUTO, backend=None).lower(p, x)
    assert not lowered.auto.proven
    assert [r.getMessage() for r in caplog.records if r.name == "shardfn.jit" and "mip_gap" in r.getMessage()] \
        == [lowered.auto.warning]
    with pytest.raises(auto.UnprovenPlanError, match="time_limit_s=60"):
        sf.jit(mlp_step, mesh22(), in_specs=sf.AUTO(strict=True, time_limit_s=60), backend=None).lower(p, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sf.jit(mlp_step, mesh22(), in_specs=sf.AUTO(mip_gap=1.0), backend=None).lower(p, x)


# ------------------------------------------------------------------ steering: AUTO's options


def test_auto_options_reach_the_solve(clean_process_group):
    assert repr(sf.AUTO) == "AUTO" and repr(sf.AUTO(time_limit_s=60)) == "AUTO(time_limit_s=60)"
    assert sf.AUTO(hardware="h200")(mip_gap=0.1).options == {"hardware": "h200", "mip_gap": 0.1}
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['time_limit'\]; valid options are \['time_limit_s'"):
        sf.AUTO(time_limit=5)
    p, x = mlp_args()
    lowered = sf.jit(mlp_step, mesh22(), in_specs=({"w1": sf.AUTO(hardware="h200", mip_gap=0.01), "w2": sf.AUTO},
                                                   P("dp")), backend=None).lower(p, x)
    assert lowered.auto.hardware == "h200" and lowered.auto.mip_gap == 0.01 and lowered.auto.in_specs[2] == P("dp")
    with pytest.raises(ValueError, match="sf.AUTO leaves disagree on hardware: 'h200' and 'b200'"):
        sf.jit(mlp_step, mesh22(), in_specs=({"w1": sf.AUTO(hardware="h200"), "w2": sf.AUTO(hardware="b200")},
                                             P()), backend=None).lower(p, x)
    with pytest.raises(ValueError, match="mip_gap must be a number >= 0"):
        auto.solve(trace(mlp_step, (p, x)), mesh22(), mip_gap=-1)


def test_a_renamed_profile_keeps_its_rate_table():
    h100 = load_hardware("h100")
    slow = dataclasses.replace(h100, name="h100_slow_ib", inter_node_bandwidth=h100.inter_node_bandwidth / 4)
    assert efficiency(slow) is efficiency("h100") and efficiency(slow).matmul_share(8192, 8192, 8192) == 0.80
    fields = {f.name: getattr(h100, f.name) for f in dataclasses.fields(Hardware) if f.name != "efficiency"}
    assert efficiency(Hardware.from_dict({**fields, "name": "mine", "efficiency": "a100"})) is efficiency("a100")
    assert efficiency(Hardware.from_dict({**fields, "name": "mine"})).source.startswith("peak rates")
    with pytest.raises(ValueError, match=r"efficiency must name a bundled rate table, one of \['a100'"):
        Hardware.from_dict({**fields, "name": "mine", "efficiency": "tpu"})


def test_the_cost_model_can_be_replaced(clean_process_group):
    class FreeCompute(CostModel):
        def compute_time(self, *args, **kwargs):
            return 0.0

    traced = trace(mlp_step, mlp_args())
    free = auto.solve(traced, mesh22(), cost_model=FreeCompute)
    inputs = {ph.name for ph in free._problem.placeholders}  # their only cost: a tie-breaker on bytes held
    assert isinstance(free._problem.model, FreeCompute)
    assert [st["compute_s"] for name, st in free.strategies().items() if name not in inputs] == \
        [0.0] * (len(free.strategies()) - len(inputs))
    assert free.cost.compute_s < auto.solve(traced, mesh22()).cost.compute_s / 100
    with pytest.raises(TypeError, match="cost_model must be a CostModel subclass or a callable"):
        auto.solve(traced, mesh22(), cost_model=3)
    with pytest.raises(TypeError, match=r"returned dict, which lacks \['compute_time', 'transition', 'local_bytes'\]"):
        auto.solve(traced, mesh22(), cost_model=lambda *a, **k: {})


# ------------------------------------------------------------------ inspecting a plan


def test_candidates_and_the_chosen_strategy_per_node(clean_process_group):
    result = auto.solve(trace(mlp_step, mlp_args()), mesh22())
    cands, chosen = result.candidates(), result.strategies()
    assert len(cands["mm"]) > 1 and all({"out", "ins", "compute_s"} == set(c) for c in cands["mm"])
    for name, st in chosen.items():
        if st["index"] is not None:  # an owner: its strategy is one of its candidates
            c = cands[name][st["index"]]
            assert (c["out"], c["ins"], c["compute_s"]) == (st["out"], st["ins"], st["compute_s"])
        assert result.placements[name] == st["out"]
    prob = result._problem
    for ph, spec in zip(prob.placeholders, result.in_specs):
        assert result.describe(chosen[ph.name]["out"]) == (result.describe(prob._norm(
            prob._placements(spec, prob.val[prob.index[ph]].ndim, where="test"))))
    assert sum(st["compute_s"] for st in chosen.values()) == pytest.approx(result.cost.compute_s)


def read_mps(path):
    """A small free-MPS reader (the test's own, independent of the writer)."""
    rows, kinds, cols, obj, entries, rhs, integer, ub = {}, {}, {}, {}, [], {}, set(), {}
    section, in_int = None, False
    for line in path.read_text().splitlines():
        if not line.startswith(" "):
            section = line.split()[0]
            continue
        f = line.split()
        if section == "ROWS":
            if f[0] != "N":
                rows[f[1]], kinds[f[1]] = len(rows), f[0]
        elif section == "COLUMNS":
            if f[1] == "'MARKER'":
                in_int = f[2].strip("'") == "INTORG"
                continue
            j = cols.setdefault(f[0], len(cols))
            if in_int:
                integer.add(j)
            if f[1] == "COST":
                obj[j] = float(f[2])
            else:
                entries.append((rows[f[1]], j, float(f[2])))
        elif section == "RHS":
            rhs[rows[f[1]]] = float(f[2])
        elif section == "BOUNDS":
            ub[cols[f[2]]] = 0.0 if f[0] == "FX" else float(f[3])
    n, m = len(cols), len(rows)
    a = np.zeros((m, n))
    for i, j, v in entries:
        a[i, j] = v
    c = np.array([obj.get(j, 0.0) for j in range(n)])
    b = np.array([rhs.get(i, 0.0) for i in range(m)])
    lo = np.array([b[i] if kinds[r] == "E" else -np.inf for r, i in rows.items()])
    upper = np.array([ub.get(j, np.inf) for j in range(n)])
    return c, a, lo, b, upper, np.array([1 if j in integer else 0 for j in range(n)])


@pytest.mark.parametrize("tight", [False, True])
def test_the_exported_ilp_solves_to_the_plans_objective(clean_process_group, tmp_path, tight):
    from scipy.optimize import Bounds, LinearConstraint, milp

    p, x = mlp_args(256, 1024, tokens=1024)
    traced = trace(mlp_step, (p, x))
    mesh = sf.Mesh({"dp": 4}, fake=True)
    budget = math.inf  # no memory rows
    if tight:  # below the roomy plan's peak: the memory rows bind
        budget = auto.solve(traced, mesh).cost.memory_bytes - 256 * 1024 * 4
    result = auto.solve(traced, mesh, memory_budget=budget)
    path = result.export_ilp(tmp_path / "step.mps")
    text = path.read_text()
    assert text.startswith("NAME SHARDFN\nROWS\n N COST\n") and text.endswith("ENDATA\n")
    assert (" L M0" in text) == tight
    c, a, lo, hi, upper, integrality = read_mps(path)
    assert len(c) == result.stats["variables"] and integrality.sum() == result._problem.n_x
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(len(c)), upper),
               constraints=[LinearConstraint(a, lo, hi)], options={"mip_rel_gap": 1e-9})
    assert res.status == 0
    assert res.fun / _US == pytest.approx(result.stats["objective_s"], rel=2e-3 if tight else 1e-6)


def test_compare_two_plans_term_by_term(clean_process_group):
    traced = trace(mlp_step, mlp_args())
    a = auto.solve(traced, mesh22(), arg_names=("params", "x"))
    b = auto.solve(traced, mesh22(), fixed_specs={"params": P(), "x": P("dp")}, arg_names=("params", "x"))
    rows = auto.compare(a, b)
    total = rows[0]
    assert total["node"] == "total" and total["compute_s"] == (a.cost.compute_s, b.cost.compute_s)
    assert total["bytes"] == (a.cost.memory_bytes, b.cost.memory_bytes)
    for plan, k in ((a, 0), (b, 1)):  # every term of the step is at some node
        costs = plan.node_costs()
        assert sum(c["comm_s"] for c in costs.values()) == pytest.approx(plan.cost.comm_s)
        assert sum(c["reshard_s"] for c in costs.values()) == pytest.approx(plan.cost.reshard_s)
        assert sum(c["compute_s"] for c in costs.values()) == pytest.approx(plan.cost.compute_s)
    arg0 = next(r for r in rows if r["node"] == "arg0_1")  # params.w1: sharded by a, replicated by b
    assert arg0["b"] == "R" and arg0["a"] != "R" and arg0["bytes"][0] < arg0["bytes"][1]
    assert all(r["node"] != "total" for r in rows[1:]) and len(auto.compare(a, a)) == 1
    assert auto.compare_table(a, b).splitlines()[0].startswith("node")


def test_a_budget_too_small_names_the_smallest_that_fits(clean_process_group):
    traced = trace(mlp_step, mlp_args())
    mesh = mesh22()
    roomy = auto.solve(traced, mesh)
    smallest, proven = auto.smallest_budget(roomy)
    assert proven and 0 < smallest <= roomy.cost.memory_bytes
    with pytest.raises(ValueError, match=rf"the smallest budget that fits is memory_budget=\S+ \S+ \({smallest} "
                                         rf"bytes\) per rank"):
        auto.solve(traced, mesh, memory_budget=1024)
    fits = auto.solve(traced, mesh, memory_budget=smallest)
    assert fits.cost.memory_bytes <= smallest and math.isfinite(fits.cost.step_s)


# ------------------------------------------------------------------ what a pass after propagate sees


def test_a_pass_after_propagate_sees_each_edges_transition(clean_process_group):
    seen = {}

    def look(gm):
        for n in gm.graph.nodes:
            for t in n.meta["sf_transitions"]:
                seen.setdefault(n.name, []).append(t)
        return gm

    def step(w, x):
        return (x @ w).sum()

    mesh = sf.Mesh({"dp": 2, "tp": 2}, fake=True)
    lowered = sf.jit(step, mesh, in_specs=(P("tp"), P(None, "tp")), backend=None,
                     passes={"after_propagate": [look]}).lower(torch.zeros(4, 4), torch.zeros(2, 4))
    rows = lowered.collectives()
    assert sum(len(v) for v in seen.values()) == len(rows) > 0
    for row in rows:
        t = next(t for t in seen[row["node"]] if (t["op"], t["axis"], t["bytes"]) == (row["op"], row["axis"],
                                                                                     row["bytes"]))
        assert t["shape"] == row["shape"]
    # the matmul's partial sum over tp stays partial through the sum, reduced where it is returned
    assert [(t["op"], t["axis"], t["producer"]) for t in seen["output"]] == [("all_reduce", "tp", "sum_1")]


def test_a_stored_inputs_gather_names_the_input_as_its_producer(clean_process_group):
    seen = {}

    def look(gm):
        seen.update({n.name: list(n.meta["sf_transitions"]) for n in gm.graph.nodes})
        return gm

    def step(w, x):
        return (x @ w).sum()

    mesh = sf.Mesh({"fsdp": 2}, fake=True)
    sf.jit(step, mesh, in_specs=(P("fsdp"), P()), fsdp_argnums=(0,), backend=None,
           passes={"after_propagate": [look]}).lower(torch.zeros(4, 4), torch.zeros(2, 4))
    gathers = [(name, t["producer"], t["bytes"]) for name, ts in seen.items() for t in ts if t["op"] == "all_gather"]
    assert gathers == [("mm", "arg0_1", 4 * 4 * 4)]  # the whole weight, gathered where the matmul reads it
