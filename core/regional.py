"""Regional compilation: a model's repeated layer compiled once, and every layer runs it.

A model marks the function one layer runs with :func:`repeated`; the training step marks its
optimizer update with :func:`region`. Outside :func:`compiled_layers` the marks do nothing.
Inside it, run eagerly (``core.transforms.eager``), each marked function is ``torch.compile``'d
on its first call and that compiled function serves every later call. The layers of a stacked
model have the same shapes, so one compilation (forward and backward) serves them all. The first
step then costs about one layer's compilation and the update's, whatever the depth, where
compiling the whole step unrolls every layer into one graph. The rest of the step (embedding,
loss) runs eagerly.

Traced (``make_fx``, the partitioner, ``torch.compile`` of a whole step) or inside a ``torch.func``
transform, a marked function is the plain function, so traced graphs are unchanged.

    @repeated
    def block(p, h, cos, sin, cfg): ...

    with compiled_layers():
        params, opt_state, metrics = train_step(params, opt_state, batch)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator

import torch

from shardfn.core.transforms import eager

_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("shardfn_compiled_layers", default=None)


def repeated(fn: Callable) -> Callable:
    """Mark ``fn`` as the function every layer of a model runs (see the module docstring).

    Example:
        @repeated
        def block(p, h, cos, sin, cfg): ...
    """
    layer = region(fn)
    layer.repeated = True
    return layer


def region(fn: Callable) -> Callable:
    """Mark ``fn`` to run compiled inside :func:`compiled_layers` (compiled on its first call
    there, once per set of options); elsewhere it is ``fn``.

    Example:
        @region
        def update(grads, opt_state, params): ...
    """
    compiled: dict = {}  # options -> the compiled fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():  # inside a compiled step: the plain function, no lookup to trace
            return fn(*args, **kwargs)
        options = _OPTIONS.get()
        if options is None or not eager():
            return fn(*args, **kwargs)
        hit = compiled.get(options)
        if hit is None:
            hit = compiled[options] = torch.compile(fn, **dict(options))
        return hit(*args, **kwargs)

    return run


@contextlib.contextmanager
def compiled_layers(backend: str = "inductor", **options) -> Iterator[None]:
    """While active, functions marked :func:`repeated` run compiled (``torch.compile(fn,
    backend=backend, **options)``, once per function and options).

    Example:
        with compiled_layers():
            loss, grads = value_and_grad(llama.loss)(params, batch, cfg)
    """
    token = _OPTIONS.set(tuple(sorted({"backend": backend, **options}.items())))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def with_compiled_layers(fn: Callable, **options) -> Callable:
    """``fn`` run inside :func:`compiled_layers` (``options`` passed on).

    Example:
        step = with_compiled_layers(make_train_step(llama, cfg.model, opt))
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with compiled_layers(**options):
            return fn(*args, **kwargs)

    return run
