"""Grouped-query attention read in place: a rewrite of the per-rank program.

Traced for the partitioner, ``core.layers.attention`` repeats each key/value head for its group
of query heads (``repeat_interleave``: ``unsqueeze -> expand -> clone -> view``) so that the
fused attention ops see equal head counts, the form DTensor's sharding rules split over heads.
Once lowered, every shape is a rank's own, so the group size is known for certain; there the
kernels that read the groups themselves (``enable_gqa``'s path) are handed the key/value heads
as they are and the repeated copies are dropped. Going forward that saves one copy of ``k`` and
``v`` per layer (and the memory a backward keeps them for); coming back, the kernel's key/value
gradients come out already summed per group, where the program summed them after it.

One formulation for every device: :data:`KERNELS` lists, per fused attention op the trace can
hold, where its key, value and mask arguments sit and whether it reads grouped heads.

=================================================  ======  =====================================
forward (backward ``..._backward``)                device  grouped key/value heads
=================================================  ======  =====================================
``_scaled_dot_product_flash_attention_for_cpu``    CPU     read in place
``_scaled_dot_product_flash_attention``            CUDA    read in place (FlashAttention-2)
``_scaled_dot_product_cudnn_attention``            CUDA    read in place (no attention bias)
``_scaled_dot_product_efficient_attention``        CUDA    kept repeated: the kernel needs equal
                                                           head counts (``sdp_utils.cpp``), so
                                                           fp32 CUDA attention keeps its copies
=================================================  ======  =====================================

Which op a CUDA trace holds is SDPA's choice at trace time (bf16/fp16 on sm80+: flash; fp32:
efficient; ``torch.nn.attention.sdpa_kernel`` to force one). A head dim that flash pads to a
multiple of 8 puts a pad between the repeat and the kernel; such an attention stays as it was.

The forward's outputs are the same to the bit; the key/value gradients differ from the repeated
form's only in the order each group's sum is taken (float rounding). An attention whose inputs
are not repeated this way, that has a mask, or whose gradients go anywhere but their group sum,
stays as it was.

    gm = read_grouped_heads(lowered.graph_module)    # in place; the first after_lower pass (passes/points.py)
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from shardfn.core._torch_private import fake_mode

_aten = torch.ops.aten


class Kernel(NamedTuple):
    """A fused attention op pair: where its arguments sit, and whether it reads grouped heads."""

    forward: object          # OpOverload: (q, k, v, ...) -> (out, logsumexp, ...)
    backward: object         # OpOverload: (grad_out, q, k, v, ...) -> (dq, dk, dv, ...)
    forward_mask: int | str | None   # the mask/bias argument: a position, a keyword, or none
    backward_mask: int | str | None
    grouped: bool            # the kernel reads H // Hkv query heads per key/value head


KERNELS = (
    Kernel(_aten._scaled_dot_product_flash_attention_for_cpu.default,
           _aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "attn_mask", "attn_mask", True),
    Kernel(_aten._scaled_dot_product_flash_attention.default,
           _aten._scaled_dot_product_flash_attention_backward.default, None, None, True),
    Kernel(_aten._scaled_dot_product_cudnn_attention.default,
           _aten._scaled_dot_product_cudnn_attention_backward.default, 3, 8, True),
    Kernel(_aten._scaled_dot_product_efficient_attention.default,
           _aten._scaled_dot_product_efficient_attention_backward.default, 3, 4, False),
)
FORWARD = KERNELS[0].forward     # the CPU pair, by its old names
BACKWARD = KERNELS[0].backward
FORWARDS = frozenset(k.forward for k in KERNELS if k.grouped)
BACKWARDS = frozenset(k.backward for k in KERNELS if k.grouped)
_GROUPED = FORWARDS | BACKWARDS
_MASK = {op: mask for k in KERNELS for op, mask in ((k.forward, k.forward_mask), (k.backward, k.backward_mask))}


def read_grouped_heads(gm: fx.GraphModule) -> fx.GraphModule:
    """Give ``gm``'s fused attentions that read grouped heads (:data:`KERNELS`: CPU flash, CUDA
    flash and cuDNN; forward and backward) their key/value heads unrepeated (in place; ``gm`` is
    returned). See the module docstring.

        gm = read_grouped_heads(gm)
        [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]   # no repeats left
    """
    changed, backwards = False, []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _GROUPED:
            continue
        is_backward = node.target in BACKWARDS
        at = 2 if is_backward else 1            # (grad, q, k, v, ...) / (q, k, v, ...)
        k, v = (_repeated(node.args[at]), _repeated(node.args[at + 1]))
        if k is None or v is None or k[1] != v[1] or _masked(node):
            continue
        group = k[1]
        if is_backward:
            sums = _group_sums(node, group)
            if sums is None:
                continue
            for grad, summed in sums:
                summed.replace_all_uses_with(grad)
                grad.meta["val"] = summed.meta.get("val")  # its shape, until _refresh_vals runs the kernel
            backwards.append(node)
        node.args = (*node.args[:at], k[0], v[0], *node.args[at + 2:])
        changed = True
    if changed:
        _drop_dead_repeats(gm.graph)
        _refresh_vals(backwards)
        gm.graph.lint()
        gm.recompile()
    return gm


def _masked(node: fx.Node) -> bool:
    """Whether attention ``node`` is given a mask or bias (a kernel without one: never)."""
    where = _MASK[node.target]
    if where is None:
        return False
    if isinstance(where, str):
        return node.kwargs.get(where) is not None
    return len(node.args) > where and node.args[where] is not None


def _repeated(node) -> tuple[fx.Node, int] | None:
    """``(x, g)`` where ``node`` is ``x``'s heads (dim 1 of ``[B, H, S, D]``) each repeated ``g``
    times in a row, as ``repeat_interleave`` traces: ``view(clone(expand(unsqueeze(x, 2))))``."""
    if not _is(node, _aten.view.default):
        return None
    clone = node.args[0]
    if not _is(clone, _aten.clone.default):
        return None
    expand = clone.args[0]
    if not _is(expand, _aten.expand.default):
        return None
    unsqueeze = expand.args[0]
    if not _is(unsqueeze, _aten.unsqueeze.default) or unsqueeze.args[1] != 2:
        return None
    x = unsqueeze.args[0]
    shape = _shape(x)
    if shape is None or len(shape) != 4:
        return None
    b, h, s, d = shape
    group = expand.args[1][2] if len(expand.args[1]) == 5 else None
    if not isinstance(group, int) or group < 2:
        return None
    if list(expand.args[1]) != [b, h, group, s, d] or list(node.args[1]) != [b, h * group, s, d]:
        return None
    return x, group


def _group_sums(backward: fx.Node, group: int) -> list[tuple[fx.Node, fx.Node]] | None:
    """For an attention backward on repeated key/value heads: ``(gradient, its group sum)`` for the
    key and value gradients (outputs 1 and 2), each summed as ``squeeze(sum(view(g, [B, H, group,
    S, D]), [2], keepdim), 2)``; None where any use of them is not that sum."""
    out = []
    for item in backward.users:
        if item.target is not operator.getitem:
            return None
        if item.args[1] == 0:
            continue
        summed = _group_sum(item, group)
        if summed is None:
            return None
        out.append((item, summed))
    return out


def _group_sum(grad: fx.Node, group: int) -> fx.Node | None:
    if len(grad.users) != 1:
        return None
    (view,) = grad.users
    shape = _shape(grad)
    if not _is(view, _aten.view.default) or shape is None or len(view.users) != 1:
        return None
    b, heads, s, d = shape
    if heads % group or list(view.args[1]) != [b, heads // group, group, s, d]:
        return None
    (total,) = view.users
    if not _is(total, _aten.sum.dim_IntList) or list(total.args[1]) != [2] or not _keepdim(total) \
            or len(total.users) != 1:
        return None
    (squeeze,) = total.users
    if _is(squeeze, _aten.squeeze.dims) and list(squeeze.args[1]) == [2]:
        return squeeze
    if _is(squeeze, _aten.squeeze.dim) and squeeze.args[1] == 2:
        return squeeze
    return None


def _keepdim(node: fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _drop_dead_repeats(graph: fx.Graph) -> None:
    """Erase the repeats and group sums nothing reads any more (pure ops only, last first)."""
    dead = (_aten.view.default, _aten.clone.default, _aten.expand.default, _aten.unsqueeze.default,
            _aten.sum.dim_IntList, _aten.squeeze.dims, _aten.squeeze.dim)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in dead and not node.users:
            graph.erase_node(node)


def _refresh_vals(backwards: list[fx.Node]) -> None:
    """The rewritten attention backwards' fake outputs (their key/value gradients are smaller now),
    run again in the trace's fake mode, so later passes read the program's real shapes and strides."""
    for node in backwards:
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        modes = {id(getattr(v, "fake_mode", None)): getattr(v, "fake_mode", None) for v in tensors}
        if len(tensors) != len([a for a in node.args if isinstance(a, fx.Node)]):
            continue
        if len(modes) == 1 and None not in modes.values():
            (mode,) = modes.values()       # a fake-mode trace: every value in one mode
        else:                              # a real-mode trace: each value its own fake mode
            mode = fake_mode()
            vals = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in vals]
        with mode:
            out = node.target(*vals, **node.kwargs)
        node.meta["val"] = out
        for item in node.users:
            if item.target is operator.getitem:
                item.meta["val"] = out[item.args[1]]
