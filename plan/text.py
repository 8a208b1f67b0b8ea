"""A plan and a search result as the text ``shardfn plan`` prints.

    print(format_plan(make_plan(cfg)))
    print(format_search(search(cfg, gpus=64)))
"""

from __future__ import annotations

from shardfn.core.units import format_bytes, format_count
from shardfn.plan.estimate import Plan
from shardfn.plan.search import SearchResult


def format_plan(plan: Plan) -> str:
    """A plan as the text ``shardfn plan`` prints.

    Example:
        print(format_plan(make_plan(cfg)))
    """
    lay, b, r, t = plan.layout, plan.batch, plan.per_rank, plan.time
    layers = ", ".join(f"{lo}-{hi - 1}" for lo, hi in r["layers"])
    lines = [
        f"plan: {plan.model} ({plan.config or 'config'}) on {lay.world_size} x {plan.hardware}, {plan.dtype}",
        f"layout: {lay.describe()}",
        f"batch: {b['global_rows']:,} x {b['seq_len']:,} = {format_count(b['tokens_per_step'])} tokens per step; "
        f"microbatch {b['microbatch_rows']} rows ({b['tokens_per_microbatch_per_rank']:,} tokens) per rank",
        f"params: {format_count(plan.params['total'])} total, {format_count(plan.params['active'])} active per token",
        "",
        f"memory per rank (pp rank {r['pp_rank']} of {lay.pp}, layers {layers}; the largest peak)",
        f"  parameters        {format_bytes(r['params_bytes']):>14}",
        f"  gradients         {format_bytes(r['grads_bytes']):>14}",
        f"  optimizer state   {format_bytes(r['opt_state_bytes']):>14}",
        f"  activations       {format_bytes(r['activation_bytes']):>14}   at most {r['inflight_microbatches']} "
        f"(stage, microbatch) "
        f"held{' with checkpointing' if lay.checkpointing else ''}; one microbatch through this rank saves "
        f"{format_bytes(r['activation_bytes_per_microbatch'])}, "
        f"{format_bytes(r['activation_bytes_per_microbatch_checkpointed'])} "
        f"checkpointed",
        f"  transient         {format_bytes(r['transient_bytes']):>14}   one layer's working set",
        f"  peak              {format_bytes(r['peak_bytes']):>14}   of {format_bytes(plan.capacity_bytes)}"
        f"{' (partition.memory_budget)' if plan.budgeted else f' ({plan.hardware} memory)'}: "
        f"{'fits' if plan.fits else 'DOES NOT FIT'}",
        "",
        f"collectives per step (pp rank {r['pp_rank']})",
    ]
    for row in plan.comm:
        tag = {"estimate": "  (estimate: uniform routing)", "schedule": "  (from the schedule)"}.get(row["source"], "")
        lines.append(f"  {row['op']:<15}{row['axis']:<6}{row['count']:>8,} x {format_bytes(row['bytes']):>14}{tag}")
    lines += [
        "",
        "step time (estimate; compute and communication not overlapped)",
        f"  compute {t['compute_s']:.3f} s + microbatch collectives {t['microbatch_comm_s']:.3f} s, "
        f"pipeline {t['pipeline_s']:.3f} s (bubble {t['bubble']:.1%}), gradient reductions {t['step_comm_s']:.3f} s",
        f"  step {t['step_s']:.3f} s, {t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%} "
        f"(peak {t['peak_flops'] / 1e12:,.0f} TFLOP/s per device)",
        "",
        *format_run(plan.run),
        f"traced: {plan.trace['mode']}, {len(plan.trace['lowered'])} lowered step(s) on mesh "
        f"{' '.join(f'{a}={n}' for a, n in plan.trace['mesh'].items() if n > 1) or '1 device'} "
        f"in {plan.trace['seconds']:.1f} s",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def format_run(run: dict) -> list[str]:
    """The GPU run's estimate (``plan.run``) as lines: where the step's time and the memory go.

    Example:
        print("\n".join(format_run(plan.run)))
    """
    if not run:
        return []
    t, m = run["time"], run["memory"]
    state = m["params_bytes"] + m["grads_bytes"] + m["opt_state_bytes"]
    return [
        f"GPU run (estimate: achieved rates of {run['hardware']}, overlap, allocator; plan.runmodel)",
        f"  per microbatch: matmul {t['matmul_s']:.3f} s, attention {t['attention_s']:.3f} s, memory-bound "
        f"{t['memory_bound_s']:.3f} s; exposed fsdp {t['fsdp_exposed_s']:.3f} s of {t['fsdp_s']:.3f}, "
        f"tp {t['tp_s']:.3f} s, {'cp ' + format(t['cp_s'], '.3f') + ' s, ' if t.get('cp_s') else ''}"
        f"ep {t['ep_exposed_s']:.3f} s",
        f"  step {t['step_s']:.3f} s (pipeline {t['pipeline_s']:.3f}, bubble {t['bubble']:.1%}, optimizer "
        f"{t['optimizer_s']:.3f}, dp {t['dp_exposed_s']:.3f}, fixed {t['fixed_s']:.3f}): "
        f"{run['tokens_per_s_per_device']:,.0f} tokens/s per device, MFU {run['mfu']:.1%}",
        f"  memory {format_bytes(m['device_bytes'])}: state {format_bytes(state)}, "
        f"activations {format_bytes(m['activation_bytes'])}, transient {format_bytes(m['transient_bytes'])}, "
        f"fsdp buffers {format_bytes(m['fsdp_gathered_bytes'])}, allocator {format_bytes(m['fragmentation_bytes'])}, "
        f"CUDA context and NCCL {format_bytes(m['cuda_context_bytes'] + m['nccl_bytes'])}",
        "",
    ]


def format_search(result: SearchResult) -> str:
    """A search result as the table ``shardfn plan --search`` prints.

    Example:
        print(format_search(search(cfg, gpus=64)))
    """
    head = f"{'#':>3}  {'layout':<58}{'peak':>12}{'step s':>11}{'MFU':>8}{'tokens/s':>14}"
    lines = [f"layouts on {result.gpus} devices that fit, fastest first", head]
    for i, p in enumerate(result.plans, 1):
        lines.append(f"{i:>3}  {p.layout.describe():<58}{format_bytes(p.per_rank['peak_bytes']):>12}"
                     f"{p.time['step_s']:>11.4g}{p.time['mfu']:>8.1%}{p.time['tokens_per_s']:>14,.0f}")
    if not result.plans:
        lines.append("  (none: every valid layout exceeds the device memory)" if not result.over_budget else
                     "  (none found within the time budget)")
    lines.append("")
    pruned = result.not_planned - result.over_budget
    lines.append(f"{len(result.too_big)} layouts do not fit, {pruned} were not planned "
                 f"(a lower bound on their step time is slower than the layouts above); "
                 f"{result.planned} planned from {result.traced_profiles} profiles (mesh, microbatch rows, "
                 f"checkpointing): {result.lowered} steps lowered, {result.traced} traced to bound memory, "
                 f"in {result.seconds:.1f} s")
    if result.over_budget:
        lines.append(f"the {result.budget_s:.0f} s budget was spent before {result.over_budget} layouts could be "
                     f"lowered (step >= {result.over_budget_bound:.3g} s by their bound): plans above that time are "
                     f"the fastest; --budget 0 plans until the top ones are proven fastest")
    for key, n in sorted(result.refused_by_key().items()):
        example = next(r["reason"] for r in result.refused if r["key"] == key)
        lines.append(f"refused {n} layouts on {key}, e.g. {example}")
    return "\n".join(lines)
