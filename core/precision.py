"""Mixed precision as a policy of dtypes, in the spirit of JAX's jmp and FSDP2's MixedPrecisionPolicy.

A :class:`Policy` names four dtypes: ``param_dtype`` (what the state keeps: the master weights and
the optimizer state), ``compute_dtype`` (what the function computes in: parameters are cast to it
at the start), ``output_dtype`` (what the function's floating-point outputs are cast back to: the
loss) and ``reduce_dtype`` (what gradient sums travel in between ranks). The models compute
norms' statistics, softmax, router scores and the loss in float32 whatever their inputs' dtype.

    policy = get_policy("bf16")                     # fp32 params and state, bf16 compute, fp32 reduce
    loss = with_policy(model.loss, policy)(params, batch, cfg)   # params cast on the way in

Under ``sf.jit`` the cast is an element-wise op on each stored shard, so a fully-sharded
parameter is cast before it is gathered and the all-gather moves ``compute_dtype`` bytes; its
gradient comes back through the cast in ``param_dtype``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardfn.core.pytree import tree_map

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The names a config uses -> torch dtypes."""

PRECISIONS = ("fp32", "bf16")
"""``train.precision`` values: ``fp32`` everything float32; ``bf16`` float32 state, bfloat16 compute."""


@dataclass(frozen=True)
class Policy:
    """The dtypes of a mixed-precision computation (see the module docstring).

    Example:
        Policy(compute_dtype=torch.bfloat16).cast_to_compute({"w": torch.ones(2)})["w"].dtype  # bfloat16
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        """Whether the computation runs in another dtype than the state."""
        return self.compute_dtype != self.param_dtype

    def cast_to_compute(self, tree: Any) -> Any:
        """Floating-point leaves of ``tree`` in ``compute_dtype`` (others as they are)."""
        return _cast(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Floating-point leaves of ``tree`` in ``param_dtype``."""
        return _cast(tree, self.param_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Floating-point leaves of ``tree`` in ``output_dtype``."""
        return _cast(tree, self.output_dtype)

    def cast_to_reduce(self, tree: Any) -> Any:
        """Floating-point leaves of ``tree`` in ``reduce_dtype``."""
        return _cast(tree, self.reduce_dtype)


def get_policy(precision: str = "fp32", reduce_dtype: str = "fp32") -> Policy:
    """The policy of a config's ``train.precision`` and ``train.reduce_dtype``.

    Raises:
        ValueError: naming the key for an unknown value, with the valid ones.

    Example:
        get_policy("bf16").compute_dtype  # torch.bfloat16
    """
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision: {precision!r} is not a precision; use one of {', '.join(PRECISIONS)}")
    if reduce_dtype not in DTYPES:
        raise ValueError(f"train.reduce_dtype: {reduce_dtype!r} is not a dtype name; use one of {', '.join(DTYPES)}")
    compute = DTYPES["bf16"] if precision == "bf16" else torch.float32
    return Policy(torch.float32, compute, torch.float32, DTYPES[reduce_dtype])


def with_policy(fn: Callable, policy: Policy, argnums: int | tuple[int, ...] = 0) -> Callable:
    """``fn`` computing in ``policy.compute_dtype``: the arguments at ``argnums`` (the parameters)
    are cast to it on the way in, floating-point outputs to ``output_dtype`` on the way out.
    Differentiating the result gives gradients in the arguments' own dtype.

    Example:
        loss_bf16 = with_policy(model.loss, get_policy("bf16"))
        loss, grads = value_and_grad(loss_bf16)(params, batch, cfg)   # grads float32, like params
    """
    if not policy.mixed:
        return fn
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fn)
    def cast_fn(*args, **kwargs):
        args = tuple(policy.cast_to_compute(a) if i in nums else a for i, a in enumerate(args))
        return policy.cast_to_output(fn(*args, **kwargs))

    return cast_fn


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
