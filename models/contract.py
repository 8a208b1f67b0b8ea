"""The model contract: what a model module must define, and the defaults for everything else.

A model module is plain Python. Its required part is the math: a ``Config`` class, a parameter
table (``param_table(cfg)``: a tree of ``core.init.Param`` with a logical axis per dim) and a
loss (``loss(params, batch, cfg)`` or ``loss_and_aux``). Every other member the layers above
read is optional: :class:`Model` answers it from the module when the module defines it, and
otherwise derives it from the parameter table or returns the default that is right for a dense
decoder (docs/models.md lists every member and its type).

    model = Model(my_module, "my_model")
    model.param_axes(cfg)       # derived from my_module.param_table(cfg)
    model.stacks(cfg)           # [("layers", 4)]: the top-level subtrees stacked over "layers"

No parallelism here: the members describe the model; layouts decide how to split it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import types
import typing
from typing import Any, Callable

import torch

from shardfn.core.init import Param, axes_of, init_params
from shardfn.core.pytree import PyTree, flatten_with_paths

PARAM_AXES: tuple[str, ...] = (
    "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp",
    "expert", "expert_mlp", "q_lora", "kv_lora", "layers", "norm",
)
"""The logical axis names a parameter dim may carry (or None: never split)."""

REQUIRED: tuple[str, ...] = ("Config", "param_table")
"""Members every model module defines, besides one of ``loss`` / ``loss_and_aux``."""

OPTIONAL: tuple[str, ...] = (
    "init", "param_axes", "param_counts", "stacks", "with_layers", "layout_units", "active_fraction",
    "experts_per_token", "attention_shape", "kv_width", "FROZEN", "aux_update", "aux_metrics",
    "pipeline_refusal", "context_refusal", "READS_POSITIONS", "hf_tensors", "hf_config_keys",
    "HF_MODEL_TYPES", "HF_ARCHITECTURE",
)
"""Members with a default (:class:`Model` derives them when the module leaves them out)."""


class ModelError(ValueError):
    """A model module breaks the contract; the message names the module, the member and the fix."""


def _is_param(x) -> bool:
    return isinstance(x, Param)


def _leaves(table: PyTree) -> list[tuple[str, Param]]:
    return flatten_with_paths(table, is_leaf=_is_param)


def check_axes(table: PyTree, where: str) -> None:
    """Raise :class:`ModelError` for a logical axis name not in :data:`PARAM_AXES`, or a dim count
    that differs from the shape's.

    Example:
        check_axes({"wq": normal((4, 8), ("embed", "head"))}, "mymodel")   # ModelError: ... 'head' ...
    """
    for path, p in _leaves(table):
        if len(p.axes) != len(p.shape):
            raise ModelError(f"model {where}: parameter {path} has shape {list(p.shape)} but {len(p.axes)} logical "
                             f"axes {p.axes}; give one axis name (or None) per dim")
        for dim, axis in enumerate(p.axes):
            if axis is not None and axis not in PARAM_AXES:
                raise ModelError(f"model {where}: parameter {path} dim {dim} has unknown logical axis {axis!r}; "
                                 f"valid names: {', '.join(PARAM_AXES)} (or None)")


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def _axis_sizes(table: PyTree, axis: str) -> set[int]:
    return {p.shape[p.axes.index(axis)] for _, p in _leaves(table) if axis in p.axes}


class Model:
    """A model module seen through the contract: its own members where it defines them, the
    defaults (derived from its parameter table) where it does not. Any other attribute is the
    module's (``model.block``, ``model.Config``).

    Example:
        model = Model(importlib.import_module("shardfn.models.llama"), "llama")
        model.stacks(model.Config())   # [("layers", 2)]
    """

    def __init__(self, module: types.ModuleType, name: str, source: str | None = None):
        self.module, self.name, self.source = module, name, source or module.__name__
        missing = [m for m in REQUIRED if not hasattr(module, m)]
        if not (hasattr(module, "loss") or hasattr(module, "loss_and_aux")):
            missing.append("loss (or loss_and_aux)")
        if missing:
            raise ModelError(f"model {name!r} ({self.source}) does not define {', '.join(missing)}; a model module "
                             f"needs Config, param_table(cfg) and loss(params, batch, cfg) (docs/models.md)")

    def __repr__(self) -> str:
        return f"Model({self.name!r}, {self.source})"

    def __reduce__(self):  # spawned ranks import the same module again (its folder is on their sys.path)
        return _rebuild, (self.module.__name__, self.name, self.source)

    def __getattr__(self, attr: str) -> Any:
        if attr in ("__name__", "__file__"):
            return getattr(self.module, attr)
        if attr.startswith("__") or attr in ("module", "name", "source"):
            raise AttributeError(attr)
        if hasattr(self.module, attr):
            return getattr(self.module, attr)
        default = _DEFAULTS.get(attr)
        if default is None:
            raise AttributeError(f"model {self.name!r} ({self.source}) has no {attr!r}")
        return default(self)

    # ----------------------------------------------------------------- the table, checked once per call

    def table(self, cfg: Any) -> PyTree:
        """``param_table(cfg)`` with its logical axis names checked (:func:`check_axes`)."""
        table = self.module.param_table(cfg)
        check_axes(table, f"{self.name!r}")
        return table

    def has_axis(self, cfg: Any, axis: str) -> bool:
        """Whether any parameter has a dim on logical ``axis``.

        Example:
            models.get("moe").has_axis(cfg, "expert")   # True
        """
        return any(axis in p.axes for _, p in _leaves(self.table(cfg)))

    def layer_count(self, cfg: Any) -> int:
        """Layers in the network's sequence: the sum of :meth:`stacks`' counts.

        Example:
            models.get("llama").layer_count(Config(n_layers=4))   # 4
        """
        return sum(n for _, n in self.stacks(cfg))

    def embed_dim(self, cfg: Any) -> int:
        """The model width: the largest dim on the logical axis ``embed``."""
        return max(_axis_sizes(self.table(cfg), "embed"))

    def vocab_size(self, cfg: Any) -> int:
        """The vocabulary: the largest dim on the logical axis ``vocab``."""
        return max(_axis_sizes(self.table(cfg), "vocab"))

    def ties_embeddings(self, cfg: Any) -> bool:
        """Whether the output head is the embedding (one parameter on the ``vocab`` axis, not two)."""
        return sum("vocab" in p.axes for _, p in _leaves(self.table(cfg))) == 1

    def reads_positions(self) -> bool:
        """Whether the model reads ``batch["positions"]`` (the tokens' positions when a layout
        reorders them): the module's ``READS_POSITIONS``, else whether its source mentions
        ``positions``."""
        if hasattr(self.module, "READS_POSITIONS"):
            return bool(self.module.READS_POSITIONS)
        try:
            return "positions" in inspect.getsource(self.module)
        except (OSError, TypeError):
            return True

    def takes_experts(self) -> bool:
        """Whether the model's loss takes ``experts=`` (its routed experts as a function a layout
        may replace, e.g. by the expert-parallel exchange).

            models.get("moe").takes_experts()   # True
        """
        fn = getattr(self.module, "loss", None) or self.module.loss_and_aux
        return "experts" in inspect.signature(fn).parameters

    def loss(self, params: PyTree, batch: dict, cfg: Any, *, experts=None) -> torch.Tensor:
        """The module's ``loss`` (or ``loss_and_aux``'s value); ``experts`` reaches it only when it
        takes that keyword (a model with routed experts)."""
        if hasattr(self.module, "loss"):
            return self.module.loss(params, batch, cfg, **_experts_kw(self.module.loss, experts))
        return self.module.loss_and_aux(params, batch, cfg, **_experts_kw(self.module.loss_and_aux, experts))[0]

    def loss_and_aux(self, params: PyTree, batch: dict, cfg: Any, *, experts=None) -> tuple[torch.Tensor, dict]:
        """The module's ``loss_and_aux``, or ``(loss, {})``."""
        if hasattr(self.module, "loss_and_aux"):
            return self.module.loss_and_aux(params, batch, cfg, **_experts_kw(self.module.loss_and_aux, experts))
        return self.module.loss(params, batch, cfg, **_experts_kw(self.module.loss, experts)), {}

    def config_from_dict(self, d: dict) -> Any:
        """The module's ``Config.from_dict(d)``, or a checked ``Config(**d)`` for a dataclass."""
        if hasattr(self.module.Config, "from_dict"):
            return self.module.Config.from_dict(d)
        return config_from_dict(self.module.Config, d)

    def compiled_layer_fns(self) -> list[Callable]:
        """The module's functions marked ``core.regional.repeated`` (what ``train.compile`` compiles)."""
        return [f for f in vars(self.module).values() if callable(f) and getattr(f, "repeated", False)]


def _rebuild(module: str, name: str, source: str) -> Model:
    return Model(importlib.import_module(module), name, source)


# ----------------------------------------------------------------------------- defaults


def _init(m: Model):
    def init(cfg, seed: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             regions: dict | None = None) -> PyTree:
        return init_params(m.table(cfg), seed, device=device, dtype=dtype, regions=regions)
    return init


def _param_axes(m: Model):
    return lambda cfg: axes_of(m.table(cfg))


def _param_counts(m: Model):
    def param_counts(cfg) -> dict[str, int]:
        fraction = m.active_fraction(cfg)
        total = active = 0.0
        for _, p in _leaves(m.table(cfg)):
            n = math.prod(p.shape)
            total += n
            active += n * min([fraction.get(a, 1.0) for a in p.axes if a is not None] or [1.0])
        return {"total": int(total), "active": int(round(active))}
    return param_counts


def _stacks(m: Model):
    def stacks(cfg) -> list[tuple[str, int]]:
        out = []
        for key, sub in m.table(cfg).items():
            leaves = [p for _, p in _leaves(sub)]
            if leaves and all(p.axes[:1] == ("layers",) for p in leaves):
                out.append((key, leaves[0].shape[0]))
        return out
    return stacks


def _with_layers(m: Model):
    def with_layers(cfg, counts: dict):
        stacks = m.stacks(cfg)
        if len(stacks) != 1 or not hasattr(cfg, "n_layers"):
            raise ModelError(f"model {m.name!r} ({m.source}) has stacks {stacks}: define with_layers(cfg, counts) "
                             f"-> Config with counts[stack] layers (the default handles one stack and n_layers)")
        return dataclasses.replace(cfg, n_layers=counts[stacks[0][0]])
    return with_layers


def _layout_units(m: Model):
    def layout_units(cfg) -> dict[str, tuple[str, int]]:
        table, units = m.table(cfg), {}
        for axis, key in (("heads", "n_heads"), ("kv_heads", "n_kv_heads")):
            if _axis_sizes(table, axis) and hasattr(cfg, key):
                units[axis] = (key, getattr(cfg, key))
        experts = _axis_sizes(table, "expert")
        if experts:
            count = max(experts)
            key = next((f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) == count
                        and f.name.endswith("experts")), "expert axis") if dataclasses.is_dataclass(cfg) else "expert"
            units["expert"] = (key, count)
        return units
    return layout_units


def _experts_per_token(m: Model):
    def experts_per_token(cfg) -> int:
        if not m.has_axis(cfg, "expert"):
            return 0
        if hasattr(cfg, "top_k"):
            return cfg.top_k
        raise ModelError(f"model {m.name!r} ({m.source}) has an 'expert' axis: define experts_per_token(cfg) -> int "
                         f"(routed experts per token) or a Config field top_k")
    return experts_per_token


def _active_fraction(m: Model):
    def active_fraction(cfg) -> dict[str, float]:
        units = m.layout_units(cfg)
        if "expert" not in units:
            return {}
        return {"expert": m.experts_per_token(cfg) / units["expert"][1]}
    return active_fraction


def _head_dim(cfg) -> int:
    return _field(cfg, "head_dim") or cfg.dim // cfg.n_heads


def _attention_shape(m: Model):
    return lambda cfg: (cfg.n_heads, _head_dim(cfg), _head_dim(cfg))


def _kv_width(m: Model):
    return lambda cfg: 2 * _field(cfg, "n_kv_heads", cfg.n_heads) * _head_dim(cfg)


def _experts_kw(fn: Callable, experts) -> dict:
    """``{"experts": experts}`` when ``fn`` takes it (an MoE model), else ``{}``."""
    if experts is None:
        return {}
    return {"experts": experts} if "experts" in inspect.signature(fn).parameters else {}


def _no_hf(m: Model):
    def hf_tensors(cfg, **_):
        raise ModelError(f"model {m.name!r} ({m.source}) has no Hugging Face names: define hf_tensors(cfg) -> "
                         f"list[models.hf_names.HFTensor] to export or import HF checkpoints")
    return hf_tensors


_DEFAULTS: dict[str, Callable[[Model], Any]] = {
    "init": _init,
    "param_axes": _param_axes,
    "param_counts": _param_counts,
    "stacks": _stacks,
    "with_layers": _with_layers,
    "layout_units": _layout_units,
    "experts_per_token": _experts_per_token,
    "active_fraction": _active_fraction,
    "attention_shape": _attention_shape,
    "kv_width": _kv_width,
    "FROZEN": lambda m: (),
    "aux_update": lambda m: lambda params, aux, cfg: params,
    "aux_metrics": lambda m: lambda aux: {},
    "pipeline_refusal": lambda m: lambda cfg: None,
    "context_refusal": lambda m: lambda cfg: None,
    "hf_tensors": _no_hf,
    "hf_config_keys": lambda m: lambda cfg: {},
    "HF_MODEL_TYPES": lambda m: (),
}


# ----------------------------------------------------------------------------- Config helpers


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
