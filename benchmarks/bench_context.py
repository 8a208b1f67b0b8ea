"""Context parallelism and sequence parallelism against one device and tensor parallelism: step
time and peak activation bytes per rank (``memory_report``) of a Llama train step on a long sequence.

    python benchmarks/bench_context.py                       # dim 256, 4 layers, seq 4096, 2 ranks
    python benchmarks/bench_context.py --seq 1024 --steps 3  # smaller, for a busy machine

Layouts: ``one`` (one rank, the whole sequence), ``cp2`` (the sequence split over 2 ranks),
``tp2`` (Megatron tensor parallelism over 2 ranks: the residual stream whole on each rank),
``tp2_sp`` (the same with sequence parallelism: the stream split over the sequence). Each layout
runs in its own gloo process group, one after the other (not alternated pairs: the layouts need
different process groups), and the step time is the median of ``--steps`` timed steps after one
warm-up step. Writes ``benchmarks/results/bench_context.json`` and prints one line per layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def overrides(args) -> list[str]:
    return ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=1024",
            f"train.seq_len={args.seq}", f"train.batch_size={args.batch}", "train.warmup_steps=1"]


def worker(layout: list[str], base: list[str], steps: int) -> dict:
    import torch

    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.build import build_step

    cfg = load_config("llama_tiny", base + layout)
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, cfg.train.seed)
    step = build_step(cfg, model, params)
    params, state = step.place(params)
    tokens = data.from_config(cfg.data)
    batch = data.get_batch(tokens, 0, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len)
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        params, state, metrics = step(params, state, batch)
        if i:
            times.append(time.perf_counter() - t)
    memory = step.memory_report() if step.memory_report is not None else None
    return {"step_s": statistics.median(times), "loss": float(torch.as_tensor(metrics["loss"])),
            "activations": memory["activations"] if memory else None}


def one_device(base: list[str], steps: int) -> dict:
    """The one-device step, and its activation bytes as the partitioner counts them (a mesh of one)."""
    import shardfn as sf
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.partitioned import mesh_step
    from shardfn.runtime.train_step import make_optimizer

    out = worker([], base, steps)
    cfg = load_config("llama_tiny", base)
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0, device="meta")
    opt = make_optimizer(cfg.train, model)
    step = mesh_step(cfg, model, opt, params, sf.Mesh({"dp": 1}, fake=True), backend=None)
    tokens = data.from_config(cfg.data)
    batch = data.get_batch(tokens, 0, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len)
    import torch

    params = model.init(cfg.model, 0)
    with torch.no_grad():
        out["activations"] = step.jitted.lower(params, opt.init(params), batch).memory_report()["activations"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from shardfn.runtime.launch import spawn

    base = overrides(args)
    results = {"one": one_device(base, args.steps)}
    for name, layout in (("cp2", ["mesh.cp=2"]), ("tp2", ["mesh.tp=2"]),
                         ("tp2_sp", ["mesh.tp=2", "partition.sequence_parallel=true"])):
        results[name] = spawn(worker, 2, args=(layout, base, args.steps), timeout_s=3600)[0]
    for name, r in results.items():
        r["step_ratio_vs_one"] = r["step_s"] / results["one"]["step_s"]
        r["activation_ratio_vs_one"] = r["activations"] / results["one"]["activations"]
        print(f"{name:6s} step {r['step_s']:.3f} s ({r['step_ratio_vs_one']:.2f}x one)  activations/rank "
              f"{r['activations'] / 2**20:.1f} MiB ({r['activation_ratio_vs_one']:.2f}x one)  loss {r['loss']:.5f}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results", "bench_context.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
