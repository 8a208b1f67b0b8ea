"""Causal attention by positions: ``torch.ops.shardfn.positional_attention``.

Each query attends to the keys whose position is at most its own. Positions are given per token
(``[B, S]`` int64), so the tokens of a sequence may come in any order: a layout that splits the
sequence over ranks (context parallelism, ``partition.spmd.context_rules``) permutes them for load balance
and passes each token's true position. With ``positions = arange(S)`` the result is causal
attention.

The forward and its backward are two custom ops, so the partitioner sees each whole and shards
them by the rules in ``partition.spmd.context_rules`` (queries split over the sequence, keys and values
gathered); their math is plain ``scaled_dot_product_attention`` with a boolean mask, and the
backward recomputes the forward under ``torch.func.vjp`` (no ``[S, S]`` probabilities are kept).

    pos = torch.arange(16).expand(2, 16)
    out = positional_attention(q, k, v, pos, pos, scale=0.125)   # [B, H, S, Dv]
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from shardfn.core.custom_ops import register_autograd

__all__ = ["positional_attention", "positional_attention_reference"]


def positional_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                                   k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """The op's math in plain torch ops (what both custom ops run).

    Args:
        q: ``[B, H, Sq, Dqk]``; k: ``[B, Hkv, Sk, Dqk]``; v: ``[B, Hkv, Sk, Dv]`` (``H % Hkv == 0``).
        q_pos: ``[B, Sq]``, k_pos: ``[B, Sk]`` int64 positions.
        scale: the softmax scale.

    Returns:
        ``[B, H, Sq, Dv]``.

    Example:
        pos = torch.arange(4).expand(1, 4)
        positional_attention_reference(q, k, v, pos, pos, 0.5)
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)                              # [B, H, Sk, Dqk]
        v = v.repeat_interleave(groups, dim=1)                              # [B, H, Sk, Dv]
    mask = k_pos[:, None, None, :] <= q_pos[:, None, :, None]               # [B, 1, Sq, Sk]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@torch.library.custom_op("shardfn::positional_attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
             scale: float) -> torch.Tensor:
    # Outputs are contiguous, as the fake impls say whatever the inputs' strides (a partitioned
    # program feeds gathered, contiguous K/V where the traced one had views).
    return positional_attention_reference(q, k, v, q_pos, k_pos, scale).contiguous()


@_forward.register_fake
def _(q, k, v, q_pos, k_pos, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("shardfn::positional_attention_backward", mutates_args=())
def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor, scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        _, pullback = torch.func.vjp(lambda a, b, c: positional_attention_reference(a, b, c, q_pos, k_pos, scale),
                                     q, k, v)
        return tuple(g.contiguous() for g in pullback(grad.contiguous()))


@_backward.register_fake
def _(grad, q, k, v, q_pos, k_pos, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, q_pos, k_pos, scale = inputs
    ctx.save_for_backward(q, k, v, q_pos, k_pos)
    ctx.scale = scale


def _derivative(ctx, grad):
    q, k, v, q_pos, k_pos = ctx.saved_tensors
    with torch.no_grad():  # first derivatives only
        dq, dk, dv = torch.ops.shardfn.positional_attention_backward(grad, q, k, v, q_pos, k_pos, ctx.scale)
    return dq, dk, dv, None, None, None


_differentiable = register_autograd(_forward, _derivative, setup_context=_setup_context)
"""The op with its derivative, in the form ``torch.func`` transforms accept."""


def positional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         k_pos: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Attention where query ``i`` sees key ``j`` iff ``k_pos[j] <= q_pos[i]`` (per batch row).

    Args:
        q: ``[B, H, Sq, Dqk]``; k: ``[B, Hkv, Sk, Dqk]``; v: ``[B, Hkv, Sk, Dv]``.
        q_pos, k_pos: ``[B, Sq]`` / ``[B, Sk]`` int64 token positions.
        scale: softmax scale; default ``1 / sqrt(Dqk)``.

    Returns:
        ``[B, H, Sq, Dv]``; differentiable in ``q``, ``k``, ``v``.

    Example:
        pos = torch.arange(16).expand(2, 16)
        out = positional_attention(torch.randn(2, 4, 16, 8), kv, kv, pos, pos)   # kv [2, 2, 16, 8]
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _differentiable(q, k, v, q_pos, k_pos, scale)


def positional_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                            k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """``torch.ops.shardfn.positional_attention`` with its arguments as a traced graph calls it,
    differentiable under ``torch.func`` (what a pipeline stage program calls in its place).

        out = positional_attention_op(q, k, v, pos, pos, 0.25)
    """
    return _differentiable(q, k, v, q_pos, k_pos, scale)
