"""Activation memory and step time under each remat policy and precision, on one device.

A Llama model of dim 256, 8 layers, at seq 512 (batch 4): the train step traced once per
combination (``train.remat`` x ``train.precision``) and run as its rewritten graph, so every
combination runs the same way. Per combination:

- ``reported_bytes``: the program's peak of the values it makes (``report.peak_temporary_bytes``,
  what ``memory_report()["activations"]`` and the planner say);
- ``measured_bytes``: the most resident memory one step adds (the peak RSS counter, reset before
  the step; tensors of 128 KiB and more are their own mappings, so this is the allocator's peak);
- ``step_s``: the median step time, the combinations stepped in turn (A, B, C, ... A, B, C),
  and its ratio to ``none`` / fp32 (the median of the per-round ratios).

    python benchmarks/bench_memory.py            # writes benchmarks/results/bench_memory.json
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
from fixtures import MEASURE_ENV, peak_rss_increase  # noqa: E402  (tests/fixtures.py)

RESULTS = Path(__file__).resolve().parent / "results" / "bench_memory.json"
COMBOS = [(p, r) for p in ("fp32", "bf16") for r in ("none", "selective", "full")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS))
    ns = ap.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in MEASURE_ENV.items()):  # measure with fixed allocator settings
        os.execve(sys.executable, [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])],
                  {**os.environ, **MEASURE_ENV})

    from shardfn import models
    from shardfn.config import load_config
    from shardfn.core.pytree import tree_map
    from shardfn.partition.passes.remat import remat
    from shardfn.partition.spmd.report import peak_temporary_bytes
    from shardfn.partition.spmd.trace import flatten_args, trace
    from shardfn.runtime import data
    from shardfn.runtime.train_step import make_optimizer, make_train_step, precision_policy

    torch.set_num_threads(1)
    programs, states = {}, {}
    for precision, policy in COMBOS:
        cfg = load_config("llama_tiny", [f"model.dim={ns.dim}", f"model.n_layers={ns.layers}",
                                         f"model.ffn_dim={ns.dim * 3}", f"train.seq_len={ns.seq}",
                                         f"train.batch_size={ns.batch}", f"train.precision={precision}"])
        model = models.get(cfg.model_name)
        params = model.init(cfg.model, 0)
        opt = make_optimizer(cfg.train, model)
        batch = data.get_batch(data.from_config(cfg.data), 0, batch_size=ns.batch, seq_len=ns.seq, seed=0)
        step = make_train_step(model, cfg.model, opt, precision=precision_policy(cfg.train))
        args = (params, opt.init(params), batch)
        traced = trace(step, args)
        gm = remat(traced.graph_module, policy)
        programs[(precision, policy)] = (gm, peak_temporary_bytes(gm))
        states[(precision, policy)] = flatten_args(tree_map(lambda x: x.clone(), args))[0]
    times = {k: [] for k in COMBOS}
    measured = {}
    for r in range(ns.rounds + 2):  # the first round warms up, the last measures memory
        for key in COMBOS:
            gm, _ = programs[key]
            leaves = states[key]
            if r == ns.rounds + 1:
                _, measured[key] = peak_rss_increase(lambda: gm(*leaves))
                continue
            tic = time.perf_counter()
            gm(*leaves)
            if r:
                times[key].append(time.perf_counter() - tic)
    base = times[("fp32", "none")]
    rows = []
    for key in COMBOS:
        ratios = [a / b for a, b in zip(times[key], base)]
        row = {"precision": key[0], "remat": key[1], "reported_bytes": programs[key][1],
               "measured_bytes": measured[key], "step_s": statistics.median(times[key]),
               "ratio_to_fp32_none": statistics.median(ratios)}
        row["reported_over_measured"] = row["reported_bytes"] / max(row["measured_bytes"], 1)
        rows.append(row)
        print(f"{key[0]:>4} {key[1]:>9}: reported {row['reported_bytes'] / 2**20:8.1f} MiB, measured "
              f"{row['measured_bytes'] / 2**20:8.1f} MiB ({row['reported_over_measured']:.2f}x), step "
              f"{row['step_s'] * 1e3:7.1f} ms ({row['ratio_to_fp32_none']:.2f}x fp32 none)")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": vars(ns), "torch": torch.__version__, "threads": 1, "results": rows},
                              indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
