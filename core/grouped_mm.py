"""Grouped matrix multiply for dropless MoE: one GEMM per expert over contiguous row groups.

``grouped_mm(x, w, offs)`` multiplies rows ``offs[e-1]:offs[e]`` of ``x`` by ``w[e]``. It wraps
``torch._grouped_mm`` in a single custom op, ``torch.ops.shardfn.grouped_mm``, because the raw
kernel on this torch has three rough edges we hide here:

- its meta kernel only accepts bfloat16, so ``make_fx(tracing_mode="fake")`` and
  ``torch.compile`` fail on float32; our fake impl works for every float dtype;
- its autograd fails on expanded (stride-0) cotangents; our backward makes them contiguous;
- every non-unit stride must be a multiple of 16 bytes, i.e. the contraction and output dims
  must be multiples of ``16 // element_size`` (4 in float32, 8 in bfloat16); we check this up
  front and raise a ``ValueError`` that says which dim to change.

The op has two forms (the second is the weight gradient of the first):

    [T, K] x [E, K, N] -> [T, N]       rows of group e times w[e]
    [K, T] x [T, N]    -> [E, K, N]    out[e] = x[:, rows_e] @ y[rows_e]

Example:
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)       # expert 1 gets no tokens
    y = grouped_mm(torch.randn(8, 16), torch.randn(3, 16, 32), offs)  # [8, 32]
"""

from __future__ import annotations

import torch

from shardfn.core._torch_private import profiler_enabled
from shardfn.core.transforms import eager

__all__ = ["grouped_mm", "grouped_mm_now", "alignment"]


def alignment(dtype: torch.dtype) -> int:
    """The multiple that grouped-GEMM dims must be for ``dtype`` (16 bytes in elements).

    Example:
        alignment(torch.float32)   # 4
        alignment(torch.bfloat16)  # 8
    """
    a = _ALIGNMENT.get(dtype)
    if a is None:
        a = _ALIGNMENT[dtype] = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    return a


_ALIGNMENT: dict = {}


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group matmul: rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]``.

    Args:
        x: ``[T, K]`` rows sorted by group.
        w: ``[E, K, N]`` one matrix per group.
        offs: ``[E]`` int32 cumulative row counts (the end of each group); ``offs[-1] == T``.
            Equal neighbours mean an empty group, which is fine.

    Returns:
        ``[T, N]``. Differentiable in ``x`` and ``w`` (also twice), traceable with fake tensors.

    Raises:
        ValueError: on wrong ranks/dtypes, or when ``K``/``N`` are not multiples of
            :func:`alignment` for the dtype.

    Example:
        offs = torch.tensor([2, 5], dtype=torch.int32)
        grouped_mm(torch.randn(5, 8), torch.randn(2, 8, 4), offs).shape  # torch.Size([5, 4])
    """
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_mm expects x [T, K] and w [E, K, N]; got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(f"grouped_mm offs must be a 1-d int32 tensor of cumulative group ends; got "
                         f"{offs.dtype} {tuple(offs.shape)} (use torch.cumsum(counts, 0).to(torch.int32))")
    if offs.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_mm: offs has {offs.shape[0]} groups but w has {w.shape[0]} experts")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: x has K={x.shape[1]} but w has K={w.shape[1]} (w is [E, K, N])")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_mm: x is {x.dtype} but w is {w.dtype}; cast one of them")
    a = alignment(x.dtype)
    for name, size in (("K (x.shape[1], w.shape[1])", x.shape[1]), ("N (w.shape[2])", w.shape[2])):
        if size % a:
            raise ValueError(f"grouped_mm: {name} = {size} must be a multiple of {a} for {x.dtype} (16-byte "
                             f"alignment of the grouped GEMM); pad the expert dims, e.g. to {size + (-size) % a}")
    if eager():  # plain autograd on plain tensors: the kernel itself, with no op dispatch around it
        return _GroupedMMNow.apply(x, w, offs)
    return _GroupedMM.apply(x, w, offs)


def grouped_mm_now(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm`'s kernel called directly, in either form, with no checks, autograd or
    op dispatch around it: for code that runs eagerly where nothing records it (the body of an
    opaque op such as the expert-parallel exchange, which writes its own backward). Same
    shapes and alignment as :func:`grouped_mm`; the caller has checked them.

        out = grouped_mm_now(xs, w1, offs)          # [R, D] x [E, D, F] -> [R, F]
        dw1 = grouped_mm_now(xs.t(), d_h1, offs)    # [D, R] x [R, F] -> [E, D, F]
    """
    return torch._grouped_mm(_aligned(x), _aligned(w), offs=offs)


# ----------------------------------------------------------------------------- the op


def _strides_aligned(t: torch.Tensor) -> bool:
    # CUDA's kernel (TMA loads) also wants the start 16-byte aligned: a view at an odd offset is copied
    a = alignment(t.dtype)
    return t.storage_offset() % a == 0 and all(s % a == 0 for d, s in zip(t.shape, t.stride()) if s != 1 and d != 1)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # The kernel wants 16-byte strides and start; a fresh contiguous copy has them whenever the
    # inner dim is aligned (``contiguous()`` would hand back a contiguous view at an odd offset).
    return t if _strides_aligned(t) else t.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("shardfn::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    with torch.profiler.record_function("shardfn.grouped_mm"):
        return torch._grouped_mm(_aligned(x), _aligned(w), offs=offs)


@_grouped_mm_op.register_fake
def _(x, w, offs):
    if w.dim() == 3:                                         # [T, K] x [E, K, N] -> [T, N]
        return x.new_empty((x.shape[0], w.shape[2]))
    return x.new_empty((offs.shape[0], x.shape[0], w.shape[1]))  # [K, T] x [T, N] -> [E, K, N]


class _GroupedMM(torch.autograd.Function):
    """The op with its derivative, in the form ``torch.func`` transforms accept (``setup_context``).

    ``custom_op``'s own ``register_autograd`` is not usable under ``torch.func.grad`` on this
    torch, so the public function goes through this Function; the op also gets the same formula
    for plain ``torch.autograd`` callers of ``torch.ops.shardfn.grouped_mm``.
    """

    @staticmethod
    def forward(x, w, offs):
        return torch.ops.shardfn.grouped_mm(x, w, offs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, offs = inputs
        ctx.save_for_backward(x, w, offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()  # the kernel rejects expanded (stride-0) cotangents
        op = _GroupedMM.apply  # differentiable again, so higher-order grads work
        dx = dw = None
        if w.dim() == 3:
            # y[rows_e] = x[rows_e] @ w[e]:  dx = dy @ w[e]^T,  dw[e] = x[rows_e]^T @ dy[rows_e]
            if ctx.needs_input_grad[0]:
                dx = op(grad, w.transpose(1, 2), offs)           # [T, N] x [E, N, K] -> [T, K]
            if ctx.needs_input_grad[1]:
                dw = op(x.t(), grad, offs)                       # [K, T] x [T, N] -> [E, K, N]
        else:
            # out[e] = x[:, rows_e] @ y[rows_e]  (x [K, T], w = y [T, N], grad [E, K, N])
            if ctx.needs_input_grad[0]:
                dx = op(w, grad.transpose(1, 2), offs).t()       # [T, N] x [E, N, K] -> [T, K] -> [K, T]
            if ctx.needs_input_grad[1]:
                dw = op(x.t(), grad, offs)                       # [T, K] x [E, K, N] -> [T, N]
        return dx, dw, None


_grouped_mm_op.register_autograd(_GroupedMM.backward, setup_context=_GroupedMM.setup_context)


class _GroupedMMNow(torch.autograd.Function):
    """:class:`_GroupedMM` run eagerly: the kernel called directly (no custom-op dispatch, no
    profiler scope unless a profiler records), the same backward formulas. What
    :func:`grouped_mm` takes when nothing traces it (``core.transforms.eager``)."""

    @staticmethod
    def forward(ctx, x, w, offs):  # ctx here, no setup_context: apply then binds no signature per call
        ctx.save_for_backward(x, w, offs)
        if profiler_enabled():
            with torch.profiler.record_function("shardfn.grouped_mm"):
                return grouped_mm_now(x, w, offs)
        return grouped_mm_now(x, w, offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()  # the kernel rejects expanded (stride-0) cotangents
        op = _GroupedMMNow.apply  # differentiable again (create_graph), a plain call otherwise
        dx = dw = None
        if w.dim() == 3:
            if ctx.needs_input_grad[0]:
                dx = op(grad, w.transpose(1, 2), offs)
            if ctx.needs_input_grad[1]:
                dw = op(x.t(), grad, offs)
        else:
            if ctx.needs_input_grad[0]:
                dx = op(w, grad.transpose(1, 2), offs).t()
            if ctx.needs_input_grad[1]:
                dw = op(x.t(), grad, offs)
        return dx, dw, None
