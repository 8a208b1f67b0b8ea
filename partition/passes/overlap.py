"""Communication hidden behind compute: a scheduling pass on the per-rank program.

A lowered per-rank program (``partition.spmd.lower``) issues each functional collective
(``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``,
``all_to_all_single``) where its value is first needed and waits on it at once
(``_c10d_functional.wait_tensor`` right after). Functional collectives are asynchronous until
their ``wait_tensor``, so this pass reorders the program:

- each collective is issued as early as its inputs allow: right after the last node it reads;
- each ``wait_tensor`` is moved as late as its first use;
- within a memory bound: a collective whose output is larger than its input (an all-gather, an
  all-to-all) holds its output from its new issue point to where the unscheduled program issued
  it; the sum of those early bytes never exceeds ``max_bytes`` at any point of the program.
  The default bound is two layers of gathered bytes (the layer in use and the next one), which
  is FSDP's prefetch of one layer ahead, in the forward and in the backward. A reduce-scatter or
  all-reduce holds nothing early (its input is alive until the unscheduled issue point anyway),
  so gradient reduce-scatters are issued as soon as each gradient is computed and stay in flight
  until the optimizer reads them.

Collectives keep their relative order (every rank issues them in the same order) and move past
no node that writes a tensor in place (``sub_``, ``copy_``...): such nodes are fences for issues
and waits alike, so no in-flight collective reads or fills a buffer another op writes. Only nodes
move; no op changes, so the results are bitwise those of the unscheduled program.

It works on any per-rank program with functional collectives followed by ``wait_tensor``
(bucketed ones included), eager (``backend=None``) or compiled; under inductor the compiled
program keeps the graph's order of collectives and waits (inductor's own
``reorder_for_compute_comm_overlap`` is off by default; ``benchmarks/bench_overlap.py``
measures both).

    gm = overlap(lowered.graph_module)                      # a pass: graph in, graph out
    step = sf.jit(train_step, mesh, ..., passes={"after_lower": [overlap_pass()]})
"""

from __future__ import annotations

import bisect
import operator
from typing import Callable

import torch
import torch.fx as fx

WAIT = "wait_tensor"


def is_collective(node: fx.Node) -> bool:
    """A functional collective's issue (``_c10d_functional.*`` other than ``wait_tensor``).

        [n for n in gm.graph.nodes if is_collective(n)]
    """
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == "_c10d_functional" and target._opname != WAIT)


def is_wait(node: fx.Node) -> bool:
    """A ``_c10d_functional.wait_tensor`` node.

        waits = [n for n in gm.graph.nodes if is_wait(n)]
    """
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == "_c10d_functional" and target._opname == WAIT)


def writes_in_place(node: fx.Node) -> bool:
    """A node that mutates a tensor (a fence the pass moves nothing across).

        writes_in_place(n)   # True for aten.sub_.Tensor, aten.copy_.default, ...
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target._schema.is_mutable and target.namespace != "_c10d_functional"


def early_cost(node: fx.Node) -> int:
    """Bytes a collective holds when issued before its unscheduled place: its output's bytes
    when the output is larger than its input (all-gather, all-to-all), else 0.

        early_cost(all_gather_node)   # world * shard bytes
    """
    out = _bytes(node)
    inp = sum(_bytes(a) for a in node.all_input_nodes)
    return out if out > inp or node.target._opname.startswith("all_to_all") else 0


def layer_of(node: fx.Node) -> tuple[str, int] | None:
    """``(placeholder name, i)`` when ``node`` reads ``select(placeholder, 0, i)`` (through views):
    a stacked parameter's layer ``i``; else None.

        layer_of(all_gather_node.args[0])   # ('arg5_1', 1): layer 1 of the stacked leaf arg5_1
    """
    while isinstance(node, fx.Node) and _is_view(node):
        if _name(node) == "select" and node.args[1] == 0:
            base = _root(node.args[0])
            if base.op == "placeholder":
                return base.name, node.args[2] % node.args[0].meta["val"].shape[0]
        node = node.args[0]
    return None


def layer_bytes(gm: fx.GraphModule) -> int:
    """The largest gathered bytes of one layer: over stacked parameters' layers, the early cost
    of that layer's collectives, each distinct input counted once (the backward's re-gather of
    a weight is the same layer's bytes again, not another layer's). 0 without stacked layers.

        layer_bytes(lowered.graph_module)   # one llama_tiny layer's weights, gathered
    """
    per_layer: dict[int, dict[fx.Node, int]] = {}
    for node in gm.graph.nodes:
        if not is_collective(node) or not early_cost(node):
            continue
        tag = layer_of(node.args[0])
        if tag is not None:
            per_layer.setdefault(tag[1], {})[node.args[0]] = early_cost(node)
    return max((sum(v.values()) for v in per_layer.values()), default=0)


def default_max_bytes(gm: fx.GraphModule, layers_ahead: int = 1) -> int:
    """The default bound of :func:`overlap`: ``1 + layers_ahead`` layers of gathered bytes (the
    layer in use plus the ones prefetched), and at least the largest single early collective.

        default_max_bytes(gm)   # 2 * layer_bytes(gm) for a stacked model
    """
    largest = max((early_cost(n) for n in gm.graph.nodes if is_collective(n)), default=0)
    return max((1 + layers_ahead) * layer_bytes(gm), largest)


def schedule(gm: fx.GraphModule, max_bytes: int | None = None) -> list[fx.Node]:
    """The overlapped order of ``gm``'s nodes (see the module docstring); ``gm`` is not changed.

        order = schedule(gm, max_bytes=64 << 20)
    """
    if max_bytes is None:
        max_bytes = default_max_bytes(gm)
    if max_bytes < 0:
        raise ValueError(f"overlap: max_bytes={max_bytes} must be >= 0 (0: move only collectives that hold no "
                         f"bytes early, such as reduce-scatters; None: two layers of gathered bytes)")
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    fences = _fences(nodes)
    first = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    key: dict[fx.Node, tuple] = {}
    for node in _input_views(nodes):  # views of inputs that collectives read: made up front
        key[node] = (first, -1, pos[node])
        pos[node] = first - 1
    early = [0] * (len(nodes) + 1)  # bytes issued ahead of their unscheduled place, per position
    last_issue = 0
    for seq, node in enumerate(n for n in nodes if is_collective(n)):
        here = pos[node]
        written = sorted(f for a in node.all_input_nodes for f in fences.get(_root(a), ()))
        if any(is_wait(a) for a in node.all_input_nodes):
            last_issue = here + 1  # it reads another collective's result: it stays, and so do later ones
            continue
        lo = max([last_issue] + [pos[a] + 1 for a in node.all_input_nodes] + [_last_before(written, here) + 1])
        cost = early_cost(node)
        start = here
        for p in range(here - 1, lo - 1, -1):  # the earliest point from which it fits until `here`
            if early[p] + cost > max_bytes:
                break
            start = p
        for p in range(start, here):
            early[p] += cost
        if start < here:
            key[node] = (start, 0, seq)
            last_issue = start
        else:
            last_issue = here + 1
    for seq, node in enumerate(n for n in nodes if is_wait(n)):
        readers = list(node.users)
        if isinstance(node.args[0], fx.Node):  # and whatever else reads the collective's result
            readers += [u for u in node.args[0].users if u is not node]
        use = min((pos[u] for u in readers), default=len(nodes) - 1)
        issued = node.args[0]
        if isinstance(issued, fx.Node) and issued.target is operator.getitem:  # one result of a coalesced one
            issued = issued.args[0]
        sources = issued.all_input_nodes if isinstance(issued, fx.Node) else []
        written = sorted(f for a in sources for f in fences.get(_root(a), ()))
        use = min(use, _first_after(written, pos[node], use))
        if use > pos[node] + 1:
            key[node] = (use, 1, seq)
    return sorted(nodes, key=lambda n: key.get(n, (pos[n], 2, 0)))


def overlap(gm: fx.GraphModule, max_bytes: int | None = None) -> fx.GraphModule:
    """``gm`` with its collectives issued early and waited on late (in place, recompiled).

    Args:
        gm: a per-rank program with functional collectives each followed by ``wait_tensor``.
        max_bytes: the most bytes of collective outputs issued ahead of their unscheduled place
            at any point; None: :func:`default_max_bytes` (two layers of gathered weights).

    Returns:
        ``gm``, reordered; the same nodes, so the results are bitwise the same.

    Example:
        lowered = sf.jit(step, mesh, ..., fsdp_argnums=(0,)).lower(params, opt_state, batch)
        gm = overlap(lowered.graph_module)
    """
    _check_groups(gm)
    order = schedule(gm, max_bytes)
    graph = gm.graph
    _check_topological(order)
    anchor = next(iter(graph.nodes))
    for node in order[1:]:
        anchor.append(node)
        anchor = node
    graph.lint()
    gm.recompile()
    return gm


def overlap_pass(max_bytes: int | None = None) -> Callable[[fx.GraphModule], fx.GraphModule]:
    """:func:`overlap` as an ``after_lower`` pass for ``sf.jit(..., passes=...)``.

        step = sf.jit(train_step, mesh, ..., passes={"after_lower": [overlap_pass()]})
    """
    def overlap_graph(gm: fx.GraphModule) -> fx.GraphModule:
        return overlap(gm, max_bytes)

    overlap_graph.__name__ = "overlap"
    return overlap_graph


def issue_order(gm: fx.GraphModule) -> list[tuple[str, int, int]]:
    """``(node name, issue position, wait position)`` for every collective of ``gm``: how far
    each runs ahead of its wait (a report of the schedule).

        [(n, i, w) for n, i, w in issue_order(gm) if w - i > 1]   # the overlapped ones
    """
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for node in gm.graph.nodes:
        if is_collective(node):
            waits = [u for u in node.users if is_wait(u)]
            out.append((node.name, pos[node], min((pos[w] for w in waits), default=pos[node])))
    return out


def _check_groups(gm: fx.GraphModule) -> None:
    """Refuse a program whose collectives run on a gloo group with more than one worker thread:
    with several collectives in flight at once on such a group, a rank's heap was corrupted
    (docs/passes.md); the groups shardfn creates have one."""
    from shardfn.core._torch_private import gloo_worker_threads

    seen = set()
    for node in gm.graph.nodes:
        if not is_collective(node) or (name := node.args[-1]) in seen:  # its group_name, last as lowered
            continue
        seen.add(name)
        threads = gloo_worker_threads(name)
        if threads is not None and threads > 1:
            raise RuntimeError(
                f"overlap: {node.name} ({_name(node)}) runs on gloo process group {name!r}, which has {threads} "
                "worker threads; with several collectives in flight at once, such a group corrupted memory "
                "(docs/passes.md). Let shardfn create the process group (build the Mesh before any "
                "init_process_group: it reads the torchrun variables, as `shardfn train --nproc N` sets them), "
                "or call shardfn.partition.mesh.one_gloo_worker_thread() before your init_process_group, or run "
                "without the pass (partition.overlap=false; no overlap_pass in sf.jit's passes)")


def _name(node: fx.Node) -> str:
    return getattr(getattr(node.target, "_overloadpacket", None), "__name__", "")


def _is_view(node: fx.Node) -> bool:
    """An op whose output aliases its first argument without writing it (view, select, t...)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _root(node: fx.Node) -> fx.Node:
    """The node that owns the storage ``node`` views (``node`` itself when it is no view)."""
    while isinstance(node, fx.Node) and _is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _input_views(nodes: list[fx.Node]) -> list[fx.Node]:
    """Views of the program's inputs (chains of view ops from a placeholder) that a collective
    reads: a stacked weight's ``select(view(w), 0, i)`` before its all-gather. Making them at the
    start costs nothing and lets the gather be issued before the layer that first reads it."""
    from_input: set[fx.Node] = set()
    for n in nodes:
        if n.op == "call_function" and _is_view(n) and n.all_input_nodes and all(
                a.op == "placeholder" or a in from_input for a in n.all_input_nodes):
            from_input.add(n)
    wanted: set[fx.Node] = set()
    stack = [a for n in nodes if is_collective(n) for a in n.all_input_nodes if a in from_input]
    while stack:
        n = stack.pop()
        if n not in wanted:
            wanted.add(n)
            stack.extend(a for a in n.all_input_nodes if a in from_input)
    return [n for n in nodes if n in wanted]


def _fences(nodes: list[fx.Node]) -> dict[fx.Node, list[int]]:
    """Positions of the in-place writes to each storage, by the node that owns it."""
    out: dict[fx.Node, list[int]] = {}
    for i, n in enumerate(nodes):
        if writes_in_place(n):
            for a in n.all_input_nodes:  # conservatively: every tensor argument may be written
                out.setdefault(_root(a), []).append(i)
    return out


def _bytes(node) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(v.numel() * v.element_size() for v in val if isinstance(v, torch.Tensor))
    return 0


def _last_before(fences: list[int], here: int) -> int:
    i = bisect.bisect_left(fences, here)
    return fences[i - 1] if i else -1


def _first_after(fences: list[int], here: int, default: int) -> int:
    i = bisect.bisect_right(fences, here)
    return fences[i] if i < len(fences) else default


def _check_topological(order: list[fx.Node]) -> None:
    seen: set[fx.Node] = set()
    for node in order:
        for a in node.all_input_nodes:
            if a not in seen:
                raise AssertionError(f"overlap: {node.name} would run before its input {a.name}")
        seen.add(node)

