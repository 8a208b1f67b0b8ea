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

Then, on the same 4 ranks, one run config (llama_tiny, 4 layers) as three layouts built side by
side in one set of processes -- pp2 x fsdp2, fsdp4 and pp4 -- stepped in turn (A, B, C, A, ...):
per layout the median step time, its ratio to fsdp4 (the median of the per-round ratios), and
each rank's peak bytes: the state it holds (parameters and optimizer state, from the step's
reports) plus the most resident memory one step adds (measured: the peak RSS counter).

    python benchmarks/bench_pipeline.py                       # 2 and 4 ranks, every schedule; the layouts
    python benchmarks/bench_pipeline.py --ranks 2 --schedules 1f1b zbh1 --trace runs/trace --no-layouts

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
from fixtures import MEASURE_ENV, peak_rss_increase, tiny_loss, tiny_params  # noqa: E402  (tests/fixtures.py)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbh1", "dualpipev")
RESULTS = Path(__file__).resolve().parent / "results" / "bench_pipeline.json"


# ----------------------------------------------------------------------------- one rank


def _rank(args: dict) -> dict:
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.core import optim
    from shardfn.partition.pipeline.schedules import get_schedule
    from shardfn.partition.pipeline.split import build_pipeline
    from shardfn.runtime import executor
    from shardfn.runtime.pipeline_step import RunOptions, make_pipeline_step

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
                              split=())
        step = make_pipeline_step(pipe, sched, mesh, lambda norm: optim.chain(optim.clip_by_global_norm(1.0, norm=norm),
                                                                             optim.adamw(1e-3)),
                                  run=RunOptions(record=True))
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


LAYOUTS = {"pp2xfsdp2": ["mesh.pp=2", "mesh.fsdp=2"], "fsdp4": ["mesh.fsdp=4"], "pp4": ["mesh.pp=4"]}
LAYOUT_BASE = ["model.n_layers=4", "model.dim=256", "model.ffn_dim=768", "train.batch_size=16", "train.seq_len=64",
               "pipeline.schedule=1f1b", "pipeline.microbatches=4", "train.warmup_steps=1"]


def _layouts_rank(rounds: int) -> dict:
    """Every layout of :data:`LAYOUTS` on these 4 ranks, stepped in turn ``rounds`` times."""
    import torch.distributed as dist

    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.build import build_step
    from shardfn.runtime.param_source import abstract

    steps, states = {}, {}
    for name, mesh in LAYOUTS.items():
        cfg = load_config("llama_tiny", [*LAYOUT_BASE, *mesh])
        model = models.get(cfg.model_name)
        step = build_step(cfg, model, abstract(model.init(cfg.model, 0, device="meta"), "cpu"))
        steps[name] = step
        states[name] = step.place(lambda regions, c=cfg, m=model: m.init(c.model, 0, regions=regions))
    tokens = data.from_config(cfg.data)
    batch = data.get_batch(tokens, 0, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len)
    times: dict = {name: [] for name in LAYOUTS}
    memory: dict = {}
    for r in range(rounds + 2):  # the first round warms up, the last measures memory
        for name, step in steps.items():
            dist.barrier()
            tic = time.perf_counter()
            if r == rounds + 1:  # held state (reports) + the most the step adds (measured)
                (p, s, m), added = peak_rss_increase(lambda: step(*states[name], batch))
                report = step.memory_report()
                memory[name] = report["params"] + report["opt_state"] + added
            else:
                p, s, m = step(*states[name], batch)
            float(m["loss"])
            dist.barrier()
            if 0 < r <= rounds:
                times[name].append(time.perf_counter() - tic)
            states[name] = (p, s)
    return {"times": times, "memory": memory}


def layouts(rounds: int) -> list[dict]:
    from shardfn.runtime.launch import spawn

    os.environ.update(MEASURE_ENV)  # the ranks start with it: every large block its own mapping
    per_rank = spawn(_layouts_rank, 4, args=(rounds,), timeout_s=1800)
    times = per_rank[0]["times"]
    rows = []
    for name in LAYOUTS:
        ratios = [a / b for a, b in zip(times[name], times["fsdp4"])]
        rows.append({"layout": name, "ranks": 4, "step_s": statistics.median(times[name]),
                     "ratio_to_fsdp4": statistics.median(ratios),
                     "peak_bytes_per_rank": [r["memory"][name] for r in per_rank]})
        row = rows[-1]
        print(f"{name:>10} on 4 ranks: step {row['step_s'] * 1e3:.1f} ms ({row['ratio_to_fsdp4']:.2f}x fsdp4), "
              f"peak MiB per rank {[round(b / 2**20, 2) for b in row['peak_bytes_per_rank']]}")
    return rows


# ----------------------------------------------------------------------------- analysis


def _mean_costs(events: list[dict]) -> dict[str, float]:
    kinds: dict[str, list[float]] = {}
    for e in events:
        if e["kind"] != "P2P":
            kinds.setdefault(e["kind"], []).append((e["end_ns"] - e["start_ns"]) / 1e9)
    return {k: statistics.mean(v) for k, v in kinds.items()}


def summarize(name: str, pp: int, m: int, runs_per_rank: list[list[dict]]) -> dict:
    from shardfn.partition.pipeline.schedules import get_schedule, simulate
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
    ap.add_argument("--no-layouts", action="store_true", help="skip the pp2 x fsdp2 / fsdp4 / pp4 comparison")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of the layout comparison")
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
    layout_rows = [] if ns.no_layouts else layouts(ns.rounds)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = {k: getattr(ns, k) for k in ("layers", "dim", "mlp", "vocab", "seq", "rows", "microbatches")}
    out.write_text(json.dumps({"model": model, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                               "results": rows, "layouts": {"config": ["llama_tiny", *LAYOUT_BASE],
                                                            "results": layout_rows}}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
