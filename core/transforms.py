"""Function transforms over pytrees, in JAX's calling convention, on top of ``torch.func``.

``torch.func.grad_and_value`` returns ``(grad, value)``; JAX users expect ``(value, grad)``.
These wrappers use JAX's order and argument names, accept any pytree of tensors (nested dicts,
tuples, NamedTuples) as the differentiated arguments, and stay traceable by ``make_fx`` and
``torch.compile``.

    loss, grads = value_and_grad(model.loss)(params, batch, cfg)
    (loss, aux), grads = value_and_grad(loss_and_aux, has_aux=True)(params, batch, cfg)

Where nothing composes with the gradient (no ``torch.func`` transform around the call, not
inside ``torch.compile``, and no argument leaf that already requires grad), :func:`value_and_grad`
takes it with plain ``torch.autograd.grad`` on fresh leaves (``detach().requires_grad_()``)
instead: the same function of the same inputs. Eagerly that saves the transform's per-op
wrapping (half again the time of a small model's eager forward and backward). Under ``make_fx``
(the partitioner's trace) it records autograd's own backward kernels, as AOTAutograd's joint
graphs do, where ``torch.func`` (whose gradients must stay differentiable) records the
differentiable forms of some: ``silu``'s backward as eight ops on full-size tensors instead of
``silu_backward``. Inside a transform or ``torch.compile``, and for :func:`grad`, it is
``torch.func``'s, which composes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Union

import torch
import torch.func

from shardfn.core.pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

ArgNums = Union[int, Sequence[int]]


def eager() -> bool:
    """True when ops run one by one on their kernels: not under ``torch.compile`` or ``make_fx``
    (or any other dispatch mode, such as ``FakeTensorMode``), and inside no ``torch.func``
    transform. Code that has a faster eager form (plain autograd, ``torch._foreach_*`` kernels,
    cached tables) takes it only then, so traced graphs keep their usual form.

    Example:
        eager()                                # True at the top level
        torch.func.vmap(lambda x: eager())(x)  # False: inside a transform
    """
    if torch.compiler.is_compiling():
        return False
    from shardfn.core._torch_private import ops_intercepted

    return not ops_intercepted()


def _check_argnums(argnums: ArgNums) -> int | tuple[int, ...]:
    if isinstance(argnums, int):
        return argnums
    argnums = tuple(argnums)
    if not argnums or not all(isinstance(a, int) for a in argnums):
        raise TypeError(f"argnums must be an int or a non-empty sequence of ints, got {argnums!r}")
    return argnums


def _plain_autograd(args: tuple, argnums: int | tuple[int, ...]) -> bool:
    """Take the gradient with ``torch.autograd.grad``: nothing composes with it (see the module
    docstring). An argument leaf that requires grad belongs to an outer autograd graph, which
    only ``torch.func`` keeps (its gradients are themselves differentiable)."""
    from shardfn.core._torch_private import transforms_active

    if torch.compiler.is_compiling() or transforms_active():
        return False
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if any(not -len(args) <= i < len(args) for i in nums):
        return False  # torch.func reports the bad index
    differentiated = tree_leaves([args[i] for i in nums])
    if not all(isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) for x in differentiated):
        return False  # torch.func reports what cannot be differentiated
    return not any(isinstance(x, torch.Tensor) and x.requires_grad for x in tree_leaves(args))


def _value_and_grad_autograd(fn: Callable, argnums: int | tuple[int, ...], has_aux: bool,
                             args: tuple, kwargs: dict):
    """``torch.func.grad_and_value``'s result, ``(grads, value)``, from ``torch.autograd.grad``
    on detached copies of the differentiated arguments' leaves (no copy of the data)."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    args = list(args)
    inputs, treedefs = [], []
    for i in nums:
        leaves, treedef = tree_flatten(args[i])
        leaves = [x.detach().requires_grad_() for x in leaves]
        args[i] = tree_unflatten(treedef, leaves)
        inputs.append(leaves)
        treedefs.append(treedef)
    with torch.enable_grad():  # like torch.func.grad, which ignores an outer no_grad
        out = fn(*args, **kwargs)
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise RuntimeError("value_and_grad(f, has_aux=True): f must return a (value, aux) tuple")
        value, aux = out
    else:
        value, aux = out, None
    if not isinstance(value, torch.Tensor) or value.ndim != 0:
        got = f"a tensor with {value.ndim} dims" if isinstance(value, torch.Tensor) else type(value).__name__
        raise RuntimeError(f"value_and_grad(f): f must return a scalar (0-d) tensor, got {got}")
    flat = [x for leaves in inputs for x in leaves]
    if value.requires_grad:
        grads = torch.autograd.grad(value, flat, allow_unused=True, materialize_grads=True)
    else:  # the value does not depend on the arguments
        grads = [torch.zeros_like(x) for x in flat]
    out_grads, k = [], 0
    for leaves, treedef in zip(inputs, treedefs):
        out_grads.append(tree_unflatten(treedef, list(grads[k:k + len(leaves)])))
        k += len(leaves)
    grads = out_grads[0] if isinstance(argnums, int) else tuple(out_grads)
    value = value.detach()
    if has_aux:
        aux = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)
        return grads, (value, aux)
    return grads, value


def value_and_grad(fn: Callable, argnums: ArgNums = 0, has_aux: bool = False) -> Callable:
    """``fn``'s value and its gradient with respect to the arguments at ``argnums``.

    With nothing composing (no ``torch.func`` transform around the call, not under
    ``torch.compile``, and no argument leaf requiring grad), eagerly or under ``make_fx``, the
    gradient is taken by ``torch.autograd.grad`` on fresh leaves; otherwise it is
    ``torch.func.grad_and_value``. Both compute the same function of the same inputs; their
    backward kernels may differ in float rounding (``torch.func`` decomposes some, e.g. ``silu``'s).

    Args:
        fn: a function returning a 0-d tensor, or ``(0-d tensor, aux)`` when ``has_aux``.
        argnums: which positional argument(s) to differentiate; each may be any pytree of
            floating-point tensors. A tuple gives a tuple of gradients.
        has_aux: ``fn`` returns ``(value, aux)``; ``aux`` (a pytree of tensors, as
            ``torch.func`` requires) is passed through undifferentiated.

    Returns:
        A function with ``fn``'s signature returning ``(value, grads)``, or
        ``((value, aux), grads)`` with ``has_aux``; ``grads`` mirrors the differentiated argument(s)
        (zeros where ``fn`` does not depend on a leaf). ``value`` and ``aux`` carry no graph.

    Example:
        loss, grads = value_and_grad(lambda p, x: ((x @ p["w"]) ** 2).sum())(params, x)
        grads["w"].shape == params["w"].shape  # True
    """
    argnums = _check_argnums(argnums)
    grad_and_value = torch.func.grad_and_value(fn, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any):
        if _plain_autograd(args, argnums):
            grads, value = _value_and_grad_autograd(fn, argnums, has_aux, args, kwargs)
        else:
            grads, value = grad_and_value(*args, **kwargs)
        return value, grads

    return wrapped


def grad(fn: Callable, argnums: ArgNums = 0, has_aux: bool = False) -> Callable:
    """The gradient of ``fn`` with respect to the arguments at ``argnums``.

    Always ``torch.func.grad``: this is the form for composing (``vmap(grad(f))``, higher
    derivatives); a training step takes its gradient with :func:`value_and_grad`.

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


def autograd_vjp(fn: Callable, primals: Sequence[torch.Tensor], cotangents: Any) -> tuple:
    """``fn``'s input cotangents at ``primals`` for its output cotangents, run now by plain
    ``torch.autograd`` on fresh leaves: autograd's own backward kernels, those a traced step's
    backward records (:func:`value_and_grad`), also inside a ``torch.library.custom_op``'s body,
    where the dispatcher has autograd off. ``fn`` returns a tensor (``cotangents`` a tensor) or a
    sequence of them (``cotangents`` one per output; outputs that do not depend on ``primals``,
    integer ones among them, are skipped). A primal nothing depends on gets zeros.

    Example:
        dx, dw = autograd_vjp(lambda x, w: x @ w, (x, w), dy)
    """
    from shardfn.core._torch_private import autograd_inside_custom_op

    leaves = [p.detach().requires_grad_() for p in primals]
    with autograd_inside_custom_op(), torch.enable_grad():
        out = fn(*leaves)
    many = isinstance(out, (list, tuple))
    pairs = [(o, c) for o, c in zip(out if many else [out], cotangents if many else [cotangents]) if o.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(x) for x in leaves)
    outs, cots = zip(*pairs)
    return torch.autograd.grad(outs, leaves, cots, allow_unused=True, materialize_grads=True)


def stop_gradient(tree: Any) -> Any:
    """``tree`` with every tensor leaf detached (``jax.lax.stop_gradient``).

    Example:
        target = stop_gradient(logits)  # no gradient flows through ``target``
    """
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)
