"""Tracing a representative step: what one microbatch saves and communicates on a layout's mesh.

The run's own train step (``runtime.partitioned.mesh_step``) is lowered with fake tensors on a
fake mesh of the layout's non-pipeline axes, for a reduced model (one layer of each stack, then
each stack once more) whose differences are exact per-layer quantities.

    prof = profile(cfg, {"dp": 2, "fsdp": 1, "ep": 1, "tp": 2}, rows=4)
    prof.per_layer["layers"]      # (saved activation bytes, collectives) of one layer, per microbatch
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Mapping

import optree
import torch

from shardfn.core._torch_private.propagation import PropagationCache, shared_propagation
from shardfn.partition.layouts.axes import mesh_axes
from shardfn.partition.passes.bucket import member_input
from shardfn.partition.spmd.fx import ancestors, descendants, is_view, nbytes
from shardfn.partition.spmd.report import collectives, peak_temporary_bytes

FULL_TRACE_MAX_LAYERS = 4
"""Models with at most this many layers are traced whole (no per-layer scaling) when ``pp == 1``."""

Comm = dict
"""``{(op, axis): (bytes, count)}``: collectives per rank, summed by op and mesh axis."""

PROPAGATION = PropagationCache()
"""DTensor's sharding and redistribution answers, shared by every lowering of the planner while
one (fake) process group lives: a second lowering on a mesh asks only what the first did not."""


def comm_add(a: Comm, b: Comm, scale: float = 1) -> Comm:
    out = dict(a)
    for key, (size, count) in b.items():
        b0, c0 = out.get(key, (0, 0))
        out[key] = (b0 + scale * size, c0 + scale * count)
    return out


def comm_round(c: Comm) -> Comm:
    return {k: (int(round(b)), int(round(n))) for k, (b, n) in c.items() if round(n) or round(b)}


@dataclass(frozen=True)
class Measure:
    """What one lowered step measures on one rank, for one microbatch."""

    saved_bytes: int                 # forward values the backward reads
    mb_comm: Comm                    # collectives of the forward and backward
    leaf_comm: dict                  # parameter path -> its gradient reduction (per step)
    shared_comm: Comm                # the other per-step collectives (optimizer, outputs)
    peak_temporary_bytes: int        # report.peak_temporary_bytes of the whole program
    nodes: int


@dataclass(frozen=True)
class Profile:
    """Per-microbatch quantities of a layout's mesh (``pp`` left out) at one microbatch size,
    from lowering representative steps: ``base`` (what is not a layer) plus ``per_layer[stack]``
    per layer of each stack, each ``(saved activation bytes, collectives)``; the gradient
    reductions per parameter (``leaf_comm``, as traced with ``traced_layers`` layers) and the
    other per-step collectives (``shared_comm``).

    Example:
        prof = profile(cfg, {"dp": 16, "fsdp": 1, "ep": 64, "tp": 1}, rows=1)
        prof.per_layer["moe_layers"][0]      # saved bytes of one MoE layer, per microbatch
    """

    axes: dict
    rows: int
    base: tuple
    per_layer: dict
    leaf_comm: dict
    traced_layers: dict
    shared_comm: Comm
    full: bool
    traces: tuple                      # ({"layers": {...}, "seconds": s, "nodes": n}, ...)
    step_temporary_bytes: int = 0      # a whole-model trace: its program's peak of values it makes

    @property
    def seconds(self) -> float:
        return sum(t["seconds"] for t in self.traces)


def _representative(cfg, model_cfg, axes: Mapping[str, int], rows: int):
    """``cfg`` with a reduced model, the mesh ``axes`` (no pp), one microbatch of ``rows`` rows per rank."""
    data = axes.get("dp", 1) * axes.get("fsdp", 1) * axes.get("ep", 1)
    mesh = dataclasses.replace(cfg.mesh, pp=1, **{a: axes.get(a, 1) for a in ("dp", "fsdp", "cp", "ep", "tp")})
    train = dataclasses.replace(cfg.train, batch_size=rows * data, compile=False)
    pipeline = dataclasses.replace(cfg.pipeline, microbatches=1, stages=None)
    return dataclasses.replace(cfg, model=model_cfg, mesh=mesh, train=train, pipeline=pipeline)


def _step(cfg, dtype: torch.dtype):
    """The run's partitioned step on a fake mesh of ``cfg.mesh`` (pp left out) and its fake
    arguments ``(params, opt_state, batch)``."""
    from shardfn import models
    from shardfn.core._torch_private import fake_mode
    from shardfn.partition.mesh import fake_mesh
    from shardfn.partition.spmd.context_rules import balanced_batch
    from shardfn.runtime.partitioned import mesh_step
    from shardfn.runtime.train_step import make_optimizer

    model = models.get(cfg.model_name)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    shapes = model.init(cfg.model, 0, device="meta", dtype=dtype)
    with fake_mode():  # empty tensors of the parameters' shapes: drawing their values is slow and moot
        params = optree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype), shapes, none_is_leaf=False)
        optimizer = make_optimizer(cfg.train, model)
        state = optimizer.init(params)
        batch = {"inputs": torch.zeros(b, s, dtype=torch.long), "targets": torch.zeros(b, s, dtype=torch.long)}
        batch = balanced_batch(batch, cfg.mesh.cp)  # context parallelism: the tokens' positions too
    mesh = fake_mesh(mesh_axes(cfg.mesh.axes(), include_pp=False))
    return mesh_step(cfg, model, optimizer, params, mesh, backend=None), (params, state, batch)


def lower_step(cfg, *, dtype: torch.dtype = torch.float32):
    """The run's train step lowered on a fake mesh of ``cfg.mesh`` (pp left out), with fake
    parameters, optimizer state and batch: nothing is allocated or run.

    Example:
        lowered = lower_step(load_config("llama_tiny", ["mesh.dp=2", "mesh.tp=2"]))
        lowered.comm_report(), lowered.memory_report()
    """
    with shared_propagation(PROPAGATION):  # DTensor's answers, asked once per process group
        step, args = _step(cfg, dtype)
        return step.jitted.lower(*args)


def trace_step(cfg, *, dtype: torch.dtype = torch.float32):
    """The run's train step traced at global shapes, with the passes its lowering runs first
    (``train.remat``'s), and not lowered: the program :func:`lower_step` partitions, node for
    node, at a small part of its cost. Its saved activations, spread over the mesh, bound each
    rank's from below (:func:`saved_profile`).

    Example:
        traced = trace_step(load_config("llama_tiny", ["mesh.tp=2"]))
        traced.graph_module.graph
    """
    from shardfn.partition.local_map import mesh_scope
    from shardfn.partition.spmd.trace import trace

    step, args = _step(cfg, dtype)
    jitted = step.jitted
    with mesh_scope(jitted.mesh):
        traced = trace(jitted.fn, args)
    return jitted.passes.run("after_trace", traced)


def lower_pipeline(cfg, layout=None, *, dtype: torch.dtype = torch.float32):
    """The run's pipeline step (``mesh.pp > 1``) built on a fake mesh of the layout, with every
    stage's programs partitioned on its stage mesh: ``step.comm_report(r)`` and
    ``step.memory_report(r)`` are what pipeline rank ``r`` of the real run reports, for the
    collectives the programs and the step run (the MoE all-to-alls depend on routing). Nothing
    is allocated or run.

    Example:
        step = lower_pipeline(load_config("moe_tiny", ["mesh.pp=2", "mesh.fsdp=2", "mesh.ep=2"]))
        step.comm_report(1), step.memory_report(1)
    """
    from shardfn import models
    from shardfn.partition.layouts.axes import mesh_axes
    from shardfn.partition.mesh import fake_mesh
    from shardfn.runtime.param_source import abstract
    from shardfn.runtime.pipeline_step import build_pipeline_step

    if layout is not None:
        cfg = dataclasses.replace(
            cfg, mesh=dataclasses.replace(cfg.mesh, **layout.axes()),
            pipeline=dataclasses.replace(cfg.pipeline, schedule=layout.schedule, microbatches=layout.microbatches,
                                         stages=layout.n_stages))
    model = models.get(cfg.model_name)
    params = abstract(model.init(cfg.model, 0, device="meta", dtype=dtype), "cpu")
    mesh = fake_mesh(mesh_axes(cfg.mesh.axes()))
    return build_pipeline_step(cfg, model, params, mesh=mesh, all_stages=True)


def _output_index(traced, path: tuple) -> int:
    tree = optree.tree_unflatten(traced.out_treedef, list(range(len(traced.out_meta))))
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    for p, leaf in zip(paths, leaves):
        if tuple(p) == path:
            return leaf
    raise KeyError(f"the train step returns no output at {path}")


def saved_bytes(gm: torch.fx.GraphModule, loss: torch.fx.Node) -> int:
    """Bytes of the forward values the backward reads: values ``loss`` depends on that a node
    outside the forward also uses (views count as their base; inputs are not counted).

    Example:
        saved_bytes(lowered.graph_module, loss_node)
    """
    forward = ancestors([loss])
    bases = set()
    for n in forward:
        if n.op != "call_function" or all(u in forward for u in n.users):
            continue
        base = n
        while is_view(base) and base.args and isinstance(base.args[0], torch.fx.Node):
            base = base.args[0]
        if base.op == "call_function":
            bases.add(base)
    return sum(nbytes(b.meta.get("val")) for b in bases)


def _gradient_reductions(global_gm: torch.fx.GraphModule) -> tuple[list, set]:
    """The constraints on the gradients (constrain nodes with no constraint after them) and
    the names of every node from them on (the per-step part of the program)."""
    constrain = torch.ops.shardfn.constrain.default
    nodes = list(global_gm.graph.nodes)
    later: dict = {}
    for n in reversed(nodes):
        later[n] = any(u.target is constrain or later[u] for u in n.users)
    sinks = [n for n in nodes if n.op == "call_function" and n.target is constrain and not later[n]]
    return sinks, {n.name for n in descendants(sinks)}


def measure(lowered) -> Measure:
    """Saved activation bytes and collectives of a lowered train step, split into the
    per-microbatch part (forward and backward), the gradient reduction of each parameter and
    the rest of the per-step part.

    Example:
        m = measure(lower_step(cfg)); m.saved_bytes, m.mb_comm
    """
    gm, traced = lowered.graph_module, lowered.traced
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    loss = member_input(outputs[_output_index(traced, (2, "loss"))])  # before a bucket took it
    sinks, step_nodes = _gradient_reductions(traced.graph_module)
    params = [(p.partition(".")[2], m) for p, m in zip(traced.in_paths, traced.in_meta) if p.startswith("0.")]
    leaf_of = _match_leaves(sinks, params)
    mb, shared, leaf = {}, {}, {}
    for row in _unbucketed(collectives(gm, lowered.mesh)):
        one = {(row["op"], row["axis"]): (row["bytes"], 1)}
        if row["node"] in leaf_of:
            path = leaf_of[row["node"]]
            leaf[path] = comm_add(leaf.get(path, {}), one)
        elif row["node"] in step_nodes or row["node"] == "output":
            shared = comm_add(shared, one)
        else:
            mb = comm_add(mb, one)
    return Measure(saved_bytes(gm, loss), mb, leaf, shared, peak_temporary_bytes(gm), len(gm.graph.nodes))


def _unbucketed(rows: list[dict]) -> list[dict]:
    """Collective rows with each bucket (``partition/passes/bucket.py``) split back into one row per
    tensor it carries: a plan counts collectives per tensor, so a layer's share scales with
    the layer count; buckets merge them at run time, bytes unchanged."""
    out = []
    for row in rows:
        if "bucket" not in row:
            out.append(row)
            continue
        for node, size in zip(row["bucket"], row["bucket_bytes"]):
            out.append({**row, "node": node, "bytes": size})
    return out


def _match_leaves(sinks: list, params: list) -> dict:
    """Gradient-constraint node name -> parameter path: in order, when shapes agree."""
    if len(sinks) != len(params):
        return {}
    out = {}
    for node, (path, meta) in zip(sinks, params):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or tuple(val.shape) != tuple(meta.shape):
            return {}
        out[node.name] = path
    return out


def _trace(cfg, counts: Mapping[str, int], axes, rows, dtype, progress=None) -> tuple[Measure, dict]:
    from shardfn import models

    rep = _representative(cfg, models.get(cfg.model_name).with_layers(cfg.model, counts), axes, rows)
    what = (f"lowering {' + '.join(f'{n} {k}' for k, n in counts.items())} on "
            f"{' '.join(f'{a}={n}' for a, n in axes.items() if n > 1) or '1 device'}, {rows} rows")
    if progress:
        progress(f"  {what} ...")
    tic = time.perf_counter()
    with _ticking(progress, what):
        m = measure(lower_step(rep, dtype=dtype))
    seconds = time.perf_counter() - tic
    if progress:
        progress(f"  {what}: {seconds:.1f} s")
    return m, {"layers": dict(counts), "seconds": round(seconds, 3), "nodes": m.nodes}


@contextlib.contextmanager
def _ticking(progress, what: str, every: float = 10.0):
    """While the body runs, say every ``every`` seconds how long ``what`` has taken so far."""
    if progress is None:
        yield
        return
    tic, done = time.perf_counter(), threading.Event()

    def tick():
        while not done.wait(every):
            progress(f"  {what}: {time.perf_counter() - tic:.0f} s so far")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def profile(cfg, axes: Mapping[str, int], rows: int, *, dtype: torch.dtype = torch.float32,
            full: bool | None = None, cache: dict | None = None, progress=None) -> Profile:
    """The per-microbatch :class:`Profile` of ``cfg``'s model on a mesh of ``axes`` at ``rows``
    rows per rank and microbatch. ``cache`` (a dict the caller owns, e.g. one per search) keeps
    profiles per model, rules, axes, rows, dtype and ``train`` section (precision and remat
    included). ``progress`` (e.g. ``print``) hears each lowering as it starts and ends, and
    every 10 s of a long one.

    ``full=None`` traces the whole model when it has at most :data:`FULL_TRACE_MAX_LAYERS`
    layers; otherwise one layer per stack, then each stack once more, and the differences.

    Example:
        prof = profile(cfg, {"dp": 2, "fsdp": 1, "ep": 1, "tp": 2}, rows=4)
    """
    from shardfn import models

    axes = mesh_axes(axes, include_pp=False)
    stacks = models.get(cfg.model_name).stacks(cfg.model)
    if full is None:
        full = models.get(cfg.model_name).layer_count(cfg.model) <= FULL_TRACE_MAX_LAYERS
    key = _profile_key(cfg, axes, rows, dtype, full)
    if cache is not None and key in cache:
        return cache[key]
    if full:
        counts = dict(stacks)
        m, info = _trace(cfg, counts, axes, rows, dtype, progress)
        prof = Profile(axes, rows, (m.saved_bytes, m.mb_comm), {}, m.leaf_comm, counts, m.shared_comm, True, (info,),
                       m.peak_temporary_bytes)
    else:
        base_counts = {k: 1 for k, _ in stacks}
        base, info = _trace(cfg, base_counts, axes, rows, dtype, progress)
        infos, per_layer = [info], {}
        for k, _ in stacks:
            more, info = _trace(cfg, {**base_counts, k: 2}, axes, rows, dtype, progress)
            infos.append(info)
            per_layer[k] = (more.saved_bytes - base.saved_bytes, comm_round(comm_add(more.mb_comm, base.mb_comm, -1)))
        const_saved = base.saved_bytes - sum(s for s, _ in per_layer.values())
        const_comm = base.mb_comm
        for _, c in per_layer.values():
            const_comm = comm_add(const_comm, c, -1)
        prof = Profile(axes, rows, (const_saved, comm_round(const_comm)), per_layer, base.leaf_comm, base_counts,
                       base.shared_comm, False, tuple(infos))
    if cache is not None:
        cache[key] = prof
    return prof


def _profile_key(cfg, axes: Mapping[str, int], rows: int, dtype: torch.dtype, full: bool) -> tuple:
    return (repr(cfg.model), repr(sorted((k, repr(v)) for k, v in cfg.rules.items())), tuple(axes.items()), rows,
            str(dtype), cfg.train.seq_len, repr(cfg.train), full)


@dataclass(frozen=True)
class Saved:
    """Saved activation bytes of a step's global program (every rank's values whole), per
    microbatch: ``base`` (what is not a layer; with ``full``, the whole model) plus
    ``per_layer[stack]`` per layer of each stack, as :class:`Profile` splits them."""

    base: int
    per_layer: dict
    full: bool
    seconds: float
    traces: int          # programs traced (1 whole model, or 1 + one per stack)


def saved_profile(cfg, axes: Mapping[str, int], rows: int, *, dtype: torch.dtype = torch.float32,
                  full: bool | None = None, cache: dict | None = None) -> Saved:
    """What :func:`profile` measures as saved activations, but of the traced global program
    (:func:`trace_step`, nothing lowered): the same representative steps, layer counts and
    differences, each a fraction of a lowering's cost.

    It bounds the lowered program from below: lowering runs each global node as one per-rank
    node (plus collectives), so each value the global backward reads has a per-rank counterpart
    the rank's backward reads (the value itself, or a collective's result from it), holding at
    least ``1 / ranks`` of its bytes; so every rank of the mesh (``ranks`` = the product of
    ``axes``) saves at least ``saved / ranks`` of each part. ``cache`` as for :func:`profile`.

    Example:
        low = saved_profile(cfg, {"dp": 8, "ep": 8}, rows=1)
        low.per_layer["moe_layers"] / 64      # <= profile(...).per_layer["moe_layers"][0]
    """
    from shardfn import models

    axes = mesh_axes(axes, include_pp=False)
    model = models.get(cfg.model_name)
    stacks = model.stacks(cfg.model)
    if full is None:
        full = models.get(cfg.model_name).layer_count(cfg.model) <= FULL_TRACE_MAX_LAYERS
    key = ("saved", *_profile_key(cfg, axes, rows, dtype, full))
    if cache is not None and key in cache:
        return cache[key]
    tic = time.perf_counter()

    def saved(counts) -> int:
        rep = _representative(cfg, model.with_layers(cfg.model, counts), axes, rows)
        traced = trace_step(rep, dtype=dtype)
        gm = traced.graph_module
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        return saved_bytes(gm, outputs[_output_index(traced, (2, "loss"))])

    if full:
        out = Saved(saved(dict(stacks)), {}, True, 0.0, 1)
    else:
        base_counts = {k: 1 for k, _ in stacks}
        base = saved(base_counts)
        per_layer = {k: saved({**base_counts, k: 2}) - base for k, _ in stacks}
        out = Saved(base - sum(per_layer.values()), per_layer, False, 0.0, 1 + len(per_layer))
    out = dataclasses.replace(out, seconds=round(time.perf_counter() - tic, 3))
    if cache is not None:
        cache[key] = out
    return out
