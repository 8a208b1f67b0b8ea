"""A custom op made differentiable in the form ``torch.func`` transforms accept: one helper for
every op shardfn (or a user) registers with its own backward.

    positional_attention_fn = register_autograd(positional_attention_op, backward, setup_context=setup)
    loss, grads = value_and_grad(lambda q: positional_attention_fn(q, k, v, pos, pos, 0.25).sum())(q)
"""

from __future__ import annotations

import torch


def register_autograd(op, backward, *, setup_context=None):
    """``op.register_autograd(backward, setup_context=...)``, and a function calling ``op`` that
    ``torch.func`` transforms (``grad``, ``vmap``; ``value_and_grad`` wherever it takes
    ``torch.func``'s gradient) can differentiate. A ``torch.library.custom_op``'s own autograd
    has no ``setup_context`` that functorch accepts ("must override the setup_context
    staticmethod"): call the returned function in code that is traced or transformed; the op
    itself stays usable with plain autograd.

    ``backward(ctx, *grads)`` returns one gradient per input of ``op`` (None for non-tensors);
    ``setup_context(ctx, inputs, output)`` saves what it needs, as for ``register_autograd``.
    Both see the op's own arguments, as the op's generated autograd passes them: a list of
    tensors is one input (its gradient a list, or None), and an op that returns a list of
    tensors returns a list and gets its cotangents as one list.
    Under ``sf.jit`` the op still needs a sharding rule (``docs/partitioner.md``).

    Example:
        scaled_tanh_fn = sf.register_autograd(scaled_tanh, backward, setup_context=setup_context)
        loss, grads = value_and_grad(lambda w, x: scaled_tanh_fn(x @ w, 2.0).sum())(w, x)
    """
    from shardfn.core._torch_private import returns_tensor_list

    op.register_autograd(backward, setup_context=setup_context)
    name = getattr(op, "_name", None) or getattr(op, "__name__", "op")
    list_out = returns_tensor_list(op)

    # The Function takes each list of tensors spread out (autograd sees only top-level tensors),
    # and last the layout that gathers them back (_spread_lists).
    def forward(*flat):
        out = op(*_gather_lists(flat[:-1], flat[-1]))
        return tuple(out) if list_out else out

    def setup(ctx, inputs, output):
        ctx.sf_layout = inputs[-1]
        if setup_context is not None:
            setup_context(ctx, _gather_lists(inputs[:-1], inputs[-1]), list(output) if list_out else output)

    def run_backward(ctx, *grads):
        layout, needs = ctx.sf_layout, ctx.needs_input_grad
        ctx.needs_input_grad = _gather_lists(needs[:-1], layout)
        try:
            out = backward(ctx, list(grads)) if list_out else backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        if not isinstance(out, tuple):
            out = tuple(out) if isinstance(out, list) and all(n is None for n in layout) else (out,)
        flat = []
        for g, n in zip(out, layout, strict=True):
            flat.extend([g] if n is None else [None] * n if g is None else g)
        return (*flat, None)

    fn_class = type(f"{str(name).replace('::', '_')}_autograd", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup),
        "backward": staticmethod(run_backward)})

    def call(*args):
        flat, layout = _spread_lists(args)
        out = fn_class.apply(*flat, layout)
        return list(out) if list_out else out

    call.__name__ = str(name).split("::")[-1]
    call.__doc__ = f"``{name}`` with its registered backward, differentiable under torch.func transforms."
    return call


def _spread_lists(args: tuple) -> tuple[list, tuple]:
    """``args`` with each list of tensors spread out, and the layout that gathers them back: per
    argument, None (taken as it is) or the length of its list."""
    flat, layout = [], []
    for a in args:
        if isinstance(a, list) and all(isinstance(t, torch.Tensor) for t in a):
            flat.extend(a)
            layout.append(len(a))
        else:
            flat.append(a)
            layout.append(None)
    return flat, tuple(layout)


def _gather_lists(flat, layout: tuple) -> tuple:
    """The arguments :func:`_spread_lists` spread out, their lists gathered back."""
    out, i = [], 0
    for n in layout:
        out.append(flat[i] if n is None else list(flat[i:i + n]))
        i += 1 if n is None else n
    return tuple(out)
