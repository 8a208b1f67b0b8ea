"""How much communication this machine can hide at all: compute and a collective at once, no model.

Each of 2 gloo ranks (one compute thread each, as in ``bench_overlap.py``) times, alternated in
each round (the order rotates from round to round):

- ``compute``: a loop of ``[n, n] @ [n, n]`` matmuls;
- ``comm``: a loop of ``all_gather_single`` (all-gather into one tensor) of ``--mib`` MiB per rank (FSDP's collective);
- ``both``: the same collectives issued ``async_op=True`` before the same matmuls, all waited on
  after them: a perfect schedule, with nothing to wait for but the two;
- ``idle`` and ``both_idle``: the same with the matmuls replaced by a sleep as long as they took
  in the warm-up (the control: a rank that does not need the cores while its collectives run).

Exposed communication at best = (both - compute) / comm: the least share of the communication
that any reordering of a program with this much compute and communication can leave exposed
(0 where the machine runs the two side by side, 1 where it runs them one after the other). A
program-level result (``bench_overlap.py``'s ``exposed_after``) cannot beat it. The control's
(both_idle - idle) / comm shows what the same collectives hide behind a rank that leaves the
cores free.

    python benchmarks/bench_overlap_ceiling.py [--rounds 9] [--out benchmarks/results/bench_overlap_ceiling.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _worker(rounds: int, n: int, matmuls: int, mib: float, gathers: int) -> list[dict]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = dist.get_world_size()
    a = torch.randn(n, n)
    shard = torch.randn(int(mib * 2**20) // 4)
    full = torch.empty(shard.numel() * world)

    def compute():
        out = a
        for _ in range(matmuls):
            out = a @ a
        return out

    def comm():
        for _ in range(gathers):
            dist.all_gather_single(full, shard)

    def both():
        works = [dist.all_gather_single(full, shard, async_op=True) for _ in range(gathers)]
        compute()
        for w in works:
            w.wait()

    def timed(fn):
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    timed(compute)
    pause = torch.tensor(timed(compute))
    dist.all_reduce(pause, op=dist.ReduceOp.MAX)   # the same sleep on both ranks

    def idle():
        time.sleep(float(pause))

    def both_idle():
        works = [dist.all_gather_single(full, shard, async_op=True) for _ in range(gathers)]
        idle()
        for w in works:
            w.wait()

    variants = {"compute": compute, "comm": comm, "both": both, "idle": idle, "both_idle": both_idle}
    for fn in variants.values():  # warm up
        timed(fn)
    names, rows = list(variants), []
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        rows.append({v: timed(variants[v]) for v in order})
    return rows


def summarize(rows: list[dict]) -> dict:
    """Medians of the times and of the per-round exposed shares, behind compute and behind a sleep."""
    out = {f"{v}_s": statistics.median(r[v] for r in rows) for v in rows[0]}
    out["exposed_at_best"] = statistics.median((r["both"] - r["compute"]) / r["comm"] for r in rows)
    out["exposed_behind_idle"] = statistics.median((r["both_idle"] - r["idle"]) / r["comm"] for r in rows)
    # the same from the medians of the times: steadier when the compute's time drifts from round to round
    out["exposed_at_best_of_medians"] = (out["both_s"] - out["compute_s"]) / out["comm_s"]
    out["rounds"] = len(rows)
    return out


def main(argv=None) -> dict:
    from shardfn.runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--n", type=int, default=512, help="matmul size")
    ap.add_argument("--matmuls", type=int, default=80)
    ap.add_argument("--mib", type=float, default=8.0, help="all-gather shard per rank, MiB")
    ap.add_argument("--gathers", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_overlap_ceiling.json"))
    args = ap.parse_args(argv)
    per_rank = spawn(_worker, 2, args=(args.rounds, args.n, args.matmuls, args.mib, args.gathers), timeout_s=600)
    result = {"ranks": 2, "threads_per_rank": 1, **{k: v for k, v in vars(args).items() if k != "out"},
              "rank0": summarize(per_rank[0]), "rank1": summarize(per_rank[1]), "raw_rank0": per_rank[0]}
    s = result["rank0"]
    print(f"compute {s['compute_s'] * 1e3:.1f} ms  comm {s['comm_s'] * 1e3:.1f} ms  both {s['both_s'] * 1e3:.1f} ms: "
          f"at best {s['exposed_at_best']:.0%} of the communication exposed behind compute (median of rounds; "
          f"{s['exposed_at_best_of_medians']:.0%} of medians; rank 1 {result['rank1']['exposed_at_best']:.0%}); "
          f"behind a sleep as long: {s['exposed_behind_idle']:.0%} "
          f"(both {s['both_idle_s'] * 1e3:.1f} ms, sleep {s['idle_s'] * 1e3:.1f} ms)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
