"""The one FLOP model: floating-point operations of an op at given shapes, and of a traced node.

Matmul-like ops count ``2*M*N*K`` through torch's own formulas (``torch.utils.flop_counter``),
plus the formulas torch lacks: CPU fused attention (forward ``4*B*H*Sq*Sk*D``, backward twice
that; no causal discount, as torch's counter) and shardfn's grouped expert GEMM and
expert-parallel exchange. The auto-sharder prices ops with :func:`op_flops` at local shapes;
the pipeline balances stages with :func:`node_flops`.

    op_flops(torch.ops.aten.mm.default, (torch.Size([16, 32]), torch.Size([32, 64])), {}, None)  # 65536
    node_flops(mm_node)                                                                         # the same
"""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from shardfn.core.expert_ffn import SWIGLU, ExpertFFN, ffn_from
from shardfn.partition.spmd.fx import moves_no_bytes, node_val

aten = torch.ops.aten


def _shape(x) -> tuple:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)


def _sdpa_cpu(q, k, v, *args, **kwargs) -> float:
    # [B, H, S, D]: two matmuls of 2*B*H*Sq*Sk*D FLOPs each
    b, h, sq, d = _shape(q)
    return 4.0 * b * h * sq * _shape(k)[-2] * d


def _sdpa_cpu_backward(grad, q, k, v, *args, **kwargs) -> float:
    b, h, sq, d = _shape(q)
    return 8.0 * b * h * sq * _shape(k)[-2] * d


_EXTRA = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


def expert_flops(x, idx, w1, shared_w1=None, ffn: ExpertFFN = SWIGLU) -> float:
    """Forward FLOPs of the routed experts (``ffn``'s GEMMs, SwiGLU's three by default, over
    ``T * top_k`` rows of ``x [T, D]`` routed by ``idx [T, top_k]``, experts' first weight
    ``w1 [E, D, F]``) and, with ``shared_w1 [D, Hs]``, the shared experts' three matmuls over
    ``T`` rows. Shapes or tensors.

    Example:
        expert_flops((64, 32), (64, 2), (8, 32, 16))  # 3 * 2 * 128 * 32 * 16
    """
    x, idx = _shape(x), _shape(idx)
    n = 1
    for d in idx:
        n *= d
    shared = 3 * 2.0 * x[0] * x[1] * _shape(shared_w1)[1] if shared_w1 is not None else 0.0
    return n * ffn.flops_per_row(w1) + shared


def _expert_flops(name: str, args: tuple) -> float | None:
    """``2*T*K*N`` for ``shardfn::grouped_mm``; for ``shardfn::ep_experts`` (the expert-parallel
    exchange, whose experts run inside it) its experts' grouped GEMMs over ``T * top_k`` rows, as
    if this rank's experts received an even share of the tokens, plus the shared experts' three
    matmuls over ``T`` rows when it runs them too. None for other ops."""
    if name == "shardfn::grouped_mm":
        x, w = _shape(args[0]), _shape(args[1])
        return 2.0 * x[0] * x[1] * (w[2] if len(w) == 3 else w[1])
    if name == "shardfn::ep_experts":
        x, idx, expert_weights, shared, ffn, ffn_args = args[0], args[1], args[3], args[4], args[10], args[11]
        return expert_flops(x, idx, expert_weights[0], shared[0] if shared else None, ffn=ffn_from(ffn, ffn_args))
    return None


def op_flops(op: Any, args: tuple, kwargs: dict, out_val: Any) -> float:
    """FLOPs of ``op`` on ``args`` (tensors or shapes); 0 for an op no formula covers.

    Example:
        op_flops(aten.mm.default, (torch.Size([16, 32]), torch.Size([32, 64])), {}, None)  # 65536.0
    """
    schema = getattr(op, "_schema", None)
    if schema is not None:
        expert = _expert_flops(schema.name, args)
        if expert is not None:
            return expert
    packet = getattr(op, "overloadpacket", op)
    try:
        if packet in flop_registry:
            return float(flop_registry[packet](*args, out_val=out_val, **kwargs))
        if packet in _EXTRA:
            return float(_EXTRA[packet](*args, **kwargs))
    except Exception:  # a formula this version cannot evaluate on these arguments: count it as free
        return 0.0
    return 0.0


def node_flops(node: fx.Node) -> float:
    """Forward cost of one graph node for balancing pipeline stages: :func:`op_flops` (an
    ``sf.local_map`` region: its own ``flops``), or one per output element for any other op that
    moves bytes (views and ``getitem`` cost nothing).

    Example:
        node_flops(mm_node)  # 2 * 16 * 64 * 32 for x [16, 32] @ w [32, 64]
    """
    if node.op != "call_function":
        return 0.0
    val = node_val(node)
    args, kwargs = fx.node.map_arg((node.args, dict(node.kwargs)), node_val)
    if node.target is torch.ops.shardfn.local_region.default:  # an sf.local_map region: its own count
        from shardfn.partition.local_map import region

        reg = region(args[1])
        if reg.flops is not None:
            return float(reg.flops(*optree.tree_unflatten(reg.in_treedef, list(args[0]))))
        return float(sum(v.numel() for v in val if isinstance(v, torch.Tensor)))
    flops = op_flops(node.target, args, kwargs, val)
    if flops:
        return flops
    if isinstance(val, torch.Tensor) and not moves_no_bytes(node):
        return float(val.numel())
    return 0.0
