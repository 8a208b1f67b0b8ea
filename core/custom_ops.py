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
    Under ``sf.jit`` the op still needs a sharding rule (``docs/partitioner.md``).

    Example:
        scaled_tanh_fn = sf.register_autograd(scaled_tanh, backward, setup_context=setup_context)
        loss, grads = value_and_grad(lambda w, x: scaled_tanh_fn(x @ w, 2.0).sum())(w, x)
    """
    op.register_autograd(backward, setup_context=setup_context)
    name = getattr(op, "_name", None) or getattr(op, "__name__", "op")

    def forward(*args):
        return op(*args)

    def setup(ctx, inputs, output):
        if setup_context is not None:
            setup_context(ctx, inputs, output)

    def run_backward(ctx, *grads):
        out = backward(ctx, *grads)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    fn_class = type(f"{str(name).replace('::', '_')}_autograd", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup),
        "backward": staticmethod(run_backward)})

    def call(*args):
        return fn_class.apply(*args)

    call.__name__ = str(name).split("::")[-1]
    call.__doc__ = f"``{name}`` with its registered backward, differentiable under torch.func transforms."
    return call
