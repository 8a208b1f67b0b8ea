"""The repeated layer of a model that marks none: the function its loss calls once per layer.

``train.compile`` compiles the function a model marks ``core.regional.repeated``. A model that
marks none still usually has one: a function of its module that the loss calls once per layer
of a stack, with that layer's parameters (a slice of the stack) as its first argument. It is
found by running the loss once on fake tensors (no storage, nothing computed) and watching the
calls; the outermost such function is the layer (``mixture(p, ...)`` inside ``block(p, ...)``
takes the layer's parameters too, but runs inside it).

    found = find_layer_fns(models.get("mymodel.py"), cfg)   # {"block": <function block>}
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from typing import Any, Callable

import torch

from shardfn.core import _torch_private as private
from shardfn.core.pytree import flatten_with_paths

PROBE_TOKENS = 8
"""Tokens of the one fake sequence the loss runs on while the calls are watched."""


def _layer_paths(stack: Any) -> tuple:
    """The leaf paths and shapes of one layer of a stacked tree (every leaf ``[n, ...]``)."""
    return tuple(sorted((p, tuple(t.shape[1:])) for p, t in flatten_with_paths(stack)))


def _paths(tree: Any) -> tuple | None:
    if not isinstance(tree, dict):
        return None
    leaves = flatten_with_paths(tree)
    if not leaves or not all(isinstance(t, torch.Tensor) for _, t in leaves):
        return None
    return tuple(sorted((p, tuple(t.shape)) for p, t in leaves))


def layer_calls(model, cfg) -> tuple[dict[str, int], dict[str, int], Exception | None]:
    """``(calls, stacks, error)``: how often the loss called each function of the model's module
    at the outermost level with one layer of a stack as its first argument, the stacks' layer
    counts, and the error that stopped the fake run early (None when it ran through).

    Example:
        layer_calls(models.get("examples/models/qwen_moe.py"), cfg)   # ({"block": 2}, {"layers": 2}, None)
    """
    module = model.module
    functions = {f.__code__: name for name, f in vars(module).items()
                 if inspect.isfunction(f) and f.__module__ == module.__name__}
    stacks = dict(model.stacks(cfg))
    with private.fake_mode():
        params = model.init(cfg, 0)
        tokens = torch.zeros((1, PROBE_TOKENS), dtype=torch.int64)
        batch = {"inputs": tokens, "targets": tokens.clone()}
    layer_shapes = {_layer_paths(params[key]): key for key in stacks if key in params}
    calls: Counter = Counter()
    inside: list = []

    def watch(frame, event, _arg):
        name = functions.get(frame.f_code)
        if name is None:
            return
        if event == "call":
            args = frame.f_code.co_varnames[:frame.f_code.co_argcount]
            if args and not inside and _paths(frame.f_locals.get(args[0])) in layer_shapes:
                calls[name] += 1
                inside.append(frame)
        elif event == "return" and inside and inside[-1] is frame:
            inside.pop()

    error = None
    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        with private.fake_mode(), torch.no_grad():
            model.loss(params, batch, cfg)
    except Exception as e:  # noqa: BLE001 -- a loss that fake tensors cannot run: what was seen stands
        error = e
    finally:
        sys.setprofile(previous)
    return dict(calls), stacks, error


def find_layer_fns(model, cfg) -> dict[str, Callable]:
    """``name -> function`` of the module functions the loss calls once per layer of a stack,
    each with that layer's parameters first (the outermost such call). Empty when the layers
    run inline in the loss.

    Example:
        find_layer_fns(models.get("examples/models/qwen_moe.py"), cfg)   # {"block": <function block>}
    """
    calls, stacks, _ = layer_calls(model, cfg)
    counts = set(stacks.values())
    return {name: getattr(model.module, name) for name, n in calls.items() if n in counts}


def mark_found_layers(model, cfg) -> dict[str, Callable]:
    """Mark the layer functions :func:`find_layer_fns` finds ``core.regional.repeated`` in the
    model's module (the module attribute becomes the marked function, which is the plain one
    outside ``compiled_layers``), when the module marks none itself; returns what it marked.

    Example:
        mark_found_layers(models.get("examples/models/qwen_moe.py"), cfg)   # {"block": <function block>}
    """
    from shardfn.core.regional import repeated

    if model.compiled_layer_fns():
        return {}
    found = find_layer_fns(model, cfg)
    for name, fn in found.items():
        setattr(model.module, name, repeated(fn))
    return found


def unmarked_layers_line(model, cfg) -> str:
    """What ``train.compile`` does with a model that marks no layer function, as one line: the
    functions it found and compiles, or, when the layers run inline, what to write instead.

    Example:
        unmarked_layers_line(models.get("tests/tiny_dense.py"), cfg)   # "compiling no model layer: ..."
    """
    found = find_layer_fns(model, cfg)
    stacks = ", ".join(f"params[{k!r}] ({n} layers)" for k, n in model.stacks(cfg))
    if found:
        names = ", ".join(sorted(found))
        return (f"compiling one layer, which every layer then runs (train.compile): {names}, found unmarked as the "
                f"function the loss calls once per layer of {stacks}")
    return (f"compiling no model layer: model {model.name!r} marks no function with "
            f"shardfn.core.regional.repeated, and no function of its module takes one layer of {stacks} "
            f"as its first argument (its layers run inline in the loss), so only the optimizer update runs "
            f"compiled; put one layer's code in a function called once per layer, e.g. "
            f"`h = block(p, h, ...)` for each p in core.layers.unstack(...), and mark it @repeated, or set "
            f"train.compile=whole (train.compile)")
