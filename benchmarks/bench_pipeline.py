"""Pipeline schedules measured on real gloo ranks against the unit-time simulator.

For each schedule (gpipe, 1f1b, interleaved_1f1b, zbh1, dualpipev) on 2 and 4 ranks, runs a
stacked-layer model's training step and records every action's start and end on every rank.
Reports, per schedule and rank count:

- ``bubble_measured``: idle share of the ranks' time over the step (P2P waits count as idle);
- ``bubble_unit``: the simulator's prediction with unit costs (F=1, B=2, I=1, W=1);
- ``bubble_calibrated``: the simulator's prediction with the measured mean F / I / W / B times;
- ``step_s`` (median of the timed steps) and ``step_s_predicted`` (the calibrated makespan);
- ``peak_saved_bytes``: per rank, the most bytes of activations and saved tensors held at once,
  and ``peak_inflight``: the simulator's count of microbatches in flight per rank.

    python benchmarks/bench_pipeline.py                       # 2 and 4 ranks, every schedule
    python benchmarks/bench_pipeline.py --ranks 2 --schedules 1f1b zbh1 --trace runs/trace

Writes ``benchmarks/results/bench_pipeline.json``. On a machine with fewer cores than ranks the
ranks share cores, so measured bubbles there mix pipeline idling with time slicing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fixtures import tiny_loss, tiny_params  # noqa: E402  (the tests' model: tests/fixtures.py)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbh1", "dualpipev")
RESULTS = Path(__file__).resolve().parent / "results" / "bench_pipeline.json"


# ----------------------------------------------------------------------------- one rank


def _rank(args: dict) -> dict:
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.core import optim
    from shardfn.partition.schedules import get_schedule
    from shardfn.partition.stages import build_pipeline
    from shardfn.runtime import executor
    from shardfn.runtime.pipeline_step import make_pipeline_step

    pp, m = args["ranks"], args["microbatches"]
    mesh = sf.Mesh({"pp": pp})
    rank = mesh.coordinate()["pp"]
    loss = tiny_loss
    params = tiny_params(args["layers"], dim=args["dim"], hidden=args["mlp"], vocab=args["vocab"])
    g = torch.Generator().manual_seed(1)
    batch = {
        k: torch.randint(0, args["vocab"], (args["rows"] * m, args["seq"]), generator=g) for k in ("inputs", "targets")
    }
    out = {}
    for name in args["schedules"]:
        sched = get_schedule(name, pp, m)
        pipe = build_pipeline(loss, params, {k: v[: args["rows"]] for k, v in batch.items()}, sched.n_stages,
                              split=sched.stages_of(rank))
        step = make_pipeline_step(pipe, sched, mesh, lambda norm: optim.chain(optim.clip_by_global_norm(1.0, norm=norm),
                                                                             optim.adamw(1e-3)), record=True)
        local = step.scatter(params)
        state = step.optimizer.init(local)
        runs = []
        for i in range(args["warmup"] + args["steps"]):
            dist.barrier()
            local, state, _ = step(local, state, batch)
            if i >= args["warmup"]:
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, step.last_run.events)
                runs.append({"events": [e for evs in everyone for e in evs],
                             "peak": step.last_run.peak_saved_bytes})
        if args["trace"] and rank == 0:
            executor.write_chrome_trace(runs[-1]["events"], Path(args["trace"]) / f"{name}_pp{pp}.json")
        out[name] = runs
    return out


# ----------------------------------------------------------------------------- analysis


def _mean_costs(events: list[dict]) -> dict[str, float]:
    kinds: dict[str, list[float]] = {}
    for e in events:
        if e["kind"] != "P2P":
            kinds.setdefault(e["kind"], []).append((e["end_ns"] - e["start_ns"]) / 1e9)
    return {k: statistics.mean(v) for k, v in kinds.items()}


def summarize(name: str, pp: int, m: int, runs_per_rank: list[list[dict]]) -> dict:
    from shardfn.partition.schedules import get_schedule, simulate
    from shardfn.runtime import executor

    sched = get_schedule(name, pp, m, communication=False)
    runs = runs_per_rank[0]  # every rank gathered the same events
    steps_s = [(max(e["end_ns"] for e in r["events"]) - min(e["start_ns"] for e in r["events"])) / 1e9 for r in runs]
    bubbles = [executor.bubble_fraction(r["events"]) for r in runs]
    costs = _mean_costs([e for r in runs for e in r["events"]])
    used = {k for rank_actions in sched.actions for k in (a.kind for a in rank_actions)}
    calibrated = simulate(sched, costs={k: costs[k] for k in used if k in costs})
    unit = simulate(sched)
    return {
        "schedule": name, "ranks": pp, "microbatches": m, "stages": sched.n_stages,
        "bubble_measured": statistics.median(bubbles),
        "bubble_unit": unit.bubble,
        "bubble_calibrated": calibrated.bubble,
        "step_s": statistics.median(steps_s),
        "step_s_predicted": calibrated.makespan,
        "mean_action_s": costs,
        "peak_saved_bytes": [max(r["peak"] for r in rank_runs) for rank_runs in runs_per_rank],
        "peak_inflight": list(unit.peak_inflight),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--mlp", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows", type=int, default=2, help="rows per microbatch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--trace", default=None, help="write a Chrome trace per schedule into this directory")
    ap.add_argument("--out", default=str(RESULTS))
    ns = ap.parse_args(argv)

    from shardfn.runtime.launch import spawn

    rows = []
    for pp in ns.ranks:
        args = {k: getattr(ns, k) for k in ("microbatches", "layers", "dim", "mlp", "vocab", "seq", "rows",
                                            "steps", "warmup", "trace", "schedules")}
        args["ranks"] = pp
        tic = time.perf_counter()
        per_rank = spawn(_rank, pp, args=(args,), timeout_s=1800)
        print(f"pp{pp}: {time.perf_counter() - tic:.0f} s", file=sys.stderr)
        for name in ns.schedules:
            row = summarize(name, pp, ns.microbatches, [r[name] for r in per_rank])
            rows.append(row)
            print(f"{name:>17} pp{pp}: bubble {row['bubble_measured']:.3f} measured, {row['bubble_unit']:.3f} unit, "
                  f"{row['bubble_calibrated']:.3f} calibrated; step {row['step_s'] * 1e3:.1f} ms "
                  f"(predicted {row['step_s_predicted'] * 1e3:.1f}); peak saved MiB "
                  f"{[round(b / 2**20, 2) for b in row['peak_saved_bytes']]}")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = {k: getattr(ns, k) for k in ("layers", "dim", "mlp", "vocab", "seq", "rows", "microbatches")}
    out.write_text(json.dumps({"model": model, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                               "results": rows}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
