"""The partitioner against plain torch, side by side in one run, like for like.

(a) one rank: llama_tiny's train step partitioned on a 1-device mesh and compiled, against plain
    ``torch.compile`` of the same function (target: <= 1.05x);
(b) two gloo ranks, eager against eager: the Llama of ``bench_core``'s size M (dim 256, 4 layers,
    batch 8 x 256) trained by ``shardfn train``'s own step on ``mesh.dp=2`` and ``mesh.fsdp=2``
    (clipping and AdamW included), against the same model as an ``nn.Module`` under torch's
    ``DistributedDataParallel`` and ``fully_shard`` with ``clip_grad_norm_`` and
    ``torch.optim.AdamW`` (foreach), from the same weights (target: <= 1.0x);
    With ``--compute-only``, dp's two sides run again with their all-reduces taken out (shardfn's
    program returns each all-reduce's input, DDP's buckets go through a comm hook that keeps
    them): the ratio of the compute alone, and what the communication costs each side;
(c) lowering time (trace + propagate + collectives) of llama as ``n_layers`` grows 2 -> 32
    (must grow at most linearly);
(d) ``--ab A B``: shardfn's own step under two sets of overrides (each a space-separated list),
    both built in the same 2 gloo processes, alternated (ratio A / B; above 1: B is faster).

Every timed comparison alternates the two sides in pairs (the order flips every pair), feeds each
side its own previous step's outputs, runs one compute thread per process, and reports the
median of the per-pair ratios, so load that comes and goes hits both sides of a pair alike.

    python benchmarks/bench_partition.py [--out benchmarks/results/bench_partition.json] [--quick] [--parts b]
    python benchmarks/bench_partition.py --parts b --layouts fsdp partition.overlap=true
    python benchmarks/bench_partition.py --parts b --layouts dp --compute-only
    python benchmarks/bench_partition.py --layouts dp --ab partition.overlap=false partition.overlap=true
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_core's nn.Module Llama

M = ["model.dim=256", "model.n_layers=4", "train.seq_len=256", "train.batch_size=8"]  # bench_core's size M


def alternated(first, second, pairs: int) -> dict:
    """Time ``first()`` and ``second()`` in ``pairs`` pairs, flipping the order every pair;
    the median of the per-pair ratios first / second, and each side's median."""
    import statistics

    ratios, a_times, b_times = [], [], []
    for i in range(pairs):
        order = (first, second) if i % 2 == 0 else (second, first)
        times = {}
        for fn in order:
            tic = time.perf_counter()
            fn()
            times[fn] = time.perf_counter() - tic
        a_times.append(times[first])
        b_times.append(times[second])
        ratios.append(times[first] / times[second])
    return {"shardfn_s": statistics.median(a_times), "torch_s": statistics.median(b_times),
            "ratio": statistics.median(ratios), "pairs": pairs}


# ----------------------------------------------------------------------------- (a) one rank


def one_rank(pairs: int) -> dict:
    import torch.distributed as dist

    import shardfn as sf
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.partitioned import mesh_step
    from shardfn.runtime.train_step import make_optimizer, make_train_step

    torch.set_num_threads(1)
    cfg = load_config(None, [])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    opt = make_optimizer(cfg.train, model)
    tokens = data.from_config(cfg.data)
    batches = [data.get_batch(tokens, i, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0)
               for i in range(2 * pairs + 3)]
    plain = torch.compile(make_train_step(model, cfg.model, opt))
    ours = mesh_step(cfg, model, opt, params, sf.Mesh({"dp": 1}), backend="inductor")
    sides = {"plain": [params, opt.init(params), 0], "ours": [params, opt.init(params), 0]}

    def stepper(name, fn):
        def run():
            state = sides[name]
            state[0], state[1], metrics = fn(state[0], state[1], batches[state[2]])
            float(metrics["loss"])
            state[2] += 1
        return run

    run_plain, run_ours = stepper("plain", plain), stepper("ours", ours)
    for _ in range(3):  # compile both and let the caches settle
        run_plain()
        run_ours()
    out = alternated(run_ours, run_plain, pairs)
    dist.destroy_process_group()
    return out


# ----------------------------------------------------------------------------- (b) two ranks


def _module_step(cfg, params, layout: str, mesh):
    """The nn.Module side of (b): bench_core's Llama loaded from ``params``, wrapped in DDP
    (``dp``) or ``fully_shard`` per layer and at the root (``fsdp``), with clip_grad_norm_ and
    AdamW (foreach) at the run's hyperparameters and schedule."""
    from bench_core import Llama

    from shardfn.core import optim

    t = cfg.train
    module = Llama(cfg.model).load_functional(params)
    if layout == "dp":
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(module)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in module.layers:
            fully_shard(layer, mesh=mesh.device_mesh)
        fully_shard(module, mesh=mesh.device_mesh)
    opt = torch.optim.AdamW(module.parameters(), lr=t.lr, betas=(t.b1, t.b2), eps=t.eps,
                            weight_decay=t.weight_decay, foreach=True)
    schedule = optim.warmup_cosine(t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
    count = [0]

    def step(batch):
        for group in opt.param_groups:
            group["lr"] = float(schedule(count[0]))
        opt.zero_grad(set_to_none=True)
        logits = module(batch["inputs"])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), t.grad_clip)
        opt.step()
        count[0] += 1
        return loss.detach()

    return step


def _shardfn_side(layout: str, pairs: int, overrides: tuple = ()):
    """``shardfn train``'s step on ``mesh.<layout>=2`` (M, with ``overrides``), and ``run()``,
    which steps it on the next batch from its own previous outputs. Returns ``(run, step, cfg,
    params, batches)``: what the other side of a comparison starts from."""
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.build import build_step

    cfg = load_config("llama_tiny", [*M, f"mesh.{layout}=2", *overrides])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, cfg.train.seed)
    tokens = data.from_config(cfg.data)
    t = cfg.train
    batches = [data.get_batch(tokens, i, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed)
               for i in range(2 * pairs + 3)]
    step = build_step(cfg, model, params)
    state = [*step.place(params), 0]

    def run():
        state[0], state[1], metrics = step(state[0], state[1], batches[state[2]])
        float(metrics["loss"])
        state[2] += 1

    return run, step, cfg, params, batches


def _layout_worker(layout: str, pairs: int, overrides: tuple = (), compute_only: bool = False) -> dict:
    """On each of 2 gloo ranks: ``shardfn train``'s step on ``mesh.<layout>=2`` against the
    nn.Module under DDP / fully_shard, alternated, each fed its own previous outputs. With
    ``compute_only`` (dp), then both again with their all-reduces taken out (``compute_only``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rounds = 2 if compute_only else 1
    run_ours, ours, cfg, params, batches = _shardfn_side(layout, rounds * (pairs + 3), overrides)
    theirs = _module_step(cfg, params, layout, ours.mesh)
    rank, half = dist.get_rank(), cfg.train.batch_size // 2
    seen = [0]

    def run_theirs():
        batch = {k: v[rank * half:(rank + 1) * half] for k, v in batches[seen[0]].items()}
        float(theirs(batch))
        seen[0] += 1

    for _ in range(3):  # the first steps: lowering, allocator warm-up
        run_ours()
        run_theirs()
    out = alternated(run_ours, run_theirs, pairs)
    if compute_only:
        _without_all_reduces(ours, theirs)
        for _ in range(3):
            run_ours()
            run_theirs()
        out["compute_only"] = alternated(run_ours, run_theirs, pairs)
    return out


def _without_all_reduces(ours, theirs) -> None:
    """Both dp sides with their all-reduces taken out (each rank keeps its own gradients): every
    all-reduce of shardfn's per-rank program returns its input, and DDP's buckets go through a
    comm hook that returns them as they are. What is left is each side's compute."""
    from torch.nn.parallel import DistributedDataParallel

    def identity(x, *args):
        return x

    for lowered in ours.jitted.programs():  # the programs this run has lowered
        gm = lowered.graph_module
        for node in gm.graph.nodes:
            if node.target in (torch.ops._c10d_functional.all_reduce.default,
                               torch.ops._c10d_functional.all_reduce_.default):
                node.target = identity
        gm.recompile()
    cells = dict(zip(theirs.__code__.co_freevars, (c.cell_contents for c in theirs.__closure__)))
    module = cells["module"]
    assert isinstance(module, DistributedDataParallel)

    def keep_bucket(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    module.register_comm_hook(None, keep_bucket)


def _ab_worker(layout: str, pairs: int, a: tuple, b: tuple) -> dict:
    """On each of 2 gloo ranks: ``shardfn train``'s step on ``mesh.<layout>=2`` with overrides
    ``a`` against the same with ``b``, alternated, each fed its own previous outputs."""
    torch.set_num_threads(1)
    runs = [_shardfn_side(layout, pairs, overrides)[0] for overrides in (a, b)]
    for _ in range(3):  # the first steps: lowering, allocator warm-up
        for run in runs:
            run()
    out = alternated(runs[0], runs[1], pairs)
    return {"a_s": out["shardfn_s"], "b_s": out["torch_s"], "ratio": out["ratio"], "pairs": pairs}


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
    parser.add_argument("--steps", type=int, default=20, help="alternated pairs per comparison")
    parser.add_argument("--quick", action="store_true", help="fewer steps and layer counts (smoke run)")
    parser.add_argument("--parts", default="a,b,c", help="which comparisons to run (a, b, c: see above)")
    parser.add_argument("--layouts", default="dp,fsdp", help="(b): which layouts, comma-separated")
    parser.add_argument("--ab", nargs=2, metavar=("A", "B"), default=None,
                        help="(d): two sets of overrides for shardfn's step, each space-separated; "
                             "runs only (d)")
    parser.add_argument("--compute-only", action="store_true",
                        help="(b), dp: then both sides again with their all-reduces taken out")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="(b): config overrides for shardfn's side, e.g. partition.overlap=true")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    parts = set(args.parts.split(","))
    from shardfn.runtime.launch import spawn

    result = {}
    if args.ab:
        a, b = (tuple(x.split()) for x in args.ab)
        for layout in args.layouts.split(","):
            r = spawn(_ab_worker, 2, args=(layout, steps, a, b), timeout_s=900)[0]
            result[f"{layout}2_ab"] = {**r, "a": a, "b": b}
            print(f"(d) {layout}2: A / B = {r['ratio']:.3f}x ({r['a_s']*1e3:.1f} ms vs {r['b_s']*1e3:.1f} ms, "
                  f"median of {r['pairs']} alternated pairs; A = {' '.join(a)}, B = {' '.join(b)})")
        parts = set()
    if "a" in parts:
        result["one_rank"] = one_rank(steps)
        print(f"(a) 1 rank   partitioned/plain compile = {result['one_rank']['ratio']:.3f}x  (target <= 1.05)")
    torch_side = {"dp": "DistributedDataParallel", "fsdp": "fully_shard"}
    for layout in (args.layouts.split(",") if "b" in parts else ()):
        compute_only = args.compute_only and layout == "dp"
        r = spawn(_layout_worker, 2, args=(layout, steps, tuple(args.overrides), compute_only), timeout_s=900)[0]
        result[f"{layout}2"] = r
        print(f"(b) {layout}2 vs {torch_side[layout]}: {r['ratio']:.3f}x  ({r['shardfn_s']*1e3:.1f} ms vs "
              f"{r['torch_s']*1e3:.1f} ms, median of {r['pairs']} alternated pairs; target <= 1.0)")
        if compute_only:
            c = r["compute_only"]
            print(f"(b) {layout}2 vs {torch_side[layout]}, all-reduces taken out: {c['ratio']:.3f}x  "
                  f"({c['shardfn_s']*1e3:.1f} ms vs {c['torch_s']*1e3:.1f} ms); the all-reduces cost "
                  f"{(r['shardfn_s'] - c['shardfn_s'])*1e3:.1f} ms vs {(r['torch_s'] - c['torch_s'])*1e3:.1f} ms")
    if "c" in parts:
        counts = [2, 4, 8] if args.quick else [2, 4, 8, 16, 32]
        rows = lowering_times(counts)
        result["lowering"] = rows
        result["lowering_growth"] = rows[-1]["lower_s"] / rows[0]["lower_s"] / (counts[-1] / counts[0])
        for r in rows:
            print(f"(c) {r['n_layers']:>2} layers: lower {r['lower_s']:.2f} s ({r['nodes']} nodes)")
        print(f"(c) time growth / layer growth, {counts[0]}->{counts[-1]}: {result['lowering_growth']:.2f} "
              f"(<= 1: at most linear)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
