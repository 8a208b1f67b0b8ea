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
    result.proven, result.gap            # the plan's distance to the solver's lower bound
    result.candidates(), result.strategies(), result.export_ilp("step.mps"), compare(result, other)

``sf.jit(..., in_specs=sf.AUTO)`` does trace -> solve -> apply -> lower in one call
(``partition.api.jit_auto``). See docs/autoshard.md for the formulation.
"""

from shardfn.partition.auto.compare import compare, compare_table
from shardfn.partition.auto.mps import write_mps
from shardfn.partition.auto.presets import load_specs_yaml, preset_rules, presets
from shardfn.partition.auto.problem import Cost, Problem, Reshard
from shardfn.partition.auto.result import AutoResult, UnprovenPlanError, apply, smallest_budget, solve

__all__ = ["AutoResult", "Cost", "Problem", "Reshard", "UnprovenPlanError", "apply", "compare", "compare_table",
           "load_specs_yaml", "preset_rules", "presets", "smallest_budget", "solve", "write_mps"]
