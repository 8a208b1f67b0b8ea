"""``shardfn inspect``: lower a config's train step on a simulated mesh and print what it does.

Nothing runs: the mesh is built on the fake process group (one process), the step is traced and
partitioned exactly as ``shardfn train`` would, and the report lists its collectives (op, mesh
axis, bytes, count per step per rank) and its memory per rank. Under ``mesh.ep > 1`` it also
lists the MoE all-to-alls the runtime runs (``runtime.moe_dispatch.planned_rows``): the tokens
per expert, exactly, and the token exchanges for uniform routing.

    shardfn inspect --config examples/configs/llama_tiny.yaml mesh.fsdp=2 mesh.tp=2 [--text] [--json]
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shardfn.cli.common import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print {comm: [...], memory: {...}} as JSON")
    parser.add_argument("--text", action="store_true", help="also print the graph with each value's placements")


def lower_config(cfg):
    """The config's partitioned train step, lowered on a fake mesh of its world size (the same
    lowering the planner measures: ``shardfn.plan.lower_step``)."""
    from shardfn.plan import lower_step

    if cfg.mesh.pp > 1:
        raise ValueError("shardfn inspect lowers one program; for mesh.pp > 1 use `shardfn plan`")
    return lower_step(cfg)


def runtime_rows(lowered) -> list[dict]:
    """The collectives the runtime runs for the lowered program (the MoE all-to-alls), per step.

    Example:
        runtime_rows(lower_config(load_config("moe_tiny", ["mesh.ep=2"])))   # two all_to_all rows over ep
    """
    from shardfn.runtime.moe_dispatch import planned_rows

    return planned_rows(lowered.graph_module, lowered.mesh)


def run(args: argparse.Namespace) -> int:
    from shardfn.cli.common import UsageError, config_from_args

    cfg = config_from_args(args)
    try:
        lowered = lower_config(cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    comm, memory = lowered.comm_report() + runtime_rows(lowered), lowered.memory_report()
    if args.json:
        print(json.dumps({"comm": comm, "memory": memory}))
        return 0
    if args.text:
        print(lowered.as_text())
        print()
    print(f"collectives per step per rank ({lowered.mesh}):")
    for row in comm:
        what = f"  {row['what']}" if "what" in row else ""
        what += " (uniform routing)" if row.get("what") == "moe tokens" else ""
        print(f"  {row['op']:<15}{row['axis']:<6}{row['count']:>5} x  {row['bytes']:>14,} B{what}")
    print("memory per rank:")
    for name, value in memory.items():
        print(f"  {name:<12}{value:>16,} B")
    return 0
