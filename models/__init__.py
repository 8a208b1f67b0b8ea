"""Pure-function models, their registry and the one resolver every command uses.

A model is a Python module that follows the contract of ``models.contract`` (docs/models.md):
``Config``, ``param_table(cfg)`` and ``loss(params, batch, cfg)``; everything else has a default.
A run config names it by ``model.name``, which :func:`get` resolves, in this order:

1. a registered name: ``llama``, ``moe``, or one added with :func:`register`;
2. a path to a ``.py`` file (``model.name=examples/models/qwen_moe.py``), imported as a module
   named after the file, with its folder put on ``sys.path`` (so spawned ranks import it too);
3. a dotted module path (``model.name=mypkg.mymodel``), imported with ``importlib``.

    from shardfn import models
    llama = models.get("llama")                 # a models.contract.Model over shardfn.models.llama
    cfg = llama.Config.from_dict({"dim": 64, "n_layers": 2})
    params = llama.init(cfg, seed=0)
    models.register("mymodel", "mypkg.mymodel")  # then model.name=mymodel, on every rank

This module also holds the small helpers the models' ``Config`` classes share: building a frozen
dataclass from a dict with type checks, and range checks whose errors name the key
(``model.n_heads``).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import types
from pathlib import Path

from shardfn.models.contract import Model, ModelError, check, config_from_dict

REGISTRY: dict[str, str] = {
    "llama": "shardfn.models.llama",  # Llama-3 dense transformer
    "moe": "shardfn.models.moe",      # DeepSeek-V3 / Kimi-K2 MoE transformer
    "qwen3": "shardfn.models.qwen3",          # Qwen3 dense (QK-norm)
    "qwen2": "shardfn.models.qwen2",          # Qwen2 / Qwen2.5 (q/k/v biases)
    "mistral": "shardfn.models.mistral",      # Mistral (sliding-window attention)
    "qwen3_moe": "shardfn.models.qwen3_moe",  # Qwen3-MoE (softmax top-k, no shared experts)
    "mixtral": "shardfn.models.mixtral",      # Mixtral (softmax top-2, renormalised)
    "qwen2_moe": "shardfn.models.qwen2_moe",  # Qwen2-MoE (shared expert with a sigmoid gate)
    "gpt_oss": "shardfn.models.gpt_oss",      # gpt-oss (attention sinks, alternating windows, clamped SwiGLU)
}
"""Model name (the ``model.name`` of a config) -> a dotted module path or a ``.py`` file."""

REGISTRY_ENV = "SHARDFN_MODELS"
"""Environment variable holding the names added with :func:`register` (JSON ``name -> module``),
so that ranks spawned from this process resolve them too."""


def register(name: str, module: types.ModuleType | str) -> None:
    """Make ``model.name=<name>`` resolve to ``module`` here and in the ranks this process spawns.

    Args:
        name: the name a run config gives (``model.name``).
        module: a module object, a dotted module path or a ``.py`` file path.

    Example:
        models.register("tiny_qwen", "examples/models/qwen_moe.py")
        models.get("tiny_qwen").param_counts(models.get("tiny_qwen").Config())
    """
    if isinstance(module, types.ModuleType):
        spec = module.__name__
        if spec == "__main__" or spec not in sys.modules:
            spec = getattr(module, "__file__", None) or spec
    elif isinstance(module, str):
        spec = module
    else:
        raise TypeError(f"models.register({name!r}, ...): module must be a module, a dotted path or a .py file, "
                        f"got {type(module).__name__}")
    if isinstance(spec, str) and spec.endswith(".py"):
        spec = str(Path(spec).resolve())
    REGISTRY[name] = spec
    extra = _env_registry()
    extra[name] = spec
    os.environ[REGISTRY_ENV] = json.dumps(extra)
    _resolve.cache_clear()


def _env_registry() -> dict[str, str]:
    try:
        value = json.loads(os.environ.get(REGISTRY_ENV, "") or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def get(name: str | types.ModuleType | Model) -> Model:
    """The model ``name`` resolves to (see the module docstring), seen through the contract.

    Accepts a :class:`~shardfn.models.contract.Model` (returned as is) or a module (wrapped), so
    every function that takes a model may call it on its argument.

    Raises:
        ValueError: for a name that resolves to nothing; the message says what was tried.

    Example:
        models.get("llama").param_counts(models.get("llama").Config())
    """
    if isinstance(name, Model):
        return name
    if isinstance(name, types.ModuleType):
        return Model(name, name.__name__.rsplit(".", 1)[-1], name.__name__)
    if not isinstance(name, str):
        raise TypeError(f"a model is a name, a module or a models.Model, got {type(name).__name__}")
    return _resolve(name)


@functools.lru_cache(maxsize=None)
def _resolve(name: str) -> Model:
    registry = {**_env_registry(), **REGISTRY}
    tried = []
    spec = registry.get(name)
    if spec is not None:
        return Model(_import(spec, name), name, spec)
    tried.append("a registered name")
    if name.endswith(".py"):
        path = Path(name).expanduser()
        if path.is_file():
            return Model(_import(str(path.resolve()), name), name, str(path))
        tried.append(f"a .py file (no file {path.resolve()})")
    elif name.replace(".", "").replace("_", "").isalnum() and "." in name:
        try:
            return Model(importlib.import_module(name), name, name)
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):
                raise  # the module exists; something it imports does not
            tried.append(f"a module path (no module named {e.name!r})")
    else:
        tried.append("a .py file or a dotted module path (it is neither)")
    names = [*REGISTRY, *(n for n in registry if n not in REGISTRY)]   # the built-in families first
    raise ValueError(f"unknown model {name!r}; valid models: {', '.join(names)}, a dotted module path "
                     f"(mypkg.mymodel) or a .py file; tried {', '.join(tried)}. A library user may also call "
                     f"shardfn.models.register(name, module)")


def _import(spec: str, name: str) -> types.ModuleType:
    """Import a dotted module path, or a ``.py`` file as the module named after its file (its
    folder first on ``sys.path``, which spawned ranks inherit)."""
    if not spec.endswith(".py"):
        return importlib.import_module(spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"model {name!r}: its file {spec} does not exist")
    folder, stem = str(path.parent), path.stem
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.import_module(stem)
    if Path(getattr(module, "__file__", "") or "").resolve() != path.resolve():
        raise ValueError(f"model {name!r}: importing {path} as {stem!r} found another module "
                         f"({module.__file__}); rename the file")
    return module


__all__ = ["REGISTRY", "Model", "ModelError", "register", "get", "check", "config_from_dict"]
