"""Pure-function models and their registry.

Each model module exposes ``Config``, ``init``, ``param_axes``, ``param_counts``, ``apply`` and
``loss`` (see docs/architecture.md); the MoE model also has ``loss_and_aux``.

    from shardfn import models
    llama = models.get("llama")
    cfg = llama.Config.from_dict({"dim": 64, "n_layers": 2})
    params = llama.init(cfg, seed=0)

This module also holds the small helpers the models' ``Config`` classes share: building a frozen
dataclass from a dict with type checks, and range checks whose errors name the key
(``model.n_heads``).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from typing import Any

REGISTRY: dict[str, str] = {
    "llama": "shardfn.models.llama",  # Llama-3 dense transformer
    "moe": "shardfn.models.moe",      # DeepSeek-V3 / Kimi-K2 MoE transformer
}
"""Model name (the ``model.name`` of a config) -> module."""


def get(name: str) -> types.ModuleType:
    """The model module registered as ``name``.

    Raises:
        ValueError: for an unknown name; the message lists the valid ones.

    Example:
        models.get("llama").param_counts(models.get("llama").Config())
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(REGISTRY[name])


# ----------------------------------------------------------------------------- config helpers


def check(ok: bool, key: str, message: str) -> None:
    """Raise ``ValueError("model.<key> ...")`` unless ``ok``.

    Example:
        check(cfg.dim % cfg.n_heads == 0, "n_heads", f"= {cfg.n_heads} must divide model.dim = {cfg.dim}")
    """
    if not ok:
        raise ValueError(f"model.{key} {message}")


def _type_ok(value: Any, hint: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def config_from_dict(cls: type, d: dict) -> Any:
    """``cls(**d)`` for a dataclass ``cls``, rejecting unknown keys and values of the wrong type.

    Raises:
        ValueError: naming the key (``model.<key>``) and, for an unknown key, listing valid keys.

    Example:
        cfg = config_from_dict(Config, {"dim": 64})
    """
    if not isinstance(d, dict):
        raise ValueError(f"the model section must be a mapping of Config fields, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            raise ValueError(f"unknown config key 'model.{key}'; valid keys: name, {', '.join(fields)}")
        hint = hints[key]
        if not _type_ok(value, hint):
            raise ValueError(f"model.{key} must be {hint.__name__}, got {type(value).__name__} {value!r}")
        kwargs[key] = float(value) if hint is float else value
    return cls(**kwargs)
