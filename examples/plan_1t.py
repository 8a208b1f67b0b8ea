"""Planning a 1T-parameter run (Kimi K2: 61 layers, 384 experts) on 2048 simulated GPUs.

The planner allocates nothing and runs nothing: parameter, gradient and optimizer bytes per rank
are exact from shapes and specs; activations and collectives come from lowering the run's own
train step on a fake mesh; step time from a hardware profile (``docs/plan.md``).

    python examples/plan_1t.py            # layouts' state per rank, then the full plan (about 1-2 min)
    python examples/plan_1t.py --quick    # the state per rank and the refusals only (seconds)

The same from the command line: ``shardfn plan --config kimi_k2_1t --dtype bfloat16 --checkpointing``.
"""

import sys

import torch

from shardfn import models
from shardfn.config import load_config
from shardfn.core.units import format_bytes, format_count
from shardfn.plan import Layout, PlanError, check_layout, format_plan, make_plan, memory_bytes

GPUS = 2048

LAYOUTS = {  # candidate layouts of 2048 GPUs: (pp, fsdp, ep, tp), microbatches, schedule
    "pp16 fsdp8 ep16 (the config's)": Layout(pp=16, fsdp=8, ep=16, microbatches=128, schedule="interleaved_1f1b"),
    "pp16 dp8 ep16": Layout(pp=16, dp=8, ep=16, microbatches=128, schedule="interleaved_1f1b"),
    "pp8 fsdp16 ep16": Layout(pp=8, fsdp=16, ep=16, microbatches=64, schedule="1f1b"),
    "fsdp16 ep16 tp8": Layout(fsdp=16, ep=16, tp=8),
}

REFUSED = {  # layouts the run would refuse, with the config key the message names
    "ep 256": Layout(pp=8, ep=256),  # 384 experts do not split 256 ways
    "1024 ranks": Layout(pp=16, ep=64),  # not the 2048 GPUs asked for
}


def main(argv=()) -> dict:
    quick = "--quick" in argv
    cfg = load_config("kimi_k2_1t")
    counts = models.get(cfg.model_name).param_counts(cfg.model)
    print(f"kimi_k2_1t: {format_count(counts['total'])} parameters, {format_count(counts['active'])} active per token")

    print(f"\nstate per rank (pipeline rank 0, float32 master weights and AdamW state), {GPUS} GPUs:")
    states = {}
    for name, layout in LAYOUTS.items():
        check_layout(cfg, layout, gpus=GPUS)
        rank0 = memory_bytes(cfg, layout)[0]
        states[name] = rank0
        total = rank0["params"] + rank0["grads"] + rank0["opt_state"]
        print(f"  {name:<32} params {format_bytes(rank0['params']):>10}  grads {format_bytes(rank0['grads']):>10}"
              f"  optimizer {format_bytes(rank0['opt_state']):>10}  = {format_bytes(total)}")

    refused = {}
    for name, layout in REFUSED.items():
        try:
            check_layout(cfg, layout, gpus=GPUS)
        except PlanError as e:
            refused[name] = e.key
            print(f"  refused, {name}: {e}")

    plan = None
    if not quick:  # the config's own layout, with bf16 compute and activation checkpointing
        plan = make_plan(cfg, hardware="h200", dtype=torch.bfloat16, checkpointing=True)
        print()
        print(format_plan(plan))
    return {"states": states, "refused": refused, "plan": plan}


if __name__ == "__main__":
    main(sys.argv[1:])
