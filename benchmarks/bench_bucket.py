"""Gradient bucketing: a run config's partitioned train step with and without buckets, side by side.

On 2 gloo ranks (CPU), each rank builds the same step twice, ``partition.bucket_bytes=0`` (one
collective per gradient) and the default 25 MiB, runs both on the same batch in alternated A/B
pairs, and takes the median of the per-pair ratios bucketed / unbucketed, next to each step's
collective counts and bytes (bytes must be equal).

    python benchmarks/bench_bucket.py                     # llama_tiny, mesh.dp=2 and mesh.fsdp=2
    python benchmarks/bench_bucket.py --pairs 10 --config llama_tiny
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_bucket.json"
MESHES = (["mesh.dp=2"], ["mesh.fsdp=2"])
BASE = ["train.batch_size=8", "train.seq_len=64", "train.warmup_steps=1"]


def _counts(rows) -> dict:
    return {f"{r['op']}[{r['axis']}]": [r["count"], r["bytes"]] for r in rows}


def _worker(config: str, mesh_overrides: list, pairs: int) -> dict:
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.partitioned import mesh_from_config, mesh_step
    from shardfn.runtime.train_step import make_optimizer

    steps = {}
    for name, bucket in (("plain", "0"), ("bucketed", "25MiB")):
        cfg = load_config(config, BASE + mesh_overrides + [f"partition.bucket_bytes={bucket}"])
        model = models.get(cfg.model_name)
        params = model.init(cfg.model, cfg.train.seed)
        opt = make_optimizer(cfg.train, model)
        step = mesh_step(cfg, model, opt, params, mesh_from_config(cfg) if not steps else steps["plain"][0].mesh,
                         backend=None)
        batch = data.get_batch(data.from_config(cfg.data), 0, batch_size=cfg.train.batch_size,
                               seq_len=cfg.train.seq_len, seed=cfg.train.seed)
        placed = step.place(params)
        state = list(step(*placed, batch)[:2])  # lowers, runs once
        steps[name] = (step, state, batch)

    def run(name):
        step, state, batch = steps[name]
        torch.distributed.barrier()
        t = time.perf_counter()
        state[:] = step(*state, batch)[:2]
        return time.perf_counter() - t

    ratios = []
    for i in range(pairs):
        order = ("plain", "bucketed") if i % 2 == 0 else ("bucketed", "plain")
        seconds = {name: run(name) for name in order}
        ratios.append(seconds["bucketed"] / seconds["plain"])
    return {"median_ratio_bucketed_over_plain": statistics.median(ratios), "ratios": ratios,
            "comm_plain": _counts(steps["plain"][0].comm_report()),
            "comm_bucketed": _counts(steps["bucketed"][0].comm_report())}


def main(argv=None) -> None:
    from shardfn.runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama_tiny")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    results = {}
    for mesh in MESHES:
        rank0 = spawn(_worker, 2, args=(args.config, mesh, args.pairs), timeout_s=900)[0]
        results[" ".join(mesh)] = rank0
        ratio = rank0["median_ratio_bucketed_over_plain"]
        print(f"{args.config} {' '.join(mesh)}: bucketed/plain step time {ratio:.3f}"
              f" (median of {args.pairs} pairs); collectives plain {rank0['comm_plain']}, "
              f"bucketed {rank0['comm_bucketed']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": args.config, "base": BASE, "pairs": args.pairs,
                                    "torch": torch.__version__, "machine": platform.machine(),
                                    "results": results}, indent=2))


if __name__ == "__main__":
    main()
