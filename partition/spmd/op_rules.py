"""Sharding rules for ops torch's DTensor does not cover, registered through its public
``register_sharding`` hook. Each rule lists the acceptable (output, input) placement pairs for
one mesh dim; DTensor expands them over the mesh and picks the cheapest.

- CPU fused attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward):
  split over batch (dim 0) or heads (dim 1), as the CUDA kernels are.

- Routed experts (``shardfn::grouped_mm``): replicated only. A layout splits experts inside an
  ``sf.local_map`` region, on each rank's own tokens; outside one (a one-device mesh, which the
  planner lowers too) the grouped GEMM sees every token and every expert.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

aten = torch.ops.aten

_registered = False


def register_all() -> dict:
    """Register every rule once (idempotent). Returns ``{op: {output index: input index}}``: a
    partial-sum output of ``op`` is reduced at once onto that input's placements (a
    reduce-scatter where the input is sharded), so a gradient comes back laid out as its value
    was (``partition.spmd.context_rules.register_rules``)."""
    from shardfn.partition.spmd.context_rules import register_rules

    global _registered
    if _registered:
        return register_rules()
    _registered = True

    import shardfn.core.grouped_mm  # noqa: F401  (registers shardfn::grouped_mm)

    reduce_like_input = register_rules()  # context parallelism: attention over a sequence split on cp

    @register_sharding(torch.ops.shardfn.grouped_mm.default)
    def _grouped_mm(x, w, offs):
        return [([Replicate()], [Replicate(), Replicate(), Replicate()])]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _flash_cpu(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        rules = [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None, None])]
        for d in (0, 1):  # batch, heads
            rules.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None]))
        return rules

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _flash_cpu_bwd(grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=None):
        rules = [([Replicate()] * 3, [Replicate()] * 6 + [None, None])]
        for d in (0, 1):
            rules.append(([Shard(d)] * 3, [Shard(d)] * 6 + [None, None]))
        return rules

    return reduce_like_input
