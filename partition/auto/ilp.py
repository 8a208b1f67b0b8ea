"""Auto-sharding, part 3: solving the ILP with HiGHS (``scipy.optimize``).

The LP relaxation first -- when it is integral (usual: edge-consistency is a transport polytope)
it is the ILP optimum -- else branch and bound, with memory cuts added where the true peak falls
and, when time runs out, memory priced into the objective by a bisected multiplier.

    sol = solve_problem(prob, fixed=[None] * len(prob.placeholders), budget=40e9, time_limit_s=10)
    sol.choice, sol.status
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from shardfn.partition.auto.problem import _GIB, _US, Problem

_LAGRANGE_STEPS = 10   # memory-price multipliers tried when branch and bound does not finish
_MEMORY_ROUNDS = 8     # at most this many memory cuts are added after the first solve
_GAP = 1e-3            # HiGHS stops when the plan is within 0.1% of the best possible
_DISP = False          # HiGHS' log
_GAP_TOLERANCE_S = 1e-9  # objective and bound closer than a nanosecond are equal


@dataclass
class Solution:
    """A choice of strategy per owner (None when there is none), and how the search ended."""

    choice: dict | None
    status: str
    solve_s: float
    message: str
    objective: float = math.nan   # the ILP objective (seconds) of choice
    bound: float = math.nan       # a lower bound on any plan's objective (LP relaxation, or HiGHS' dual bound)
    n_cuts: int = 0
    cuts: tuple = ()              # the steps whose live bytes are constrained by the budget

    @property
    def gap(self) -> float:
        """``(objective - bound) / objective``: how far the plan may be from the best one (0: proven
        optimal; nan: no bound or no objective)."""
        return relative_gap(self.objective, self.bound)


def relative_gap(objective: float, bound: float) -> float:
    """HiGHS' relative MIP gap, ``(objective - bound) / |objective|``, never below 0.

        relative_gap(923.0, 59.3)   # 0.936: the plan may be 15x the best one
    """
    if not (math.isfinite(objective) and math.isfinite(bound)):
        return math.nan
    if objective - bound <= _GAP_TOLERANCE_S:
        return 0.0  # equal up to the solver's tolerances (an objective of zero included)
    return (objective - bound) / max(abs(objective), _GAP_TOLERANCE_S)


def input_bounds(self: Problem, fixed: list) -> np.ndarray:
    """Upper bounds of the ILP's variables: 0 for strategies that are forbidden or that contradict
    ``fixed`` (one spec or None per input), 1 for other strategies, inf for transport variables."""
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
    return ub


def memory_rows(self: Problem, cuts) -> "np.ndarray | None":
    """The budget rows (GiB per x variable, zero over the transport variables) at steps ``cuts``."""
    from scipy.sparse import csr_matrix

    if not cuts:
        return None
    return csr_matrix(np.hstack([np.array([self.memory_row(t) for t in cuts]), np.zeros((len(cuts), self.n_y))]))


def solve_problem(self: Problem, fixed: list, budget: float | None, time_limit_s: float) -> Solution:
    from scipy.sparse import csr_matrix

    t0 = time.perf_counter()
    n_var = self.n_x + self.n_y
    ub = input_bounds(self, fixed)
    a_eq = csr_matrix((self.data, (self.rows, self.cols)), shape=(self.n_rows, n_var))
    cuts: list[int] = self.reference_peaks() if budget is not None else []
    last = None
    while True:
        mem = memory_rows(self, cuts)
        left = time_limit_s - (time.perf_counter() - t0)
        sol = _solve_once(self, a_eq, mem, None if budget is None else budget / _GIB, ub, left)
        sol.solve_s = time.perf_counter() - t0
        sol.n_cuts = len(cuts)
        sol.cuts = tuple(cuts)
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


def _solve_once(self: Problem, a_eq, mem, mem_ub, ub, left: float) -> Solution:
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
        return Solution(None, "infeasible", 0.0, lp.message)
    if lp.x is None:
        return Solution(None, "time_limit", 0.0, lp.message)
    x = lp.x[: self.n_x]
    if np.all(np.minimum(x, 1 - x) < 1e-6):
        return Solution(self._decode(lp.x), "optimal", 0.0, "LP relaxation is integral", objective=lp.fun / _US,
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
    dual = getattr(res, "mip_dual_bound", None)  # branch and bound's bound: at least the LP's
    if dual is not None and np.isfinite(dual):
        bound = max(bound, float(dual))
    if res.status == 0 and found is not None:
        return Solution(found[0], "optimal", 0.0, res.message, objective=found[1] / _US, bound=bound / _US)
    if res.status == 2:
        return Solution(None, "infeasible", 0.0, res.message)
    priced = _lagrange(self, a_eq, mem, mem_ub, bounds, bound, deadline) if mem is not None else None
    if priced is not None and (found is None or priced[1] < found[1]):
        found = priced
    if found is None:  # no plan in time: round the LP (each class takes its largest strategy)
        return Solution(self._decode(lp.x), "time_limit", 0.0, "rounded LP relaxation: " + res.message,
                         bound=bound / _US)
    return Solution(found[0], "time_limit", 0.0, res.message, objective=found[1] / _US, bound=bound / _US)


def _lagrange(self: Problem, a_eq, mem, mem_ub, bounds, bound: float, deadline: float):
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



def min_memory(self: Problem, fixed: list, time_limit_s: float) -> tuple[int, dict | None, bool]:
    """The smallest peak bytes per rank of any plan (inputs ``fixed`` as given): ``(peak bytes,
    its plan, proven)``. Minimises ``M`` subject to the live bytes at each step being at most
    ``M``, with the steps added where the plan found peaks (as :func:`solve_problem` adds memory
    cuts). ``proven``: HiGHS finished, so no plan peaks lower; else the peak is one that fits.

        peak, choice, proven = min_memory(prob, [None] * len(prob.placeholders), time_limit_s=10)
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix, hstack

    t0 = time.perf_counter()
    n_var = self.n_x + self.n_y
    ub = np.append(input_bounds(self, fixed), np.inf)
    a_eq = hstack([csr_matrix((self.data, (self.rows, self.cols)), shape=(self.n_rows, n_var)),
                   csr_matrix((self.n_rows, 1))])
    c = np.zeros(n_var + 1)
    c[-1] = 1.0  # M, GiB
    integrality = np.zeros(n_var + 1)
    integrality[: self.n_x] = 1
    cuts = self.reference_peaks()
    best = None
    proven = False
    while True:
        mem = hstack([memory_rows(self, cuts), csr_matrix(-np.ones((len(cuts), 1)))])
        left = time_limit_s - (time.perf_counter() - t0)
        res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(n_var + 1), ub),
                   constraints=[LinearConstraint(a_eq, self.rhs, self.rhs), LinearConstraint(mem, -np.inf, 0.0)],
                   options={"time_limit": max(0.5, left), "disp": _DISP, "mip_rel_gap": _GAP})
        if res.x is None:
            break
        choice = self._decode(res.x[:-1])
        peak, t = self.peak(choice)
        if best is None or peak < best[0]:
            best = (peak, choice)
        # proven: HiGHS finished and the plan's true peak is at a constrained step (so it is M)
        proven = res.status == 0 and peak <= res.x[-1] * _GIB * (1 + 1e-6)
        if proven or t in cuts or time.perf_counter() - t0 > time_limit_s:
            break
        cuts.append(t)  # the plan peaks at a step not yet constrained: constrain it and solve again
    if best is None:
        return 0, None, False
    return best[0], best[1], proven
