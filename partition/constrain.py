"""Markers that user code places inside a traced function.

``constrain(x, P(...))`` is a strict sharding constraint (JAX's ``with_sharding_constraint``):
propagation redistributes ``x`` to exactly that spec, and its cotangent to the same spec.
``pipeline_split(x)`` marks a pipeline stage boundary. Outside ``sf.jit`` tracing both are the
identity, so the same code runs on one device unchanged.

    h = sf.constrain(h, P("dp", None, "tp"))
    h = sf.pipeline_split(h)
"""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any

import torch

from shardfn.core.custom_ops import register_autograd
from shardfn.partition.spec import P

_state = threading.local()


def tracing() -> bool:
    """True while ``sf.jit`` traces a function (markers become graph nodes)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def tracing_scope():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def encode_spec(spec: P) -> str:
    return json.dumps([list(e) if isinstance(e, tuple) else e for e in spec])


def decode_spec(text: str) -> P:
    return P(*[tuple(e) if isinstance(e, list) else e for e in json.loads(text)])


@torch.library.custom_op("shardfn::constrain", mutates_args=())
def _constrain(x: torch.Tensor, spec: str) -> torch.Tensor:
    return x.clone()


@_constrain.register_fake
def _(x, spec):
    return torch.empty_like(x)


def _constrain_setup(ctx, inputs, output):
    ctx.spec = inputs[1]


def _constrain_backward(ctx, grad):
    return _constrain_fn(grad, ctx.spec), None  # the same constraint on the cotangent


_constrain_fn = register_autograd(_constrain, _constrain_backward, setup_context=_constrain_setup)
"""The op with its backward, in the form torch.func transforms accept."""


def constrain(x: Any, spec: Any) -> Any:
    """Constrain the sharding of ``x`` (a tensor or pytree of tensors) to ``spec``.

    ``spec`` is a ``P`` or a pytree of ``P`` matching ``x``. Identity outside ``sf.jit``.

        h = constrain(h, P("dp", None, "tp"))
    """
    import optree

    from shardfn.partition.spec import broadcast_specs

    if isinstance(spec, str):  # a bare axis name would be read letter by letter
        raise TypeError(f"sf.constrain: a spec is a P(...) or a pytree of them, got the string {spec!r}; "
                        f"write P({spec!r})")
    if not tracing():
        return x
    leaves, treedef = optree.tree_flatten(x, none_is_leaf=False)
    specs = broadcast_specs(spec, x, what="constrain spec")
    out = [_constrain_fn(leaf, encode_spec(s)) for leaf, s in zip(leaves, specs)]
    return optree.tree_unflatten(treedef, out)


@torch.library.custom_op("shardfn::pipeline_split", mutates_args=())
def _pipeline_split(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_pipeline_split.register_fake
def _(x):
    return torch.empty_like(x)


def _pipeline_split_backward(ctx, grad):
    return _pipeline_split_fn(grad)  # a boundary for the cotangent too


_pipeline_split_fn = register_autograd(_pipeline_split, _pipeline_split_backward)


def pipeline_split(x: torch.Tensor) -> torch.Tensor:
    """Mark a pipeline stage boundary after ``x``. Identity outside ``sf.jit``.

        h = pipeline_split(h)
    """
    return _pipeline_split_fn(x) if tracing() else x
