"""The partitioner against plain torch, side by side in one run.

(a) one rank: llama_tiny's train step partitioned on a 1-device mesh and compiled, against plain
    ``torch.compile`` of the same function (target: <= 1.05x);
(b) two gloo ranks: a stack of residual SwiGLU blocks trained with our tp2 and fsdp2 layouts,
    against torch's own eager ``parallelize_module`` (Colwise/Rowwise) and ``fully_shard`` on an
    equal ``nn.Module`` (target: <= 1.0x);
(c) lowering time (trace + propagate + collectives) of llama as ``n_layers`` grows 2 -> 32
    (must grow at most linearly).

    python benchmarks/bench_partition.py [--out benchmarks/results/bench_partition.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fixtures import median_seconds  # noqa: E402  (tests/fixtures.py)

D, H, L, B, S = 128, 512, 4, 8, 64  # blocks for (b): hidden, ffn, layers, batch, seq




# ----------------------------------------------------------------------------- (a) one rank


def one_rank(steps: int) -> dict:
    import torch.distributed as dist

    import shardfn as sf
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.partitioned import mesh_step
    from shardfn.runtime.train_step import make_optimizer, make_train_step

    cfg = load_config(None, [])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    opt = make_optimizer(cfg.train, model)
    state = opt.init(params)
    tokens = data.from_config(cfg.data)
    batch = data.get_batch(tokens, 0, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0)
    plain = torch.compile(make_train_step(model, cfg.model, opt))
    mesh = sf.Mesh({"dp": 1})
    ours = mesh_step(cfg, model, opt, params, mesh, backend="inductor")
    out = {
        "plain_compile_s": median_seconds(lambda: plain(params, state, batch), steps),
        "partitioned_s": median_seconds(lambda: ours(params, state, batch), steps),
    }
    out["ratio"] = out["partitioned_s"] / out["plain_compile_s"]
    dist.destroy_process_group()
    return out


# ----------------------------------------------------------------------------- (b) two ranks


def block_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "norm": torch.ones(L, D),
        "w1": torch.randn(L, D, H, generator=g) * D**-0.5,
        "w3": torch.randn(L, D, H, generator=g) * D**-0.5,
        "w2": torch.randn(L, H, D, generator=g) * H**-0.5,
    }


def block_loss(p, x):
    for i in range(L):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * p["norm"][i]
        x = x + (F.silu(h @ p["w1"][i]) * (h @ p["w3"][i])) @ p["w2"][i]
    return x.pow(2).mean()


class Block(torch.nn.Module):
    def __init__(self, p, i):
        super().__init__()
        self.norm = torch.nn.Parameter(p["norm"][i].clone())
        self.w1 = torch.nn.Linear(D, H, bias=False)
        self.w3 = torch.nn.Linear(D, H, bias=False)
        self.w2 = torch.nn.Linear(H, D, bias=False)
        with torch.no_grad():
            self.w1.weight.copy_(p["w1"][i].t())
            self.w3.weight.copy_(p["w3"][i].t())
            self.w2.weight.copy_(p["w2"][i].t())

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.norm
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Stack(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(p, i) for i in range(L))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def _two_rank_worker(layout: str, steps: int) -> dict:
    import shardfn as sf
    from shardfn import P

    p = block_params()
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1))
    lr = 1e-3

    def step(p, x):
        loss, g = torch.func.grad_and_value(block_loss)(p, x)[::-1]
        g = sf.constrain(g, specs)
        return {k: p[k] - lr * g[k] for k in p}, loss

    if layout == "tp2":
        axes, specs, xs, fsdp = (
            {"tp": 2},
            {"norm": P(), "w1": P(None, None, "tp"), "w3": P(None, None, "tp"), "w2": P(None, "tp")},
            P(),
            (),
        )
    else:
        axes, specs, xs, fsdp = (
            {"fsdp": 2},
            {"norm": P(None, "fsdp"), "w1": P(None, "fsdp"), "w3": P(None, "fsdp"), "w2": P(None, None, "fsdp")},
            P("fsdp"),
            (0,),
        )
    mesh = sf.Mesh(axes)
    ours = sf.jit(step, mesh, in_specs=(specs, xs), out_specs=(specs, P()), fsdp_argnums=fsdp, backend="inductor")
    state = {"p": p}

    def run_ours():
        state["p"], loss = ours(state["p"], x)

    t_ours = median_seconds(run_ours, steps)

    model = Stack(p)
    dmesh = mesh.device_mesh
    if layout == "tp2":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for blk in model.blocks:
            parallelize_module(blk, dmesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
        x_in = x
    else:
        from torch.distributed.fsdp import fully_shard

        for blk in model.blocks:
            fully_shard(blk, mesh=dmesh)
        fully_shard(model, mesh=dmesh)
        x_in = x.chunk(2)[mesh.rank]
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run_torch():
        opt.zero_grad(set_to_none=True)
        model(x_in).backward()
        opt.step()

    t_torch = median_seconds(run_torch, steps)
    return {"shardfn_s": t_ours, "torch_eager_s": t_torch, "ratio": t_ours / t_torch}


# ----------------------------------------------------------------------------- (c) lowering


def lowering_times(layer_counts) -> list[dict]:
    import torch.distributed as dist

    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.partitioned import mesh_from_config, mesh_step
    from shardfn.runtime.train_step import make_optimizer

    rows = []
    for n in layer_counts:
        cfg = load_config(None, [f"model.n_layers={n}", "mesh.fsdp=2", "mesh.tp=2"])
        model = models.get(cfg.model_name)
        params = model.init(cfg.model, 0)
        opt = make_optimizer(cfg.train, model)
        state = opt.init(params)
        batch = data.get_batch(data.from_config(cfg.data), 0, batch_size=8, seq_len=32, seed=0)
        mesh = mesh_from_config(cfg, fake=True)
        step = mesh_step(cfg, model, opt, params, mesh, backend=None)
        t = time.perf_counter()
        lowered = step.jitted.lower(params, state, batch)
        rows.append({"n_layers": n, "lower_s": time.perf_counter() - t,
                     "nodes": len(lowered.traced.graph_module.graph.nodes)})
        dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/bench_partition.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="fewer steps and layer counts (smoke run)")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    from shardfn.runtime.launch import spawn

    result = {"one_rank": one_rank(steps)}
    print(f"(a) 1 rank   partitioned/plain compile = {result['one_rank']['ratio']:.3f}x  (target <= 1.05)")
    for layout in ("tp2", "fsdp2"):
        r = spawn(_two_rank_worker, 2, args=(layout, steps), timeout_s=900)[0]
        result[layout] = r
        print(f"(b) {layout:<6}  shardfn/torch eager = {r['ratio']:.3f}x  ({r['shardfn_s']*1e3:.1f} ms vs "
              f"{r['torch_eager_s']*1e3:.1f} ms; target <= 1.0)")
    counts = [2, 4, 8] if args.quick else [2, 4, 8, 16, 32]
    rows = lowering_times(counts)
    result["lowering"] = rows
    result["lowering_growth"] = rows[-1]["lower_s"] / rows[0]["lower_s"] / (counts[-1] / counts[0])
    for r in rows:
        print(f"(c) {r['n_layers']:>2} layers: lower {r['lower_s']:.2f} s ({r['nodes']} nodes)")
    print(f"(c) time growth / layer growth, {counts[0]}->{counts[-1]}: {result['lowering_growth']:.2f} (<= 1: at most "
          f"linear)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
