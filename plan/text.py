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
        f"traced: {plan.trace['mode']}, {len(plan.trace['lowered'])} lowered step(s) on mesh "
        f"{' '.join(f'{a}={n}' for a, n in plan.trace['mesh'].items() if n > 1) or '1 device'} "
        f"in {plan.trace['seconds']:.1f} s",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


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
        lines.append("  (none: every valid layout exceeds the device memory)")
    lines.append("")
    lines.append(f"{len(result.too_big)} layouts do not fit, {result.not_planned} were not planned "
                 f"(a lower bound on their step time is slower than the layouts above); "
                 f"{result.traced_profiles} profiles (mesh, microbatch size) planned in {result.seconds:.1f} s")
    for key, n in sorted(result.refused_by_key().items()):
        example = next(r["reason"] for r in result.refused if r["key"] == key)
        lines.append(f"refused {n} layouts on {key}, e.g. {example}")
    return "\n".join(lines)
