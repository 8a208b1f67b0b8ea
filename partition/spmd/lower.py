"""Lower: the per-rank program, with the collectives the placements imply.

Propagation runs under ``make_fx`` on local (per-rank) fake tensors: DTensor desugars every op
into local aten ops plus functional collectives (``_c10d_functional.all_reduce`` etc.), which is
exactly the program one rank runs. Inputs come in as local shards in their ``in_specs``; outputs
leave as local shards in their ``out_specs``.

    local = lower(traced, mesh, in_placements, out_placements, stored=[...], fsdp_axes=("fsdp",))
    print(local.graph_module.graph)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core import _torch_private as private
from shardfn.partition.spmd.propagate import ShardingError, ShardingInterpreter
from shardfn.partition.spmd.trace import Traced

COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",   # in place, on a buffer of its own (partition.passes.bucket)
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


@dataclass
class Lowered:
    """The per-rank program and what it needs to be called."""

    graph_module: torch.fx.GraphModule   # local tensors in, local tensors out
    in_placements: list                  # per input leaf, DTensor placements
    out_placements: list                 # per output leaf
    local_in_meta: list                  # fake local inputs (shape/dtype per rank)


def local_inputs(traced: Traced, mesh, in_placements) -> list[torch.Tensor]:
    """Empty local tensors with each input's per-rank shape (for tracing only)."""
    return [
        torch.empty(private.local_shape(meta.shape, mesh.device_mesh, pl), dtype=meta.dtype)
        for meta, pl in zip(traced.in_meta, in_placements)
    ]


def lower(
    traced: Traced,
    mesh,
    in_placements: Sequence,
    out_placements: Sequence,
    *,
    stored: Sequence[bool] = (),
    fsdp_axes: Sequence[str] = (),
    reuse_gathers: bool = False,
    sequence_parallel: Sequence[str] = (),
) -> Lowered:
    """Run propagation under make_fx on local fake inputs and return the per-rank graph.

    An ``out_placements`` entry of None keeps whatever placement propagation gave that output
    (a gradient left as a partial sum, to be reduced later); ``Lowered.out_placements`` has the
    placements every output really leaves in. ``reuse_gathers``: a stored value is gathered
    once and the gathered copy serves each later use (``partition.reshard_after_forward=false``).
    ``sequence_parallel``: mesh axes a ``[batch, seq, ...]`` activation's partial sum is
    reduce-scattered over along its sequence dim (Megatron-SP; ``propagate``).
    """
    stored = list(stored) or [False] * len(traced.in_meta)
    interp = ShardingInterpreter(traced.graph_module, mesh, stored, fsdp_axes, reuse_gathers=reuse_gathers,
                                 sequence_parallel=sequence_parallel)
    dmesh = mesh.device_mesh
    kept = list(out_placements)

    def local_fn(*local):
        dts = [
            DTensor.from_local(t, dmesh, pl, run_check=False, shape=meta.shape, stride=meta.stride())
            for t, pl, meta in zip(local, in_placements, traced.in_meta)
        ]
        outs = interp.run(*dts)
        graph = private.current_trace_graph()
        before = len(graph.nodes)
        result = []
        for i, (o, pl) in enumerate(zip(outs, out_placements)):
            if not isinstance(o, DTensor):
                raise ShardingError(f"output {i} is not a tensor produced by the graph")
            if pl is None:
                kept[i] = tuple(o.placements)
                result.append(o.to_local())
            else:
                result.append(o.redistribute(dmesh, pl).to_local())
        for node in list(graph.nodes)[before:]:
            node.meta["sf_source"] = "output"  # collectives that bring outputs to out_specs
        return result

    example = local_inputs(traced, mesh, in_placements)
    # DTensor caches decisions by meshes that compare equal; those of an equal mesh built earlier
    # (another Mesh of the same axes) name that mesh's process groups, not this one's
    private.clear_sharding_cache()
    with private.faster_propagation():
        gm = make_fx(local_fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*example)
    return Lowered(gm, list(in_placements), kept, example)


def lower_redistribute(metas: Sequence[torch.Tensor], mesh, src: Sequence, dst: Sequence) -> Lowered:
    """The per-rank program that moves values of global shapes ``metas`` from placements
    ``src`` to ``dst``: a parameter gather before a pipeline stage's microbatches, or the one
    gradient reduction after them. Its collectives are in ``graph_module`` (and in reports).

        gather = lower_redistribute([w], mesh, [(Shard(0),)], [(Replicate(),)])
        (w_full_local,) = gather.graph_module(w_shard)
    """
    dmesh = mesh.device_mesh

    def local_fn(*local):
        out = []
        for t, meta, a, b in zip(local, metas, src, dst):
            x = DTensor.from_local(t, dmesh, a, run_check=False, shape=meta.shape, stride=meta.stride())
            out.append(x.redistribute(dmesh, b).to_local())
        return out

    example = [torch.empty(private.local_shape(m.shape, dmesh, pl), dtype=m.dtype) for m, pl in zip(metas, src)]
    with private.faster_propagation():
        gm = make_fx(local_fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*example)
    return Lowered(gm, list(src), list(dst), example)


def collective_nodes(gm: torch.fx.GraphModule):
    """``(node, kind)`` for every functional collective in a local graph."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional":
            kind = COLLECTIVES.get(n.target._opname)
            if kind is not None:
                yield n, kind
