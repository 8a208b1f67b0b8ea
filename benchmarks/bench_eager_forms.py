"""Grouped-query attention, forward and backward, in its two forms side by side on one thread:

    grouped     scaled_dot_product_attention(q, k, v, enable_gqa=True): the kernel reads each
                key/value head for its group of query heads
    repeated    k, v repeated (repeat_interleave) to the query heads first: the form the
                partitioner traces and shards over heads

at the attention shapes of the eager steps ``bench_core.py --eager-pairs`` times: ``S``
(llama_tiny: batch 16 x 128, 4 heads over 2 key/value heads, head dim 16) and ``M`` (batch 8 x
256, 8 heads over 2, head dim 32). Each pair runs both on the same inputs, in alternating order,
and the result is the median over pairs of the per-pair ratio grouped / repeated, so load that
comes and goes hits both sides of a pair alike. A form that is not at least 3% faster than the
general one is not worth a second path.

``--malloc`` instead times the eager train step of the ``M`` model (dim 256, 4 layers, batch 8 x
256) in fresh processes, alternately with and without ``train_step.retain_freed_memory`` (glibc's
mmap threshold raised to its cap before the first step): the median step time of each process,
and the median over pairs of the ratio with / without.

    python benchmarks/bench_eager_forms.py                 # writes benchmarks/results/bench_eager_forms.json
    python benchmarks/bench_eager_forms.py --pairs 20 --out /tmp/f.json
    python benchmarks/bench_eager_forms.py --malloc --pairs 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SIZES = {"S": dict(b=16, h=4, hkv=2, s=128, d=16), "M": dict(b=8, h=8, hkv=2, s=256, d=32)}


def grouped(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def repeated(q, k, v):
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
                                          is_causal=True)


def forward_backward_seconds(form, q, k, v, dy) -> float:
    """One forward and backward of ``form``, in seconds."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    out = form(*leaves)
    torch.autograd.grad(out, leaves, dy)
    return time.perf_counter() - start


def measure(size: dict, pairs: int) -> dict:
    """Median over ``pairs`` alternated pairs of grouped / repeated seconds, and the medians."""
    g = torch.Generator().manual_seed(0)
    b, h, hkv, s, d = (size[k] for k in ("b", "h", "hkv", "s", "d"))
    q, dy = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    for form in (grouped, repeated):  # warm up
        forward_backward_seconds(form, q, k, v, dy)
    ratios, times = [], {"grouped": [], "repeated": []}
    for i in range(pairs):
        order = (grouped, repeated) if i % 2 == 0 else (repeated, grouped)
        seconds = {form.__name__: forward_backward_seconds(form, q, k, v, dy) for form in order}
        for name, t in seconds.items():
            times[name].append(t)
        ratios.append(seconds["grouped"] / seconds["repeated"])
    return {"shape": size, "pairs": pairs, "ratio_grouped_over_repeated": statistics.median(ratios),
            "median_s": {name: statistics.median(ts) for name, ts in times.items()}}


M_MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=2", "model.ffn_dim=1024",
           "train.batch_size=8", "train.seq_len=256"]


def step_seconds(retain: bool, steps: int = 12) -> float:
    """In this process: the median seconds of eager train steps after two warm-up steps."""
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data, train_step
    from shardfn.runtime.train_step import make_optimizer, make_train_step

    if not retain:
        train_step.retain_freed_memory = lambda: None
    torch.set_num_threads(1)
    cfg = load_config("llama_tiny", M_MODEL)
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    opt = make_optimizer(cfg.train, model)
    step = make_train_step(model, cfg.model, opt)
    state = opt.init(params)
    tokens = data.from_config(cfg.data)
    times = []
    for s in range(steps + 2):
        batch = data.get_batch(tokens, s, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0)
        start = time.perf_counter()
        params, state, metrics = step(params, state, batch)
        float(metrics["loss"])
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def measure_malloc(pairs: int) -> dict:
    """Median over ``pairs`` alternated pairs of fresh processes of the step-time ratio with /
    without the raised threshold."""
    def run(retain: bool) -> float:
        path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        out = subprocess.run([sys.executable, "-c", f"from bench_eager_forms import step_seconds; "
                              f"print(step_seconds({retain}))"], capture_output=True, text=True, check=True, env=env)
        return float(out.stdout.split()[-1])

    ratios, times = [], {"retain": [], "plain": []}
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        seconds = {retain: run(retain) for retain in order}
        times["retain"].append(seconds[True])
        times["plain"].append(seconds[False])
        ratios.append(seconds[True] / seconds[False])
    return {"model": M_MODEL, "pairs": pairs, "ratio_retain_over_plain": statistics.median(ratios),
            "median_step_s": {name: statistics.median(ts) for name, ts in times.items()}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--malloc", action="store_true", help="time the step with and without the raised threshold")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_eager_forms.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.malloc:
        result = {"threads": 1, "torch": torch.__version__, "malloc": measure_malloc(args.pairs)}
    else:
        result = {"threads": 1, "torch": torch.__version__,
                  "attention": {name: measure(size, args.pairs) for name, size in SIZES.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
