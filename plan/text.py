"""A plan and a search result as the text ``shardfn plan`` prints.

    print(format_plan(make_plan(cfg)))
    print(format_search(search(cfg, gpus=64)))
"""

from __future__ import annotations

from shardfn.core.units import format_bytes, format_count
from shardfn.plan.estimate import Plan
from shardfn.plan.search import SearchResult


def format_plan(plan: Plan) -> str:
    """A plan as the text ``shardfn plan`` prints: the estimate first, then the traced detail.

    Example:
        print(format_plan(make_plan(cfg)))
    """
    lay, b = plan.layout, plan.batch
    lines = [
        f"plan: {plan.model} ({plan.config or 'config'}) on {lay.world_size} x {plan.hardware}, {plan.dtype}",
        f"layout: {lay.describe()}",
        f"batch: {b['global_rows']:,} x {b['seq_len']:,} = {format_count(b['tokens_per_step'])} tokens per step; "
        f"microbatch {b['microbatch_rows']} rows ({b['tokens_per_microbatch_per_rank']:,} tokens) per rank",
        f"params: {format_count(plan.params['total'])} total, {format_count(plan.params['active'])} active per token",
        "",
        *format_estimate(plan),
    ]
    r = plan.per_rank
    if r:
        layers = ", ".join(f"{lo}-{hi - 1}" for lo, hi in r["layers"])
        lines += [
            "",
            f"traced program per rank (pp rank {r['pp_rank']} of {lay.pp}, layers {layers}; exact state, and what "
            f"the CPU-traced step saves)",
            f"  parameters        {format_bytes(r['params_bytes']):>14}",
            f"  gradients         {format_bytes(r['grads_bytes']):>14}",
            f"  optimizer state   {format_bytes(r['opt_state_bytes']):>14}",
            f"  activations       {format_bytes(r['activation_bytes']):>14}   at most {r['inflight_microbatches']} "
            f"(stage, microbatch) held; one microbatch saves {format_bytes(r['activation_bytes_per_microbatch'])}, "
            f"{format_bytes(r['activation_bytes_per_microbatch_checkpointed'])} checkpointed (attention's scores "
            f"included: no flash kernel on the CPU trace)",
            "",
            f"collectives per step (pp rank {r['pp_rank']}, traced)",
        ]
        for row in plan.comm:
            tag = {"estimate": "  (estimate: uniform routing)", "schedule": "  (from the schedule)"}.get(row["source"],
                                                                                                         "")
            lines.append(f"  {row['op']:<15}{row['axis']:<6}{row['count']:>8,} x {format_bytes(row['bytes']):>14}{tag}")
        t = plan.traced_time
        lines += [
            "",
            f"traced program at datasheet peak with nothing overlapped (a reference figure, not the estimate): "
            f"step {t['step_s']:.3f} s, MFU {t['mfu']:.1%}",
            f"traced: {plan.trace['mode']}, {len(plan.trace['lowered'])} lowered step(s) on mesh "
            f"{' '.join(f'{a}={n}' for a, n in plan.trace['mesh'].items() if n > 1) or '1 device'} "
            f"in {plan.trace['seconds']:.1f} s",
        ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def format_estimate(plan: Plan) -> list[str]:
    """The plan's answer (the run model's estimate) as lines: step time, throughput, MFU, peak
    memory and fit, then where the time and the bytes go.

    Example:
        print("\n".join(format_estimate(plan)))
    """
    run, t, m = plan.run, plan.time, plan.memory
    state = m["params_bytes"] + m["grads_bytes"] + m["opt_state_bytes"]
    where = "partition.memory_budget" if plan.budgeted else f"{plan.hardware} memory"
    return [
        f"estimate (plan.runmodel: achieved rates of {run['hardware']}, overlap, allocator; "
        f"{'compiled' if plan.compile else 'eager'}, remat {run['remat']})",
        f"  step {t['step_s']:.3f} s: {t['tokens_per_s']:,.0f} tokens/s, {t['tokens_per_s_per_device']:,.0f} per "
        f"device, MFU {t['mfu']:.1%} (peak {t['peak_flops'] / 1e12:,.0f} TFLOP/s per device)",
        f"  peak {format_bytes(plan.peak_bytes)} reserved + {format_bytes(m['cuda_context_bytes'] + m['nccl_bytes'])} "
        f"CUDA context and NCCL = {format_bytes(plan.device_bytes)} of {format_bytes(plan.capacity_bytes)} ({where}): "
        f"{'fits' if plan.fits else 'DOES NOT FIT'}",
        f"  per microbatch: matmul {t['matmul_s']:.3f} s, attention {t['attention_s']:.3f} s, memory-bound "
        f"{t['memory_bound_s']:.3f} s; exposed fsdp {t['fsdp_exposed_s']:.3f} s of {t['fsdp_s']:.3f}, "
        f"tp {t['tp_s']:.3f} s, {'cp ' + format(t['cp_s'], '.3f') + ' s, ' if t.get('cp_s') else ''}"
        f"ep {t['ep_exposed_s']:.3f} s",
        f"  per step: pipeline {t['pipeline_s']:.3f} s (bubble {t['bubble']:.1%}), optimizer {t['optimizer_s']:.3f}, "
        f"dp {t['dp_exposed_s']:.3f}, fixed {t['fixed_s']:.3f}",
        f"  memory: state {format_bytes(state)}, activations {format_bytes(m['activation_bytes'])} "
        f"({m['inflight_microbatches']} microbatches held), transient {format_bytes(m['transient_bytes'])}, "
        f"fsdp buffers {format_bytes(m['fsdp_gathered_bytes'])}, allocator {format_bytes(m['fragmentation_bytes'])}",
    ]


def format_search(result: SearchResult) -> str:
    """A search result as the table ``shardfn plan --search`` prints (every number the estimate's).

    Example:
        print(format_search(search(cfg, gpus=64)))
    """
    where = "partition.memory_budget" if result.budgeted else "the device"
    head = f"{'#':>3}  {'layout':<58}{'peak':>12}{'step s':>11}{'MFU':>8}{'tokens/s/GPU':>14}"
    lines = [f"layouts on {result.gpus} devices that fit in {format_bytes(result.capacity_bytes)} ({where}), fastest "
             f"first (estimate: plan.runmodel; peak is reserved memory)", head]
    for i, p in enumerate(result.plans, 1):
        lines.append(f"{i:>3}  {p.layout.describe():<58}{format_bytes(p.peak_bytes):>12}"
                     f"{p.time['step_s']:>11.4g}{p.time['mfu']:>8.1%}{p.time['tokens_per_s_per_device']:>14,.0f}")
    if not result.plans:
        lines.append("  (none: every valid layout exceeds the memory)")
    lines.append("")
    lines.append(f"{result.estimated} layouts estimated: {result.fitting} fit ({len(result.ranked)} with their "
                 f"schedule simulated; the rest cannot beat those above), {len(result.too_big)} do not; "
                 f"{result.lowered} lowered for the traced detail; in {result.seconds:.1f} s")
    if result.reference is not None:
        from shardfn.plan.search import format_reference

        lines += format_reference(result.reference, result.capacity_bytes)
    for key, n in sorted(result.refused_by_key().items()):
        example = next(r["reason"] for r in result.refused if r["key"] == key)
        lines.append(f"refused {n} layouts on {key}, e.g. {example}")
    return "\n".join(lines)
