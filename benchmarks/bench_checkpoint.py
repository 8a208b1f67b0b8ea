"""Checkpoint save and load throughput: the full training state of moe_tiny, DCP vs torch.save.

The state is moe_tiny's params and AdamW state after one real optimizer step (every leaf
nonzero), with the step, data position and CPU RNG state: exactly what ``save_checkpoint``
writes. Measured side by side in one run, each a few times (median reported):

    torch.save / torch.load     the same flat state dict (``checkpoint.state_dict``) to one file in
                                a temp dir, fsync'd (DCP fsyncs its files too), on one rank
    dcp, 1 rank                 ``save_checkpoint`` / ``load_checkpoint`` with plain tensors
    dcp, 4 ranks <mesh>         the same on 4 gloo ranks (``runtime.launch.spawn``), the state as
                                DTensors of the mesh's layout: every rank writes and reads only its
                                own shards; time is the slowest rank's, between barriers

Bytes are the state's logical size (every tensor counted once, whatever the mesh); bytes/s is that
over the median seconds, and the ratio is against torch.save (saves) or torch.load (loads), so
above 1 means faster than torch. Each save goes to a fresh directory (no pruning) and the loads read
it back, from the page cache: this measures the checkpoint code path, not the disk. The state is
small (~3 MB), so per-call overhead (planning, metadata, barriers) dominates; on a machine with
fewer cores than ranks the 4-rank cases also wait on each other for CPU.

    python benchmarks/bench_checkpoint.py                  # writes benchmarks/results/bench_checkpoint.json
    python benchmarks/bench_checkpoint.py --repeats 3 --meshes mesh.dp=2,mesh.ep=2 --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from shardfn.core.pytree import tree_leaves
from shardfn.runtime import checkpoint as ck
from shardfn.runtime.launch import spawn
from shardfn.runtime.train_step import make_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fixtures import trained_state  # noqa: E402  (tests/fixtures.py)

CONFIG = "moe_tiny"
SMALL = ["train.batch_size=4", "train.seq_len=16", "train.warmup_steps=2"]
MESHES = ("mesh.dp=2,mesh.ep=2", "mesh.fsdp=4")
NPROC = 4
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_checkpoint.json"


# ----------------------------------------------------------------------------- the state


def training_state(overrides=()):
    """``(cfg, model, params, opt_state)`` of moe_tiny after one optimizer step."""
    return trained_state(CONFIG, [*SMALL, *overrides], steps=1)


def state_bytes(params, opt_state) -> int:
    sd = ck.state_dict(1, params, opt_state, rng_state=torch.get_rng_state())
    return sum(t.numel() * t.element_size() for t in sd.values())


def fresh_like(cfg, model):
    """Other values, same shapes: what a load fills."""
    params = model.init(cfg.model, cfg.train.seed + 1)
    return params, make_optimizer(cfg.train, model).init(params)


# ----------------------------------------------------------------------------- one rank


def time_torch(params, opt_state, root: Path, repeats: int) -> dict:
    """torch.save (fsync'd) and torch.load(weights_only=True) of the flat state dict."""
    sd = ck.state_dict(1, params, opt_state, rng_state=torch.get_rng_state())
    save, load = [], []
    for i in range(repeats + 1):  # the first round is a warm-up
        path = root / f"torch_{i}.pt"
        tic = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        mid = time.perf_counter()
        back = torch.load(path, weights_only=True)
        done = time.perf_counter()
        assert torch.equal(back["params.embed"], sd["params.embed"])
        if i:
            save.append(mid - tic)
            load.append(done - mid)
    return {"save_s": save, "load_s": load, "file_bytes": (root / "torch_0.pt").stat().st_size}


def time_dcp(params, opt_state, like, root: Path, repeats: int) -> dict:
    """save_checkpoint / load_checkpoint with plain tensors, in this process (no process group)."""
    save, load = [], []
    for i in range(repeats + 1):
        tic = time.perf_counter()
        path = ck.save_checkpoint(root / f"dcp1_{i}", 1, params, opt_state, keep=1)
        mid = time.perf_counter()
        loaded = ck.load_checkpoint(path, *like)
        done = time.perf_counter()
        assert torch.equal(loaded.params["embed"], params["embed"])
        if i:
            save.append(mid - tic)
            load.append(done - mid)
    files = sum(p.stat().st_size for p in path.iterdir())
    return {"save_s": save, "load_s": load, "file_bytes": files}


# ----------------------------------------------------------------------------- N gloo ranks


def _rank_worker(overrides: list[str], root: str, repeats: int) -> dict:
    """One rank: the state as DTensors of the mesh's layout; save and load, timed between barriers."""
    import torch.distributed as dist

    from shardfn.runtime.partitioned import layout, mesh_from_config

    cfg, model, params, state = training_state(overrides)
    mesh = mesh_from_config(cfg)
    specs = layout(cfg, model, params, state, mesh)
    p = ck.distribute(params, specs["params"], mesh)
    s = ck.distribute(state, specs["opt_state"], mesh)
    like_p, like_s = fresh_like(cfg, model)
    like = (ck.distribute(like_p, specs["params"], mesh), ck.distribute(like_s, specs["opt_state"], mesh))
    save, load = [], []
    for i in range(repeats + 1):
        dist.barrier()
        tic = time.perf_counter()
        path = ck.save_checkpoint(Path(root) / f"dcp{dist.get_world_size()}_{i}", 1, p, s, keep=1)
        mid = time.perf_counter()
        dist.barrier()
        mid2 = time.perf_counter()
        loaded = ck.load_checkpoint(path, *like)
        dist.barrier()
        done = time.perf_counter()
        assert torch.equal(loaded.params["embed"].to_local(), p["embed"].to_local())
        if i:
            save.append(mid - tic)
            load.append(done - mid2)
    files = sum(f.stat().st_size for f in path.iterdir())
    return {"save_s": save, "load_s": load, "file_bytes": files, "bytes": state_bytes(params, state),
            "placements": sorted({str(tuple(x.placements)) for x in tree_leaves(p)})}


def time_mesh(mesh: str, root: Path, repeats: int) -> dict:
    overrides = mesh.split(",")
    out = spawn(_rank_worker, NPROC, args=(overrides, str(root), repeats), timeout_s=300)
    slowest = lambda key: [max(r[key][i] for r in out) for i in range(repeats)]  # noqa: E731
    return {"save_s": slowest("save_s"), "load_s": slowest("load_s"), "file_bytes": out[0]["file_bytes"],
            "bytes": out[0]["bytes"], "placements": out[0]["placements"]}


# ----------------------------------------------------------------------------- report


def summarize(raw: dict, nbytes: int) -> dict:
    out = {"bytes": nbytes, "file_bytes": raw["file_bytes"]}
    for op in ("save", "load"):
        med = statistics.median(raw[f"{op}_s"])
        out[op] = {"median_s": med, "bytes_per_s": nbytes / med, "all_s": [round(t, 6) for t in raw[f"{op}_s"]]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per case (after one warm-up)")
    parser.add_argument("--meshes", nargs="*", default=list(MESHES),
                        help=f"{NPROC}-rank meshes, each comma-separated overrides (default: {' '.join(MESHES)})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tic = time.perf_counter()

    cfg, model, params, state = training_state()
    nbytes = state_bytes(params, state)
    like = fresh_like(cfg, model)
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    try:
        cases = {"torch.save/load (1 rank)": summarize(time_torch(params, state, root, args.repeats), nbytes),
                 "dcp (1 rank)": summarize(time_dcp(params, state, like, root, args.repeats), nbytes)}
        placements = {}
        for mesh in args.meshes:
            raw = time_mesh(mesh, root, args.repeats)
            assert raw["bytes"] == nbytes, (raw["bytes"], nbytes)
            cases[f"dcp ({NPROC} ranks {mesh})"] = summarize(raw, nbytes)
            placements[mesh] = raw["placements"]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    base = cases["torch.save/load (1 rank)"]
    for c in cases.values():
        for op in ("save", "load"):
            c[op]["ratio_vs_torch"] = base[op]["median_s"] / c[op]["median_s"]

    print(f"{CONFIG}: params + optimizer state, {len(tree_leaves((params, state)))} tensors, {nbytes} bytes; "
          f"median of {args.repeats}")
    print(f"{'case':<34} {'op':<5} {'bytes':>9} {'seconds':>9} {'MB/s':>9} {'vs torch':>9}")
    for name, c in cases.items():
        for op in ("save", "load"):
            r = c[op]
            print(f"{name:<34} {op:<5} {nbytes:>9} {r['median_s']:>9.4f} {r['bytes_per_s'] / 1e6:>9.1f} "
                  f"{r['ratio_vs_torch']:>8.2f}x")
    wall = time.perf_counter() - tic
    result = {
        "benchmark": f"checkpoint save/load {CONFIG}", "config": CONFIG, "overrides": SMALL,
        "state_bytes": nbytes, "repeats": args.repeats, "nproc": NPROC, "cases": cases,
        "mesh_placements": placements, "wall_s": round(wall, 2),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"total {wall:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
