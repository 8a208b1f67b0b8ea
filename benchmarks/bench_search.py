"""The searched layout against the hand layouts it could have chosen, measured on 4 gloo ranks.

For each model (moe_tiny, and the example model written on the model contract,
``examples/models/qwen_moe.yaml``) ``plan.search`` ranks every layout of 4 devices by the
estimate on the ``cpu`` hardware profile (what ``shardfn train --search`` runs); its first layout
is then trained beside the hand layouts dp4, fsdp4, ep4, dp2 x ep2, pp2 x ep2 and tp2 x dp2, all
built in the same 4 processes (one compute thread each) and timed in rounds: every round runs one
step of each layout, in an order that rotates from round to round, behind a barrier. Reported:
each layout's median step, and the searched layout's median over the best hand layout's (the
per-round ratio's median; <= 1.0 means the search chose no worse than a person could).

    python benchmarks/bench_search.py [--rounds 8] [--out benchmarks/results/bench_search.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"moe_tiny": "moe_tiny", "example qwen_moe": str(ROOT / "examples" / "models" / "qwen_moe.yaml")}
SIZE = ["train.batch_size=8", "train.seq_len=128"]
HAND = {
    "dp4": ["mesh.dp=4"],
    "fsdp4": ["mesh.fsdp=4"],
    "ep4": ["mesh.ep=4"],
    "dp2 x ep2": ["mesh.dp=2", "mesh.ep=2"],
    "pp2 x ep2": ["mesh.pp=2", "mesh.ep=2", "pipeline.microbatches=2"],
    "tp2 x dp2": ["mesh.tp=2", "mesh.dp=2"],
}


def searched(config: str) -> tuple[str, list[str], float, int]:
    """The layout ``shardfn train --search`` would run on 4 CPU ranks: its description, overrides,
    estimated step and how many layouts fit."""
    from shardfn import plan as planner
    from shardfn.config import load_config

    cfg = load_config(config, SIZE)
    result = planner.search(cfg, 4, hardware="cpu", top=1)
    step_s, layout = result.ranked[0]
    return layout.describe(), layout.overrides(cfg.train.remat), step_s, result.fitting


def _same_layout(a: list[str], b: list[str], config: str) -> bool:
    from shardfn.config import load_config
    from shardfn.plan import Layout

    def of(over):
        cfg = load_config(config, [*SIZE, *over])
        return Layout.from_config(cfg, checkpointing=cfg.train.remat != "none")

    return of(a) == of(b)


def _worker(config: str, layouts: dict, rounds: int) -> dict:
    import torch.distributed as dist

    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.build import build_step

    torch.set_num_threads(1)
    runs = {}
    for name, over in layouts.items():
        cfg = load_config(config, [*SIZE, *over])
        model = models.get(cfg.model_name)
        params = model.init(cfg.model, cfg.train.seed)
        step = build_step(cfg, model, params)
        t = cfg.train
        batch = data.get_batch(data.from_config(cfg.data), 0, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed)
        state = list(step.place(params))

        def run(step=step, state=state, batch=batch):
            state[0], state[1], metrics = step(state[0], state[1], batch)
            return metrics

        for _ in range(2):  # lowering, allocator warm-up
            loss = float(run()["loss"])
        runs[name] = run
        if dist.get_rank() == 0:
            print(f"  built {name}: loss after two steps {loss:.4f}", flush=True)
    times: dict = {name: [] for name in layouts}
    names = list(layouts)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            tic = time.perf_counter()
            runs[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - tic)
    return times


def measure(label: str, config: str, rounds: int) -> dict:
    from shardfn.runtime.launch import spawn

    desc, over, estimate, fitting = searched(config)
    same = next((name for name, hand in HAND.items() if _same_layout(over, hand, config)), None)
    layouts = dict(HAND) if same else {**HAND, "searched": over}
    print(f"{label}: the search chose {desc} (estimate {estimate * 1e3:.2f} ms, {fitting} layouts fit)"
          f"{f', which is {same}' if same else ''}", flush=True)
    times = spawn(_worker, 4, args=(config, layouts, rounds), timeout_s=3600)[0]
    chosen = same or "searched"
    medians = {name: statistics.median(t) for name, t in times.items()}
    best_hand = min((n for n in HAND if n != chosen), key=medians.get)
    ratio = statistics.median(a / b for a, b in zip(times[chosen], times[best_hand]))
    print(f"{label}: searched ({chosen}) {medians[chosen] * 1e3:.1f} ms, best other hand layout ({best_hand}) "
          f"{medians[best_hand] * 1e3:.1f} ms -> {ratio:.3f}x (median of {rounds} round ratios)", flush=True)
    return {"searched": desc, "searched_is": chosen, "estimate_s": estimate, "fitting": fitting,
            "median_s": medians, "best_other": best_hand, "ratio": ratio, "rounds": rounds}


def table(rows: dict) -> str:
    names = list(HAND)
    lines = ["| model | searched layout | " + " | ".join(f"{n} ms" for n in names) + " | searched / best other |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for label, r in rows.items():
        cells = " | ".join(f"{r['median_s'][n] * 1e3:.0f}" for n in names)
        lines.append(f"| {label} | {r['searched']} ({r['searched_is']}) | {cells} | {r['ratio']:.3f}x |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default="benchmarks/results/bench_search.json")
    args = parser.parse_args()
    rows = {label: measure(label, MODELS[label], args.rounds) for label in args.models}
    print(table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
