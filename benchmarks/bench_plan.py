"""Planning Kimi-K2 1T on 1024 and on 4096 simulated ranks: wall time and peak resident memory;
and ``--published``: the published runs against the one estimate, the README's search timed, and
where published MoE layouts rank in ``--search``.

Each case runs in its own process (so its peak RSS is its own) and plans the config's run
(interleaved 1F1B, 128 microbatches or one row each when fewer rows, global batch 16384 x 4096, bfloat16, activation
checkpointing) at ``pp=16, ep=64`` with ``dp`` filling the rank count. Targets on a 2-core machine: under
60 s and 4 GB per case, and wall time
growing less than linearly in the rank count (4x the ranks, less than 4x the time).

    python benchmarks/bench_plan.py                   # writes benchmarks/results/bench_plan.json
    python benchmarks/bench_plan.py --case 1024       # one case, JSON on stdout
    python benchmarks/bench_plan.py --published       # writes benchmarks/results/bench_plan_published.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RANKS = (1024, 4096)
PP, EP = 16, 64
TARGET_S, TARGET_RSS = 60.0, 4 * 2**30
RESULTS = Path(__file__).resolve().parent / "results" / "bench_plan.json"


def case(ranks: int, hardware: str = "h200") -> dict:
    """Plan the case in this process; return its numbers (peak RSS of this process included)."""
    tic = time.perf_counter()
    import torch

    from shardfn.config import load_config
    from shardfn.plan import make_plan

    dp = ranks // (PP * EP)
    rows = 16384 // (dp * EP)  # the config's global batch per data-parallel rank
    cfg = load_config("kimi_k2_1t", [f"mesh.pp={PP}", f"mesh.ep={EP}", f"mesh.dp={dp}", "mesh.fsdp=1", "mesh.tp=1",
                                     f"pipeline.microbatches={min(128, rows)}"])
    imported = time.perf_counter()
    plan = make_plan(cfg, hardware=hardware, dtype=torch.bfloat16, checkpointing=True)
    done = time.perf_counter()
    return {
        "ranks": ranks, "layout": plan.layout.describe(), "traced_mesh": plan.trace["mesh"],
        "plan_s": round(done - imported, 3), "import_and_config_s": round(imported - tic, 3),
        "trace_s": plan.trace["seconds"], "lowered": plan.trace["lowered"],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "traced_peak_bytes_per_rank": plan.per_rank["peak_bytes"], "peak_reserved_bytes": plan.peak_bytes,
        "fits": plan.fits, "step_s": plan.time["step_s"], "mfu": plan.time["mfu"],
    }


def run_case(ranks: int) -> dict:
    """The case in a fresh interpreter; ``wall_s`` is the whole process, start to exit."""
    tic = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--case", str(ranks)], capture_output=True, text=True, timeout=1800
    )
    wall = time.perf_counter() - tic
    if proc.returncode:
        raise RuntimeError(f"case {ranks} failed:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(wall, 3)
    return out


REFERENCES = (
    # (what, config, overrides, gpus, hardware, the published layout)
    ("TorchTitan DeepSeek-V3 671B, 512 H100 (FSDP 64 / EP 32 / PP 8)", "deepseek_v3_671b",
     ["train.seq_len=4096", "train.batch_size=512", "pipeline.microbatches=4", "partition.memory_budget=null"],
     512, "h100",
     "pp=8 fsdp=2 ep=32 mb=8 interleaved_1f1b ckpt"),
    ("DeepSeek-V3 671B, 2048 GPUs, the report's layout (PP 16 DualPipe / EP 64 / DP 2)", "deepseek_v3_671b", [], 2048,
     "h200", "pp=16 dp=2 ep=64 mb=120 dualpipev ckpt"),
    ("DeepSeek-V3 671B, 2048 H100, Megatron-Core's layout (TP 2 / PP 16 / EP 64; EP folded into DP)",
     "deepseek_v3_671b", [], 2048, "h100", "pp=16 tp=2 ep=64 mb=240 interleaved_1f1b ckpt"),
    ("Kimi-K2 1T, 2048 GPUs, the report's layout (PP 16 interleaved / EP 16 / FSDP 8)", "kimi_k2_1t", [], 2048, "h200",
     "pp=16 fsdp=8 ep=16 mb=128 interleaved_1f1b ckpt"),
)
"""Published layouts the search places (``benchmarks/bench_plan.py --published``; docs/plan.md)."""


def published() -> dict:
    """Every published run's error against the one estimate, the README's search timed twice
    (the same answer both times), and where each of :data:`REFERENCES` ranks in its search."""
    import torch

    from shardfn.config import load_config
    from shardfn.plan import Layout, search
    from shardfn.plan.published import table_rows

    rows = table_rows()
    tic = time.perf_counter()
    cfg = load_config("deepseek_v3_671b")
    first = search(cfg, 2048, dtype=torch.bfloat16, top=5)
    readme_s = time.perf_counter() - tic
    again = search(cfg, 2048, dtype=torch.bfloat16, top=5)
    places = []
    for what, name, overrides, gpus, hardware, layout in REFERENCES:
        found = search(load_config(name, overrides), gpus, hardware=hardware, dtype=torch.bfloat16, top=5,
                       reference=Layout.parse(layout))
        places.append({"what": what, "top": [p.layout.describe() for p in found.plans],
                       "top_tokens_per_s_per_device": [round(p.time["tokens_per_s_per_device"]) for p in found.plans],
                       "reference": found.reference, "seconds": round(found.seconds, 1)})
    return {
        "published_runs": [{k: r[k] for k in ("name", "tokens_ratio", "memory_ratio", "fitted", "known_gap")}
                           for r in rows],
        "readme_search": {"seconds": round(readme_s, 1), "top": [p.layout.describe() for p in first.plans],
                          "same_answer_twice": [p.layout.describe() for p in first.plans]
                          == [p.layout.describe() for p in again.plans],
                          "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()},
        "references": places,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=int, help="run one case in this process and print its JSON")
    parser.add_argument("--published", action="store_true", help="published runs, the README search and "
                                                                  "published layouts' ranks")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.published:
        out = args.out if args.out != RESULTS else RESULTS.with_name("bench_plan_published.json")
        result = published()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(json.dumps(result, indent=2, default=str))
        return 0
    if args.case:
        print(json.dumps(case(args.case)))
        return 0
    cases = [run_case(n) for n in RANKS]
    small, large = cases
    ratio = large["wall_s"] / small["wall_s"]
    result = {
        "benchmark": "plan kimi_k2_1t", "cases": cases,
        "wall_ratio_4096_over_1024": round(ratio, 3), "rank_ratio": RANKS[1] / RANKS[0],
        "targets": {"wall_s": TARGET_S, "peak_rss_bytes": TARGET_RSS, "wall_ratio_below": RANKS[1] / RANKS[0]},
        "met": {"wall_s": all(c["wall_s"] < TARGET_S for c in cases),
                "peak_rss": all(c["peak_rss_bytes"] < TARGET_RSS for c in cases),
                "sublinear": ratio < RANKS[1] / RANKS[0]},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for c in cases:
        print(f"{c['ranks']:>5} ranks: {c['wall_s']:6.1f} s wall ({c['plan_s']:.1f} s planning, {c['trace_s']:.1f} s "
              f"tracing), peak RSS {c['peak_rss_bytes'] / 2**30:.2f} GiB  [{c['layout']}]")
    print(f"wall time ratio 4096 / 1024 ranks: {ratio:.2f} (rank ratio {RANKS[1] / RANKS[0]:.0f}); "
          f"targets met: {result['met']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
