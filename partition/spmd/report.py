"""Reports on a lowered program: its text, its collectives, its memory per rank.

Bytes of a collective are the size of its full buffer on one rank: the tensor for all-reduce,
the gathered output for all-gather, the input for reduce-scatter, what is sent for all-to-all.

    rows = comm_report(lowered.graph_module, mesh)   # [{"op", "axis", "bytes", "count"}, ...]
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Sequence

import torch

from shardfn.partition.spec import describe
from shardfn.partition.spmd.lower import collective_nodes


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def collective_bytes(node: torch.fx.Node, kind: str) -> int:
    inp = node.args[0].meta["val"]
    out = node.meta["val"]
    if kind == "all_gather":
        return _bytes(out)
    return _bytes(inp)


def collectives(gm: torch.fx.GraphModule, mesh) -> list[dict]:
    """One row per collective in program order: op, axis, bytes, shape, source global node."""
    rows = []
    for n, kind in collective_nodes(gm):
        row = {
            "op": kind,
            "axis": mesh.axis_of_group(n.args[-1]),
            "bytes": collective_bytes(n, kind),
            "shape": tuple(n.args[0].meta["val"].shape),
            "node": n.meta.get("sf_source", "?"),
        }
        if "sf_bucket" in n.meta:  # one collective for several tensors (partition/passes/bucket.py)
            row["bucket"] = list(n.meta["sf_bucket"])
            row["bucket_bytes"] = list(n.meta.get("sf_bucket_bytes", ()))
        rows.append(row)
    return rows


def annotate_transitions(global_gm: torch.fx.GraphModule, local_gm: torch.fx.GraphModule, mesh) -> None:
    """Give each node of the global graph ``meta["sf_transitions"]``: the collectives the per-rank
    program runs for it, one dict per collective with ``op``, ``axis``, ``bytes``, ``shape`` and
    ``producer`` (the global node whose value it moves; ``None`` for the node's own output). So
    a pass after propagate sees what each edge costs, not only the placements at its ends.

        annotate_transitions(traced.graph_module, lowered.graph_module, mesh)
        [t["op"] for t in node.meta["sf_transitions"]]    # ["all_gather"]
    """
    by_name = {n.name: n for n in global_gm.graph.nodes}
    inputs = dict(zip([n for n in local_gm.graph.nodes if n.op == "placeholder"],
                      [n.name for n in global_gm.graph.nodes if n.op == "placeholder"]))
    for n in by_name.values():
        n.meta["sf_transitions"] = []
    for c, kind in collective_nodes(local_gm):
        source = c.meta.get("sf_source")
        target = by_name.get(source) if source != "output" else next(
            (n for n in global_gm.graph.nodes if n.op == "output"), None)
        if target is None:
            continue
        target.meta["sf_transitions"].append({
            "op": kind, "axis": mesh.axis_of_group(c.args[-1]), "bytes": collective_bytes(c, kind),
            "shape": tuple(c.args[0].meta["val"].shape), "producer": _producer(c, source, inputs),
        })


def _producer(collective: torch.fx.Node, source: str, inputs: dict) -> str | None:
    """The global node whose value ``collective`` moves: walk its input back through the local
    nodes emitted for the same global node until one comes from another (or is an input)."""
    seen = set()
    node = collective.args[0]
    while isinstance(node, torch.fx.Node) and node not in seen:
        seen.add(node)
        if node.op == "placeholder":
            return inputs.get(node)
        origin = node.meta.get("sf_source")
        if origin is not None and origin != source:
            return origin
        args = node.all_input_nodes
        if not args:
            return None
        node = args[0]
    return None


def comm_report(gm: torch.fx.GraphModule, mesh) -> list[dict]:
    """Collectives per step per rank, summed by (op, axis): rows of op, axis, bytes, count; and
    ``tensors``, the tensors those collectives carry, where buckets (``partition.bucket_bytes``)
    made it more than ``count``."""
    total: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for row in collectives(gm, mesh):
        acc = total[(row["op"], row["axis"])]
        acc[0] += row["bytes"]
        acc[1] += 1
        acc[2] += len(row.get("bucket", (None,)))
    return [{"op": op, "axis": axis, "bytes": b, "count": c, **({"tensors": t} if t != c else {})}
            for (op, axis), (b, c, t) in sorted(total.items())]


def peak_temporary_bytes(gm: torch.fx.GraphModule) -> int:
    """Peak bytes of values the program creates (inputs excluded), freeing each after its last use.

    A value that shares another's storage holds no bytes of its own and keeps that storage alive:
    a view (``view``, ``t``, ``select``, a ``split``'s pieces...), an op's in-place result
    (``add_``, a bucket's ``all_reduce_``) and a collective's ``wait_tensor``. A value's bytes
    are freed after the last use of it or of anything sharing it. A multi-output op's tensors
    are counted where they are taken (its ``getitem`` nodes).

        peak_temporary_bytes(lowered.graph_module)   # what memory_report()["activations"] says
    """
    nodes = list(gm.graph.nodes)
    owner = storage_owners(gm)
    last_use: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[owner.get(a, a)] = i
    live = 0
    peak = 0
    sizes: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        if n.op == "call_function" and owner.get(n) is n:
            val = n.meta.get("val")
            size = _bytes(val) if isinstance(val, torch.Tensor) else 0
            if n not in last_use:  # made and never read: freed at once
                peak = max(peak, live + size)
                continue
            sizes[n] = size
            live += size
            peak = max(peak, live)
        for a in {owner.get(a, a) for a in n.all_input_nodes}:
            if last_use.get(a) == i and a in sizes:
                live -= sizes.pop(a)
    return peak


def storage_owners(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each ``call_function`` node -> the node whose storage its value lives in: itself for an
    op that makes new tensors, else (a view, an in-place result, a ``wait_tensor``, a piece of
    a view op's outputs) the owner of the value it aliases; a multi-output op that makes new
    tensors owns nothing itself (each of its ``getitem`` pieces owns its own).

        owners = storage_owners(gm); owners[view_node] is owners[view_node.args[0]]   # True
    """
    owner: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if n.target is operator.getitem and src is not None:
            of_src = owner.get(src)
            owner[n] = of_src if of_src is not None and of_src is not src else n  # a view op's piece, or its own
        elif src is not None and (_aliases_first_input(n) or n.target is _WAIT):
            owner[n] = owner.get(src, src)
        else:
            owner[n] = n
    return owner


_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _aliases_first_input(node: torch.fx.Node) -> bool:
    """The op's result shares its first input's storage (a view, or that input written in place)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


# Ops that cut a value along a dim: on a value sharded along that dim (a fused qkv projection
# split into q, k, v), each piece straddles ranks and the value is gathered first.
SPLITTING_OPS = ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.slice.Tensor",
                 "aten.narrow.default")


def as_text(global_gm: torch.fx.GraphModule, local_gm: torch.fx.GraphModule, mesh, paths: Sequence[str]) -> str:
    """The global graph, one node a line with its placements, and the collectives each emitted."""
    emitted: dict[str, list[str]] = defaultdict(list)
    for row in collectives(local_gm, mesh):
        if "bucket" in row:
            text = f"{row['op']}[{row['axis']}] in {row['node']} ({row['bytes']} B for {len(row['bucket'])} tensors)"
            for source in dict.fromkeys(row["bucket"]):
                emitted[source].append(text)
        else:
            emitted[row["node"]].append(f"{row['op']}[{row['axis']}] {row['bytes']} B")
    names = mesh.dims
    lines = [f"# mesh {mesh}", "# value : placements  (S(d) = sharded on dim d, S(d,strided k) = sharded on dim d "
                                "in k interleaved blocks, P = partial sum, R = replicated)"]
    ph = iter(paths)
    for n in global_gm.graph.nodes:
        if n.op == "output":
            lines.append(f"return {[str(a) for a in n.args[0]]}")
            lines.extend(f"    ^ {c}" for c in emitted.get("output", []))
            continue
        pl = n.meta.get("sf_placements")
        if pl is None:
            text = "-"
        elif pl and isinstance(pl[0], (tuple, type(None))):
            text = "(" + ", ".join("-" if p is None else describe(p, names) for p in pl) + ")"
        else:
            text = describe(pl, names)
        val = n.meta.get("val")
        shape = list(val.shape) if isinstance(val, torch.Tensor) else ""
        if n.op == "placeholder":
            lines.append(f"{n.name} = input {next(ph, '?')} {shape} : {text}")
        else:
            args = ", ".join([str(a) for a in n.args] + [f"{k}={v}" for k, v in n.kwargs.items()])
            lines.append(f"{n.name} = {n.target}({args}) {shape} : {text}")
        for c in emitted.get(n.name, []):
            lines.append(f"    ^ {c}")
        gathered = [c for c in emitted.get(n.name, []) if c.startswith("all_gather")]
        if gathered and str(n.target) in SPLITTING_OPS:
            total = sum(int(c.split()[1]) for c in gathered)
            lines.append(f"    ! split of a value sharded along the split dim: gathered first ({total} B); lay the "
                         f"fused dim out head-major ([..., heads, 3, head_dim], then unbind) to split without "
                         f"communication")
    return "\n".join(lines)
