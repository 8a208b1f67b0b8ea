"""Exposed communication, before and after overlap, side by side in one run.

Per layout (``fsdp2`` and ``ep2`` of a moe model of dim 256, 4 layers, on 2 gloo ranks with one
compute thread each) the step's per-rank program is timed in three variants, alternated in each
pair of measurements (the order rotates from pair to pair), on the same inputs every call:

- ``before``: the program as the partitioner lowers it, every collective waited on at once, and
  (ep2) the MoE layer's shared experts computed after the routed ones;
- ``after``: ``partition.overlap`` on (``partition/passes/overlap.py``), and (ep2) the shared experts
  handed to the expert exchange, computed while its dispatch is in flight;
- ``after_chunked`` (ep2): ``after`` with ``partition.ep_chunks=2``: the tokens exchanged in two
  groups, one group's all-to-all in flight while the experts run on the other's;
- ``compute``: the ``before`` program with every collective replaced by the result it gave in
  one real run (a buffer; the MoE exchange's all-to-alls copy what they received then), so only
  its compute runs, on the same values as the real step.

``before`` waits on every collective where it is issued, so its communication is all exposed:
communication time = before - compute. Exposed communication of ``after`` = (after - compute) /
(before - compute), per pair, median over pairs (1.0 means nothing hidden, 0.0 all of it), and
the same from the medians of the times.

    python benchmarks/bench_overlap.py [--pairs 7] [--backend inductor] [--out benchmarks/results/bench_overlap.json]

With ``--backend inductor`` each program is compiled, and a fourth variant, ``inductor_reorder``,
is the ``before`` program compiled with inductor's own ``reorder_for_compute_comm_overlap``.

``pp2_dualpipev`` (the same model on 2 pipeline ranks, DualPipeV, 4 microbatches) is timed as a
whole pipeline step, whose communication is the P2P messages between its stages: ``before``
waits on each receive where the schedule posts it, ``after`` where its tensor is read (the
executor's default). It reports both step times and, per rank, the time blocked on P2P (posting
and waiting; pipeline idling is in it too, so there is no compute-only variant).
``pp2_ep2_dualpipev`` (4 ranks) adds expert parallelism inside each stage, and ``ep2_dualpipev``
(2 ranks) runs DualPipeV's V on one pipeline rank with ep2: there ``after`` runs each overlapped
pair one member after the other (the default), and ``after_paired`` lets the members take turns
at their MoE exchange waits (``pipeline.overlap_pairs``, ``runtime.interleave``).

    python benchmarks/bench_overlap.py --layouts pp2_dualpipev --pairs 15
    python benchmarks/bench_overlap.py --layouts ep2_dualpipev --pairs 21 \
        --out benchmarks/results/bench_overlap_pairs.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fixtures import shared_experts_outside_exchange  # noqa: E402  (tests/fixtures.py)

MODEL = ["model.dim=256", "model.n_layers=4", "train.batch_size=8", "train.seq_len=128"]
LAYOUTS = {"fsdp2": ["mesh.fsdp=2"], "ep2": ["mesh.ep=2"],
           # gradients reduced one collective each (no bucket): each can start when its gradient is made
           "fsdp2_unbucketed": ["mesh.fsdp=2", "partition.bucket_bytes=0"],
           "ep2_unbucketed": ["mesh.ep=2", "partition.bucket_bytes=0"],
           # DualPipeV on 2 pipeline ranks, each holding two stages (timed as a whole step, see _pipeline)
           "pp2_dualpipev": ["mesh.pp=2", "pipeline.schedule=dualpipev", "pipeline.microbatches=4"],
           # the same with expert parallelism inside each stage (4 ranks): the pairs' MoE all-to-alls
           "pp2_ep2_dualpipev": ["mesh.pp=2", "mesh.ep=2", "pipeline.schedule=dualpipev", "pipeline.microbatches=4"],
           # DualPipeV's V on one pipeline rank (both chunks local, 6 overlapped pairs a step) with ep2: 2 ranks
           "ep2_dualpipev": ["mesh.ep=2", "pipeline.schedule=dualpipev", "pipeline.microbatches=4"]}


class _Recorder(torch.fx.Interpreter):
    """Runs a per-rank program and keeps each collective's result (what its wait returns)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.results: dict[str, torch.Tensor] = {}

    def run_node(self, n):
        out = super().run_node(n)
        target = n.target
        if n.op == "call_function" and getattr(target, "namespace", None) == "_c10d_functional" \
                and target._opname == "wait_tensor":
            self.results[n.args[0].name] = out.clone()
        return out


def compute_only(gm: torch.fx.GraphModule, local: list) -> torch.fx.GraphModule:
    """A copy of the per-rank program ``gm`` whose collectives are replaced by the results they
    gave in one real run on ``local`` (buffers read in place: no communication, no copy), so
    every later op computes on the same values as the real step."""
    recorder = _Recorder(gm)
    recorder.run(*local)
    gm = copy.deepcopy(gm)
    graph = gm.graph
    for i, node in enumerate(list(graph.nodes)):
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional" \
                or target._opname == "wait_tensor":
            continue
        name = f"_collective_result_{i}"
        gm.register_buffer(name, recorder.results[node.name])
        with graph.inserting_before(node):
            value = graph.get_attr(name)
        for wait in list(node.users):
            wait.replace_all_uses_with(value)
            graph.erase_node(wait)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


class _ReplayedExchange:
    """``torch.distributed`` for the MoE exchange: ``record`` keeps what each all-to-all
    received; ``replay`` hands the same back in order, with no communication."""

    def __init__(self, dist):
        self._dist = dist
        self.received: list[torch.Tensor] = []
        self.mode, self._next = "record", 0

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def start(self, mode: str) -> None:
        self.mode, self._next = mode, 0

    def all_to_all_single(self, out, x, out_splits=None, in_splits=None, group=None, async_op=False):
        if self.mode == "replay":
            out.copy_(self.received[self._next])
            self._next += 1
            return _Done() if async_op else None
        work = self._dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        self.received.append(out.clone())
        return _Done() if async_op else work


class _Done:
    def wait(self):
        return True


def _step_program(cfg_overrides, old_moe_order: bool):
    """``(run, records)``: ``run()`` calls the lowered per-rank program of the config on fixed
    inputs; ``records`` the MoE exchanges it owns (reset before each call)."""
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.partitioned import mesh_from_config, mesh_step
    from shardfn.runtime.train_step import make_optimizer

    cfg = load_config("moe_tiny", [*MODEL, *cfg_overrides])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    opt = make_optimizer(cfg.train, model)
    undo = shared_experts_outside_exchange() if old_moe_order else (lambda: None)
    try:
        mesh = mesh_from_config(cfg)
        step = mesh_step(cfg, model, opt, params, mesh, backend=None)
        placed, state = step.place(params)
        batch = data.get_batch(data.from_config(cfg.data), 0, batch_size=cfg.train.batch_size,
                               seq_len=cfg.train.seq_len, seed=0)
        lowered = step.jitted.lower(placed, state, batch)
    finally:
        undo()
    return lowered.graph_module, lowered.local_inputs(placed, state, batch), lowered.records


def _timed(gm, local, records, exchange=None, mode="replay") -> float:
    """Seconds of one call of ``gm`` on ``local``, the ranks started together; with
    ``exchange``, the MoE all-to-alls go through it (``mode``: record or replay)."""
    import torch.distributed as dist

    from shardfn.runtime import moe_dispatch

    for r in records:
        r.reset()
    dist.barrier()
    real = moe_dispatch.dist
    if exchange is not None:
        exchange.start(mode)
        moe_dispatch.dist = exchange
    try:
        t = time.perf_counter()
        gm(*local)
        return time.perf_counter() - t
    finally:
        moe_dispatch.dist = real


def _compiled(gm, backend, **inductor_config):
    """``gm`` compiled with ``backend`` (None: as it is), compiled now under ``inductor_config``."""
    if backend is None:
        return gm
    import torch._inductor.config as inductor

    fn = torch.compile(gm, backend=backend, dynamic=False)

    def run(*args):
        with inductor.patch(**inductor_config):
            return fn(*args)
    return run


def _pipeline(overrides, pairs, warmup) -> list[dict]:
    """Per pair, the pipeline step's seconds and this rank's seconds blocked on P2P (posting
    and waiting), with each receive waited on where it is posted (``before``: the blocking
    batches the schedule validator models) and where its tensor is read (``after``: a DualPipeV
    pair's forward runs while the other chunk's gradient arrives)."""
    import torch.distributed as dist

    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.pipeline_step import build_pipeline_step

    cfg = load_config("moe_tiny", [*MODEL, *overrides])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    step = build_pipeline_step(cfg, model, params, record=True)
    local = step.scatter(params)
    state = step.optimizer.init(local)
    batch = data.get_batch(data.from_config(cfg.data), 0, batch_size=cfg.train.batch_size,
                           seq_len=cfg.train.seq_len, seed=0)

    def variant(receive_at: str, overlap_pairs: bool):  # the same programs, run another way
        return dataclasses.replace(step, run=dataclasses.replace(step.run, receive_at=receive_at,
                                                                 overlap_pairs=overlap_pairs))

    def timed(vstep):
        dist.barrier()
        t = time.perf_counter()
        vstep(local, state, batch)  # the same state every call: each call is the same step
        seconds = time.perf_counter() - t
        p2p = sum(e["end_ns"] - e["start_ns"] for e in vstep.last_run.events if e["kind"] == "P2P") / 1e9
        return seconds, p2p

    names = {"before": variant("post", False), "after": variant("use", False)}
    if step.records:  # an MoE exchange in the stages: the overlapped pairs can take turns at its waits
        names["after_paired"] = variant("use", True)
    for _ in range(warmup):
        for v in names.values():
            timed(v)
    rows = []
    for i in range(pairs):
        row = {}
        for v in (list(names) if i % 2 == 0 else list(names)[::-1]):
            row[v], row[f"p2p_{v}"] = timed(names[v])
        rows.append(row)
    return rows


def summarize_pipeline(rows: list[dict]) -> dict:
    """Medians of the step seconds and P2P-blocked seconds, the share of ``before``'s blocked time
    left ``after`` (of the medians), and the median of the per-pair speedups."""
    out = {f"{k}_s": statistics.median(r[k] for r in rows) for k in rows[0]}
    out.update({"p2p_left": out["p2p_after_s"] / out["p2p_before_s"] if out["p2p_before_s"] else float("nan"),
                "pairs": len(rows)})
    for v in (k for k in rows[0] if k.startswith("after")):
        out[f"speedup_{v}"] = statistics.median(r["before"] / r[v] for r in rows)
    if "after_paired" in rows[0]:
        out["speedup_paired_over_serial"] = statistics.median(r["after"] / r["after_paired"] for r in rows)
    return out


def _pipelined(overrides) -> bool:
    return any(o.startswith(("mesh.pp=", "pipeline.schedule=")) for o in overrides)


def _ranks(overrides) -> int:
    """The world size a layout's overrides make (2 for the one-axis layouts)."""
    from shardfn.config import load_config

    return load_config("moe_tiny", [*MODEL, *overrides]).mesh.world_size


def _worker(layouts, pairs, warmup, backend):
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    for name, overrides in layouts.items():
        if _pipelined(overrides):
            out[name] = _pipeline(overrides, pairs, warmup)
            continue
        before = _step_program([*overrides, "partition.overlap=false"], old_moe_order=True)
        after = _step_program([*overrides, "partition.overlap=true"], old_moe_order=False)
        exchange = _ReplayedExchange(dist)
        _timed(before[0], before[1], before[2], exchange, "record")  # what the exchange received
        compute = compute_only(before[0], before[1])
        variants = {"before": (_compiled(before[0], backend), *before[1:]),
                    "after": (_compiled(after[0], backend), *after[1:]),
                    "compute": (_compiled(compute, backend), *before[1:])}
        if any(o.startswith("mesh.ep=") for o in overrides):
            chunked = _step_program([*overrides, "partition.overlap=true", "partition.ep_chunks=2"],
                                    old_moe_order=False)
            variants["after_chunked"] = (_compiled(chunked[0], backend), *chunked[1:])
        if backend == "inductor":  # inductor's own reordering of the unscheduled program
            variants["inductor_reorder"] = (_compiled(before[0], backend, reorder_for_compute_comm_overlap=True),
                                            *before[1:])
        for _ in range(warmup):
            for v, (gm, local, records) in variants.items():
                _timed(gm, local, records, exchange if v == "compute" else None)
        names = list(variants)
        rows = []
        for i in range(pairs):
            order = names[i % len(names):] + names[:i % len(names)]
            row = {}
            for v in order:
                gm, local, records = variants[v]
                row[v] = _timed(gm, local, records, exchange if v == "compute" else None)
            rows.append(row)
        out[name] = rows
    return out


def summarize(rows: list[dict]) -> dict:
    """Medians of each variant's seconds and, per variant other than ``before`` and ``compute``,
    of the per-pair exposed communication and speedup over ``before``."""
    comm = [r["before"] - r["compute"] for r in rows]
    out = {f"{v}_s": statistics.median(r[v] for r in rows) for v in rows[0]}
    out.update({"comm_s": statistics.median(comm), "exposed_before": 1.0, "pairs": len(rows)})
    for v in rows[0]:
        if v in ("before", "compute"):
            continue
        exposed = [(r[v] - r["compute"]) / c if c > 0 else float("nan") for r, c in zip(rows, comm)]
        out[f"exposed_{v}"] = statistics.median(exposed)
        # the same from the medians of the times: steadier when comm is a small part of a step
        out[f"exposed_{v}_of_medians"] = (out[f"{v}_s"] - out["compute_s"]) / (out["before_s"] - out["compute_s"])
        out[f"speedup_{v}"] = statistics.median(r["before"] / r[v] for r in rows)
    return out


def main(argv=None) -> dict:
    from shardfn.runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layouts", default="fsdp2,ep2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--backend", default=None, help="torch.compile backend of the programs (inductor); default eager")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_overlap.json"))
    args = ap.parse_args(argv)
    layouts = {k: LAYOUTS[k] for k in args.layouts.split(",")}
    ranks = {k: _ranks(o) for k, o in layouts.items()}
    per_rank = [{} for _ in range(max(ranks.values()))]
    for n in sorted(set(ranks.values())):   # one launch per world size
        these = {k: o for k, o in layouts.items() if ranks[k] == n}
        for r, out in enumerate(spawn(_worker, n, args=(these, args.pairs, args.warmup, args.backend), timeout_s=900)):
            per_rank[r].update(out)
    piped = {k for k, o in layouts.items() if _pipelined(o)}
    result = {"model": "moe_tiny " + " ".join(MODEL), "ranks": ranks, "threads_per_rank": 1, "backend": args.backend,
              "layouts": {k: (summarize_pipeline if k in piped else summarize)(per_rank[0][k]) for k in layouts},
              "raw_rank0": per_rank[0], "raw_rank1": {k: per_rank[1][k] for k in piped}}
    for k in piped:
        s, other = result["layouts"][k], summarize_pipeline(per_rank[1][k])
        paired = (f"; pairs taking turns {s['after_paired_s'] * 1e3:7.1f} ms ({s['speedup_after_paired']:.2f}x, "
                  f"{s['speedup_paired_over_serial']:.2f}x over one member after the other)"
                  if "after_paired_s" in s else "")
        print(f"{k}: step before {s['before_s'] * 1e3:7.1f} ms  after {s['after_s'] * 1e3:7.1f} ms "
              f"({s['speedup_after']:.2f}x){paired}; blocked on P2P, rank 0: {s['p2p_before_s'] * 1e3:.1f} -> "
              f"{s['p2p_after_s'] * 1e3:.1f} ms, rank 1: {other['p2p_before_s'] * 1e3:.1f} -> "
              f"{other['p2p_after_s'] * 1e3:.1f} ms")
    for k, s in result["layouts"].items():
        if k in piped:
            continue
        others = [v[len("speedup_"):] for v in s if v.startswith("speedup_")]
        print(f"{k:6s} before {s['before_s'] * 1e3:7.1f} ms  compute {s['compute_s'] * 1e3:7.1f} ms  "
              f"comm {s['comm_s'] * 1e3:6.1f} ms  " + "  ".join(
                  f"{v} {s[f'{v}_s'] * 1e3:7.1f} ms (exposed {s[f'exposed_{v}']:.0%} median of pairs, "
                  f"{s[f'exposed_{v}_of_medians']:.0%} of medians; {s[f'speedup_{v}']:.2f}x)"
                  for v in others))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
