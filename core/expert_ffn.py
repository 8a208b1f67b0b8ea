"""The routed experts' feed-forward, in the two forms a layout runs it.

An expert FFN maps expert-major rows ``xs [R, D]`` (``offs [E]``: the int32 end of each
expert's rows) through every expert's own weights. Each kind has

- ``ffn(xs, offs, *weights)``: the differentiable one-device form (autograd, traceable);
- ``ffn.forward(xs, offs, *weights) -> (out, kept)`` and ``ffn.backward(d_out, xs, kept, offs,
  *weights) -> (dxs, *dweights)``: the eager pair the expert-parallel exchange runs between its
  all-to-alls (``runtime/moe_dispatch.py``), the backward from what the forward kept, so no GEMM
  of the forward runs twice.

Kinds: :class:`SwiGLU` (DeepSeek-V3, Qwen3-MoE, Mixtral: ``w1, w2, w3``) and
:class:`ClampedSwiGLU` (gpt-oss: ``w13, b13, w2, b2``, biases, gate/up columns interleaved). A
kind is named in the exchange op by ``name`` and ``args()`` (:func:`ffn_from` rebuilds it), so
the per-rank program reads which feed-forward it runs.

    ffn = ClampedSwiGLU(limit=7.0, alpha=1.702)
    out = ffn(xs, offs, w13, b13, w2, b2)                       # [R, D]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from shardfn.core.grouped_mm import grouped_mm, grouped_mm_now
from shardfn.core.layers import clamped_swiglu

__all__ = ["ExpertFFN", "SwiGLU", "ClampedSwiGLU", "SWIGLU", "ffn_from", "expert_of_rows"]


def expert_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows]`` int64: the expert of each expert-major row, the number of group ends at or
    before it (static shapes, and ops a sharding propagation has rules for: a comparison and a
    sum, ``[rows, E]`` booleans).

        expert_of_rows(torch.tensor([2, 2, 5], dtype=torch.int32), 5)   # tensor([0, 0, 2, 2, 2])
    """
    row = torch.arange(rows, dtype=offs.dtype, device=offs.device)
    return (row.unsqueeze(1) >= offs.unsqueeze(0)).sum(1)


def _segment_sum(values: torch.Tensor, expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``[E, ...]``: the rows of ``values`` summed per expert (a bias's gradient)."""
    return values.new_zeros((n_experts, *values.shape[1:])).index_add_(0, expert, values)


class ExpertFFN:
    """One kind of expert feed-forward (see the module docstring). ``n_weights``: how many
    per-expert tensors it takes; ``name``: its name in the exchange op."""

    name: ClassVar[str]
    n_weights: ClassVar[int]

    def args(self) -> list[float]:
        """Its settings, in field order (the exchange op carries them)."""
        return [float(getattr(self, f.name)) for f in dataclasses.fields(self)]

    def kept_width(self, first) -> int:
        """Columns the forward keeps per row for the backward (its pre-activations), from the
        shape of its first weight (a shape or a tensor)."""
        raise NotImplementedError

    def flops_per_row(self, first) -> float:
        """Forward FLOPs for one routed row, from the shape of its first weight."""
        raise NotImplementedError


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)


def _silu_mul_backward(dh, h1, h3):
    """``(silu(h1) * h3, dh1, dh3)``: the product again and the cotangents of its factors for
    ``dh``, with autograd's own kernels (``mul``'s backward, ``silu_backward``), so the result
    is bitwise what autograd gives."""
    s = F.silu(h1)
    return s * h3, torch.ops.aten.silu_backward(dh * h3, h1), dh * s


@dataclass(frozen=True)
class SwiGLU(ExpertFFN):
    """``(silu(x @ w1) * (x @ w3)) @ w2`` per expert; ``w1, w3 [E, D, F]``, ``w2 [E, F, D]``."""

    name: ClassVar[str] = "swiglu"
    n_weights: ClassVar[int] = 3

    def __call__(self, xs, offs, w1, w2, w3):
        h = F.silu(grouped_mm(xs, w1, offs)) * grouped_mm(xs, w3, offs)        # [R, F]
        return grouped_mm(h, w2, offs)                                          # [R, D]

    def forward(self, xs, offs, w1, w2, w3):
        h1, h3 = grouped_mm_now(xs, w1, offs), grouped_mm_now(xs, w3, offs)
        return grouped_mm_now(F.silu(h1) * h3, w2, offs), (h1, h3)

    def backward(self, d_out, xs, kept, offs, w1, w2, w3):
        """Six grouped GEMMs (the hidden cotangent, two for the input, three for the weights),
        ``core.grouped_mm``'s backward formulas, so bitwise autograd's."""
        h1, h3 = kept
        dh = grouped_mm_now(d_out, w2.transpose(1, 2), offs)                   # [R, F]
        h, dh1, dh3 = _silu_mul_backward(dh, h1, h3)
        dxs = grouped_mm_now(dh1, w1.transpose(1, 2), offs) + grouped_mm_now(dh3, w3.transpose(1, 2), offs)
        dw1, dw2, dw3 = (grouped_mm_now(a.t(), b, offs) for a, b in ((xs, dh1), (h, d_out), (xs, dh3)))
        return dxs, dw1, dw2, dw3

    def kept_width(self, first) -> int:
        return 2 * _shape(first)[2]                                             # h1, h3: [R, F] each

    def flops_per_row(self, first) -> float:
        _, D, F_ = _shape(first)                                                # w1 [E, D, F]
        return 3 * 2.0 * D * F_


@dataclass(frozen=True)
class ClampedSwiGLU(ExpertFFN):
    """gpt-oss's experts: ``clamped_swiglu(x @ w13 + b13) @ w2 + b2`` per expert (``core.layers.
    clamped_swiglu``; ``w13 [E, D, 2F]`` gate/up interleaved, ``b13 [E, 2F]``, ``w2 [E, F, D]``,
    ``b2 [E, D]``)."""

    limit: float = 7.0
    alpha: float = 1.702
    name: ClassVar[str] = "clamped_swiglu"
    n_weights: ClassVar[int] = 4

    def _act(self, h):
        return clamped_swiglu(h, limit=self.limit, alpha=self.alpha)

    def __call__(self, xs, offs, w13, b13, w2, b2):
        e = expert_of_rows(offs, xs.shape[0])
        h = grouped_mm(xs, w13, offs) + b13[e]                                  # [R, 2F]
        return grouped_mm(self._act(h), w2, offs) + b2[e]                       # [R, D]

    def forward(self, xs, offs, w13, b13, w2, b2):
        e = expert_of_rows(offs, xs.shape[0])
        h = grouped_mm_now(xs, w13, offs) + b13[e]
        return grouped_mm_now(self._act(h), w2, offs) + b2[e], (h,)

    def backward(self, d_out, xs, kept, offs, w13, b13, w2, b2):
        """Four grouped GEMMs and the activation's own vjp on the kept ``h`` (elementwise)."""
        (h,) = kept
        e = expert_of_rows(offs, xs.shape[0])
        a, act_vjp = torch.func.vjp(self._act, h)                               # [R, F]
        (dh,) = act_vjp(grouped_mm_now(d_out, w2.transpose(1, 2), offs))        # [R, 2F]
        dxs = grouped_mm_now(dh, w13.transpose(1, 2), offs)
        dw13, dw2 = grouped_mm_now(xs.t(), dh, offs), grouped_mm_now(a.t(), d_out, offs)
        return dxs, dw13, _segment_sum(dh, e, w13.shape[0]), dw2, _segment_sum(d_out, e, w13.shape[0])

    def kept_width(self, first) -> int:
        return _shape(first)[2]                                                 # h: [R, 2F]

    def flops_per_row(self, first) -> float:
        _, D, F2 = _shape(first)                                                # w13 [E, D, 2F]
        return 2.0 * D * F2 + 2.0 * (F2 // 2) * D


SWIGLU = SwiGLU()
"""The default experts' feed-forward."""

_KINDS = {k.name: k for k in (SwiGLU, ClampedSwiGLU)}


def ffn_from(name: str, args) -> ExpertFFN:
    """The FFN ``name`` with settings ``args`` (what the exchange op carries).

        ffn_from("clamped_swiglu", [7.0, 1.702])   # ClampedSwiGLU(limit=7.0, alpha=1.702)
    """
    if name not in _KINDS:
        raise ValueError(f"unknown expert feed-forward {name!r}; known: {', '.join(sorted(_KINDS))}")
    return _KINDS[name](*args)
