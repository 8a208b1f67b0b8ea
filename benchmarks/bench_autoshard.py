"""Auto-sharding at scale: build and solve time, and the plan's estimated step against presets.

Two cases, planned on fake meshes (nothing runs; shapes only):

    llama3_8b          all 32 layers, 8 x 8192 tokens, AdamW, on a dp=8 x tp=8 mesh of H100s
                       (meta-pytorch/autoparallel reports about 52 s to solve this case)
    deepseek_v3_671b   the first 5 of 61 layers (3 dense + 2 MoE, routed experts in all-to-all
                       regions over ep), 64 x 4096 tokens, on a dp=8 x ep=8 mesh of H100s: the
                       whole model (or 8 of its layers at this batch) does not fit 64 GPUs' memory,
                       and repeated layers share one choice, so more layers add trace time rather
                       than solve time

For each: trace seconds, ILP build and solve seconds (wall and process CPU: the CPU time is what
the machine's load does not inflate), graph nodes, tied classes and variables, the solver status,
and the estimated step and memory of the plan and of the dp / fsdp / tp / fsdp_tp presets
(each the same cost model's optimum with the preset's input specs fixed, under the same budget).

    python benchmarks/bench_autoshard.py                  # writes benchmarks/results/bench_autoshard.json
    python benchmarks/bench_autoshard.py --only llama3_8b --time-limit 30
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fixtures import fake_train_step  # noqa: E402  (tests/fixtures.py)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_autoshard.json"

CASES = {
    "llama3_8b": {
        "config": "llama3_8b",
        "mesh": {"dp": 8, "tp": 8},
        "overrides": ["mesh.fsdp=1", "mesh.dp=8", "mesh.tp=8"],
        "note": "all 32 layers; batch 8 x 8192 tokens",
    },
    "deepseek_v3_671b": {
        "config": "deepseek_v3_671b",
        "mesh": {"dp": 8, "ep": 8},
        "overrides": ["model.n_layers=5", "train.batch_size=64", "train.seq_len=4096", "mesh.pp=1", "mesh.dp=8",
                      "mesh.ep=8", "pipeline.microbatches=1"],
        "note": "first 5 of 61 layers (3 dense + 2 MoE); batch 64 x 4096 tokens",
    },
}


class Timer:
    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def train_step_args(config: str, overrides: list[str], mesh):
    """``(train_step, (params, opt_state, batch), param_axes)`` of a packaged config, on fake tensors
    (tests/fixtures.py)."""
    return fake_train_step(config, overrides, mesh)


def run_case(name: str, case: dict, *, hardware: str, time_limit_s: float) -> dict:
    import shardfn as sf
    from shardfn.partition import auto
    from shardfn.partition.local_map import mesh_scope
    from shardfn.partition.spmd.trace import trace

    mesh = sf.Mesh(case["mesh"], fake=True)
    step, args, param_axes = train_step_args(case["config"], case["overrides"], mesh)
    with Timer() as t_trace, mesh_scope(mesh):
        traced = trace(step, args)
    with Timer() as t_solve:
        result = auto.solve(traced, mesh, hardware=hardware, time_limit_s=time_limit_s,
                            arg_names=("params", "opt_state", "batch"))
    with Timer() as t_presets:
        rows = result.compare(auto.presets(mesh, args, param_axes))
    print(f"\n== {name} ({case['note']}) on mesh {case['mesh']}, {hardware}")
    print(result.summary().split("\n  params")[0])
    print(result.comparison_table(auto.presets(mesh, args, param_axes)))
    fitting = [r["step_s"] for r in rows[1:] if r.get("fits")]
    stats = result.stats
    return {
        "model": case["config"], "note": case["note"], "mesh": case["mesh"], "hardware": hardware,
        "nodes": stats["nodes"], "classes": stats["classes"], "variables": stats["variables"],
        "constraints": stats["constraints"], "status": result.status, "time_limit_s": time_limit_s,
        "trace_s": round(t_trace.wall, 2), "trace_cpu_s": round(t_trace.cpu, 2),
        "build_s": round(stats["build_s"], 2), "solve_s": round(stats["solve_s"], 2),
        "build_and_solve_s": round(t_solve.wall, 2), "build_and_solve_cpu_s": round(t_solve.cpu, 2),
        "presets_s": round(t_presets.wall, 2),
        "auto_vs_best_preset": None if not fitting else round(result.cost.step_s / min(fitting), 4),
        "rows": rows,
        "rules_yaml": result.to_rules_yaml(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--time-limit", type=float, default=60.0, help="HiGHS time limit per solve, seconds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {name: run_case(name, CASES[name], hardware=args.hardware, time_limit_s=args.time_limit)
               for name in (args.only or CASES)}
    out = {
        "benchmark": "bench_autoshard",
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": _cpus(),
                    "load_average": _load()},
        "cases": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"\nwrote {args.out}")


def _cpus() -> int:
    import os

    return os.cpu_count() or 1


def _load():
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


if __name__ == "__main__":
    main()
