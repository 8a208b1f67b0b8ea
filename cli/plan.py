"""``shardfn plan``: the estimated step time, throughput, MFU, peak memory and fit of a run config
on a simulated mesh of any size, with the traced program's bytes and collectives per rank; or,
with ``--search``, the layouts of N devices that fit, fastest first by the same estimate.

    shardfn plan --config kimi_k2_1t mesh.pp=16 mesh.ep=64 mesh.dp=2 --hardware h200 [--json]
    shardfn plan --config deepseek_v3_671b --search --gpus 2048 [--top 5] [--json]

Nothing is allocated or run: parameters are fake tensors, the mesh is torch's fake process
group, and a reduced model (one or two layers of each kind) is traced and scaled to the full
depth (see ``shardfn.plan`` and docs/plan.md). Exit codes: 0 a plan (whether or not it
fits; see ``fits``) or a search that found a fitting layout, 1 a search that found none,
2 a layout that cannot run (the message names the config key) or a config error.
"""

from __future__ import annotations

import argparse
import json
import sys

_DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardfn plan`` (``--config`` and ``section.key=value`` included)."""
    from shardfn.cli.common import add_config_arguments
    from shardfn.partition.cost.hardware import available_hardware

    add_config_arguments(parser)
    parser.add_argument("--hardware", default="h200", metavar="NAME",
                        help=f"hardware profile: {', '.join(available_hardware())}, or a YAML file (default: h200)")
    parser.add_argument("--json", action="store_true", help="print the plan (or the search's list) as JSON")
    parser.add_argument("--checkpointing", action="store_true",
                        help="plan with activation checkpointing: the same as train.remat=full")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32",
                        help="bfloat16: the same as train.precision=bf16 (fp32 master weights and optimizer "
                             "state, bf16 compute); float32 (default): the config's train.precision")
    parser.add_argument("--gpus", type=int, metavar="N", help="devices: the mesh must use exactly N (required by "
                                                              "--search)")
    parser.add_argument("--search", action="store_true", help="enumerate layouts of --gpus devices; print those that "
                                                              "fit")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="--search: how many fitting layouts (default "
                                                                         "10)")
    parser.add_argument("--schedules", default="1f1b,interleaved_1f1b,zbh1,dualpipev", metavar="LIST",
                        help="--search: pipeline schedules to try, comma-separated")
    parser.add_argument("--microbatches", default=None, metavar="LIST",
                        help="--search: microbatch counts to try, comma-separated (default: pp x 1, 2, 4, 8)")
    parser.add_argument("--trace", type=int, default=0, metavar="N",
                        help="--search: lower the steps of the N fastest layouts for their traced detail (default 0: "
                             "the estimate alone)")
    parser.add_argument("--reference", default=None, metavar="LAYOUT",
                        help="--search: a layout to place in the ranking, as the table prints it, e.g. "
                             "'pp=8 fsdp=2 ep=32 mb=8 interleaved_1f1b ckpt'; the output says its rank and why "
                             "the top layout is faster or slower")
    parser.add_argument("--max-tp", type=int, default=None, metavar="N",
                        help="--search: largest tp to try (default: the hardware's gpus_per_node)")


def run(args: argparse.Namespace) -> int:
    import torch

    from shardfn import plan as planner
    from shardfn.cli.common import UsageError, config_from_args

    cfg = config_from_args(args)
    dtype = getattr(torch, args.dtype)
    try:
        if args.search:
            return _search(cfg, args, dtype)
        plan = planner.make_plan(cfg, hardware=args.hardware, dtype=dtype, checkpointing=args.checkpointing or None,
                                 gpus=args.gpus)
    except planner.PlanError as e:
        raise UsageError(str(e)) from None
    except (ValueError, FileNotFoundError) as e:  # a hardware profile or schedule name
        raise UsageError(str(e)) from None
    print(json.dumps(plan.to_dict()) if args.json else planner.format_plan(plan))
    return 0


def _search(cfg, args: argparse.Namespace, dtype) -> int:
    from shardfn import plan as planner
    from shardfn.cli.common import UsageError
    from shardfn.partition.pipeline.schedules import SCHEDULES, canonical_name

    if not args.gpus:
        raise UsageError("--search needs --gpus N, the number of devices to lay the run out on")
    schedules = tuple(canonical_name(s.strip()) for s in args.schedules.split(",") if s.strip())
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise UsageError(f"--schedules: unknown schedule {unknown[0]!r}; valid: {', '.join(SCHEDULES)}")
    try:
        microbatches = [int(m) for m in args.microbatches.split(",")] if args.microbatches else None
    except ValueError:
        raise UsageError(f"--microbatches takes comma-separated integers, got {args.microbatches!r}") from None
    checkpointing = (True,) if args.checkpointing else (False, True)
    try:
        reference = planner.Layout.parse(args.reference) if args.reference else None
    except ValueError as e:
        raise UsageError(f"--reference: {e}") from None
    result = planner.search(cfg, args.gpus, hardware=args.hardware, dtype=dtype, schedules=schedules,
                            microbatches=microbatches, checkpointing=checkpointing, max_tp=args.max_tp,
                            top=args.top, trace=args.trace, reference=reference,
                            progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(result.to_list()))
    else:
        print(planner.format_search(result))
    return 0 if result.plans else 1
