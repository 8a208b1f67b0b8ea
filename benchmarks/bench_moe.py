"""Expert parallelism, side by side in one run.

- On 2 and 4 gloo ranks: a moe_tiny train step with experts split over ``ep`` (all-to-all
  dispatch) against replicated experts (every rank holds all experts, plain data parallel);
  with the all-to-all bytes per step and the expert-load imbalance (max / mean tokens per
  expert) of the step.
- On one process: routed-expert compute with one grouped GEMM per projection against a Python
  loop over experts, forward and backward.

    python benchmarks/bench_moe.py [--out benchmarks/results/bench_moe.json] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fixtures import median_seconds  # noqa: E402  (tests/fixtures.py)


def _layout_worker(overrides, steps):
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.partitioned import mesh_from_config, mesh_step
    from shardfn.runtime.train_step import make_optimizer

    cfg = load_config("moe_tiny", ["train.batch_size=16", "train.seq_len=64", *overrides])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    opt = make_optimizer(cfg.train, model)
    state = {"p": params, "s": opt.init(params)}
    step = mesh_step(cfg, model, opt, params, mesh_from_config(cfg), backend=None)
    tokens = data.from_config(cfg.data)
    batch = data.get_batch(tokens, 0, batch_size=16, seq_len=64, seed=0)

    def run():
        state["p"], state["s"], state["m"] = step(state["p"], state["s"], batch)

    seconds = median_seconds(run, steps)
    a2a = [r for r in step.jitted.lower(state["p"], state["s"], batch).comm_report() if r["op"] == "all_to_all"]
    return {"step_s": seconds, "a2a_bytes": sum(r["bytes"] for r in a2a),
            "metrics": {k: float(v) for k, v in state["m"].items()}}


def grouped_vs_loop(n_experts=8, tokens=4096, dim=256, ffn=512, steps=10) -> dict:
    from shardfn.core.grouped_mm import grouped_mm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g, requires_grad=True)
    w1, w3 = (torch.randn(n_experts, dim, ffn, generator=g).requires_grad_() for _ in range(2))
    w2 = torch.randn(n_experts, ffn, dim, generator=g).requires_grad_()
    counts = torch.bincount(torch.randint(0, n_experts, (tokens,), generator=g), minlength=n_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)

    def grouped():
        h = F.silu(grouped_mm(x, w1, offs)) * grouped_mm(x, w3, offs)
        grouped_mm(h, w2, offs).sum().backward()

    def loop():
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start:start + n]
            outs.append((F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e])
            start += n
        torch.cat(outs).sum().backward()

    t_g, t_l = median_seconds(grouped, steps), median_seconds(loop, steps)
    return {"grouped_s": t_g, "loop_s": t_l, "speedup": t_l / t_g}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/bench_moe.json")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from shardfn.runtime.launch import spawn

    result = {}
    for n in (2, 4):
        ep = spawn(_layout_worker, n, args=([f"mesh.ep={n}"], args.steps), timeout_s=900)[0]
        rep = spawn(_layout_worker, n, args=([f"mesh.dp={n}"], args.steps), timeout_s=900)[0]
        result[f"{n}_ranks"] = {"ep": ep, "replicated": rep, "ep_over_replicated": ep["step_s"] / rep["step_s"]}
        load = {k: v for k, v in ep["metrics"].items() if "load" in k or "imbalance" in k}
        print(f"{n} ranks: ep{n} {ep['step_s']*1e3:.1f} ms vs replicated experts {rep['step_s']*1e3:.1f} ms "
              f"-> {ep['step_s'] / rep['step_s']:.2f}x; all-to-all {ep['a2a_bytes']:,} B/step on rank 0; load {load}")
    result["grouped_gemm"] = grouped_vs_loop()
    r = result["grouped_gemm"]
    print(f"grouped GEMM {r['grouped_s']*1e3:.1f} ms vs per-expert loop {r['loop_s']*1e3:.1f} ms -> "
          f"{r['speedup']:.2f}x faster")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
