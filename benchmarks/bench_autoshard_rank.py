"""Does the auto-sharder's estimate order layouts as their measured step times do?

On 4 gloo ranks (``dp=2 x tp=2``, one compute thread each), a Llama train step (AdamW, clipping;
dim 256, 2 layers, batch 8 x 128 by default) is planned five ways: the auto-sharder's own plan
and the dp, fsdp, tp and fsdp_tp presets (each the ILP's optimum with the preset's input specs
fixed). Every plan is lowered as planned (``jit_auto``: the collectives are the estimate's) and
run eagerly; the layouts take turns step by step in a rotating order, each step between two
barriers, and each layout's time is the median over the rounds.

The estimates come from two hardware profiles: the packaged ``cpu`` profile (rough figures) and
one measured here first: one thread's matmul FLOP/s, its memory bandwidth, and gloo's all-reduce
time over 2 ranks fitted to ``latency + bytes / bandwidth``. The report gives each layout's
estimated and measured time, both orders, and Kendall's tau between them (1: the same order).

    python benchmarks/bench_autoshard_rank.py [--rounds 9] [--out benchmarks/results/bench_autoshard_rank.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fixtures import median_seconds  # noqa: E402  (tests/fixtures.py)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_autoshard_rank.json"
SIZE = ["model.dim=256", "model.n_layers=2", "train.seq_len=128", "train.batch_size=8"]
MESH = {"dp": 2, "tp": 2}


def measure_compute() -> dict:
    """One thread's fp32 matmul FLOP/s and memory bandwidth (bytes read + written per second)."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    x = torch.randn(16 * 2**20 // 4)
    y = torch.empty_like(x)

    flops = 2 * 512**3 / median_seconds(lambda: torch.mm(a, b), 7, warmup=1)
    bandwidth = 2 * x.numel() * 4 / median_seconds(lambda: torch.add(x, 1.0, out=y), 7, warmup=1)
    return {"flops": flops, "bandwidth": bandwidth}


def fit_link(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of a 2-rank all-reduce, whose ring time is
    ``bytes / bandwidth + 2 * latency``: the latency from the smallest message, the bandwidth
    from the least-squares slope over all of them."""
    xs, ys = [b for b, _ in samples], [t for _, t in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return min(samples)[1] / 2, 1.0 / max(slope, 1e-15)


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two lists of scores of the same items."""
    pairs = concordant = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            pairs += 1
            concordant += 1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1
    return concordant / pairs if pairs else 1.0


def _train_step(overrides):
    from shardfn.config import load_config
    from shardfn.models import get
    from shardfn.runtime.train_step import make_optimizer, make_train_step

    cfg = load_config("llama_tiny", overrides)
    model = get(cfg.model_name)
    params = model.init(cfg.model, 0)
    opt = make_optimizer(cfg.train, model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    args = (params, opt.init(params), batch)
    return make_train_step(model, cfg.model, opt), args, model.param_axes(cfg.model)


def _link_samples() -> list[tuple[int, float]]:
    """All-reduce times over the ranks (run on 2), median of 9 per size."""
    import torch.distributed as dist

    samples = []
    for size in (2**10, 2**14, 2**17, 2**19, 2**21, 2**22):
        t = torch.zeros(size // 4)
        times = []
        for _ in range(10):
            dist.barrier()
            tic = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - tic)
        samples.append((size, statistics.median(times[1:])))
    return samples


def _worker(overrides, rounds: int, hardware: dict):
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.partition import auto
    from shardfn.partition.api import jit_auto
    from shardfn.partition.cost.hardware import Hardware, load_hardware
    from shardfn.runtime.launch import progress

    torch.set_num_threads(1)
    mesh = sf.Mesh(MESH)
    step, args, axes = _train_step(overrides)
    profiles = {"cpu": load_hardware("cpu")}
    if hardware:
        profiles["measured"] = Hardware.from_dict(hardware)
    names = ("params", "opt_state", "batch")
    layouts = {"auto": None, **auto.presets(mesh, args, axes)}
    runs, estimates, failed, done = {}, {}, {}, 0
    for profile, hw in profiles.items():
        for name, fixed in layouts.items():
            try:
                lowered, result = jit_auto(step, mesh, args, fixed_specs=fixed, hardware=hw,
                                           memory_budget=math.inf, arg_names=names)
                lowered(*args, backend=None)  # one untimed step
            except Exception as e:  # a plan the partitioner cannot lower: reported, not timed
                failed[f"{profile}/{name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                continue
            c = result.cost
            estimates[f"{profile}/{name}"] = {"step_s": c.step_s, "compute_s": c.compute_s, "comm_s": c.comm_s,
                                              "reshard_s": c.reshard_s, "collectives": result.collectives()}
            runs[f"{profile}/{name}"] = lowered
            done += 1
            progress(done)
    order = list(runs)
    times = {k: [] for k in order}
    for r in range(rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            dist.barrier()
            tic = time.perf_counter()
            runs[k](*args, backend=None)
            dist.barrier()
            times[k].append(time.perf_counter() - tic)
        done += 1
        progress(done)
    return {"estimates": estimates, "times": times, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args()

    from shardfn.partition.cost.hardware import load_hardware
    from shardfn.runtime.launch import spawn

    compute = measure_compute()
    probe = spawn(_link_samples, 2, timeout_s=300)[0]
    latency, bandwidth = fit_link(probe)
    measured = {**vars(load_hardware("cpu")), "name": "measured",
                "peak_flops_fp32": compute["flops"], "peak_flops_bf16": compute["flops"],
                "hbm_bandwidth": compute["bandwidth"], "intra_node_bandwidth": bandwidth,
                "intra_node_latency": latency, "gpus_per_node": 4}
    print(f"this machine, one thread: {compute['flops'] / 1e9:.1f} GFLOP/s fp32 matmul, "
          f"{compute['bandwidth'] / 1e9:.1f} GB/s memory; gloo 2-rank all-reduce: "
          f"{latency * 1e6:.0f} us latency, {bandwidth / 1e9:.2f} GB/s")
    out = spawn(_worker, 4, args=(SIZE, a.rounds, measured), timeout_s=900)[0]
    report = {"benchmark": "bench_autoshard_rank", "size": SIZE, "mesh": MESH, "rounds": a.rounds,
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "cpus": os.cpu_count()},
              "measured_profile": measured, "link_samples": probe, "profiles": {}}
    for profile in ("cpu", "measured"):
        keys = [k for k in out["estimates"] if k.startswith(profile + "/")]
        layouts = [k.split("/", 1)[1] for k in keys]
        est = [out["estimates"][k]["step_s"] for k in keys]
        got = [statistics.median(out["times"][k]) for k in keys]
        tau = kendall_tau(est, got)
        report["profiles"][profile] = {
            "layouts": {n: {**out["estimates"][k], "measured_s": m} for n, k, m in zip(layouts, keys, got)},
            "estimated_order": [n for _, n in sorted(zip(est, layouts))],
            "measured_order": [n for _, n in sorted(zip(got, layouts))],
            "kendall_tau": tau,
        }
        print(f"\n{profile} profile: Kendall tau {tau:+.2f}")
        print(f"{'layout':<9} {'estimate':>10} {'compute':>9} {'comm':>9} {'reshard':>9} {'measured':>10}")
        for n, k, m in zip(layouts, keys, got):
            e = out["estimates"][k]
            print(f"{n:<9} {e['step_s'] * 1e3:>8.2f}ms {e['compute_s'] * 1e3:>7.2f}ms {e['comm_s'] * 1e3:>7.2f}ms "
                  f"{e['reshard_s'] * 1e3:>7.2f}ms {m * 1e3:>8.1f}ms")
        print("estimated order:", " < ".join(report["profiles"][profile]["estimated_order"]))
        print("measured order: ", " < ".join(report["profiles"][profile]["measured_order"]))
        for k, why in out["failed"].items():
            if k.startswith(profile + "/"):
                print(f"not lowered: {k.split('/', 1)[1]}: {why}")
    report["not_lowered"] = out["failed"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
