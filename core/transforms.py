"""Function transforms over pytrees, in JAX's calling convention, on top of ``torch.func``.

``torch.func.grad_and_value`` returns ``(grad, value)``; JAX users expect ``(value, grad)``.
These wrappers use JAX's order and argument names, accept any pytree of tensors (nested dicts,
tuples, NamedTuples) as the differentiated arguments, and stay traceable by ``make_fx`` and
``torch.compile``.

    loss, grads = value_and_grad(model.loss)(params, batch, cfg)
    (loss, aux), grads = value_and_grad(loss_and_aux, has_aux=True)(params, batch, cfg)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Union

import torch
import torch.func

from shardfn.core.pytree import tree_map

ArgNums = Union[int, Sequence[int]]


def _check_argnums(argnums: ArgNums) -> int | tuple[int, ...]:
    if isinstance(argnums, int):
        return argnums
    argnums = tuple(argnums)
    if not argnums or not all(isinstance(a, int) for a in argnums):
        raise TypeError(f"argnums must be an int or a non-empty sequence of ints, got {argnums!r}")
    return argnums


def value_and_grad(fn: Callable, argnums: ArgNums = 0, has_aux: bool = False) -> Callable:
    """``fn``'s value and its gradient with respect to the arguments at ``argnums``.

    Args:
        fn: a function returning a 0-d tensor, or ``(0-d tensor, aux)`` when ``has_aux``.
        argnums: which positional argument(s) to differentiate; each may be any pytree of
            floating-point tensors. A tuple gives a tuple of gradients.
        has_aux: ``fn`` returns ``(value, aux)``; ``aux`` (a pytree of tensors, as
            ``torch.func`` requires) is passed through undifferentiated.

    Returns:
        A function with ``fn``'s signature returning ``(value, grads)``, or
        ``((value, aux), grads)`` with ``has_aux``; ``grads`` mirrors the differentiated argument(s).

    Example:
        loss, grads = value_and_grad(lambda p, x: ((x @ p["w"]) ** 2).sum())(params, x)
        grads["w"].shape == params["w"].shape  # True
    """
    argnums = _check_argnums(argnums)
    grad_and_value = torch.func.grad_and_value(fn, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any):
        grads, value = grad_and_value(*args, **kwargs)
        return value, grads

    return wrapped


def grad(fn: Callable, argnums: ArgNums = 0, has_aux: bool = False) -> Callable:
    """The gradient of ``fn`` with respect to the arguments at ``argnums``.

    Args:
        fn: as in :func:`value_and_grad`.
        argnums: as in :func:`value_and_grad`.
        has_aux: ``fn`` returns ``(value, aux)``; the result is then ``(grads, aux)``.

    Returns:
        A function with ``fn``'s signature returning ``grads`` (or ``(grads, aux)``).

    Example:
        g = grad(lambda w: (w ** 2).sum())(torch.tensor([1.0, 2.0]))  # tensor([2., 4.])
    """
    return torch.func.grad(fn, argnums=_check_argnums(argnums), has_aux=has_aux)


def stop_gradient(tree: Any) -> Any:
    """``tree`` with every tensor leaf detached (``jax.lax.stop_gradient``).

    Example:
        target = stop_gradient(logits)  # no gradient flows through ``target``
    """
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)
