"""``config.json``: its RoPE and sizes read and checked against a model config, and ours written.

    check_hf_config(json.load(open("ckpt/config.json")), "llama", cfg.model)
    hf_config("llama", cfg.model)                   # the config.json save writes
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from shardfn.core.rope import ROPE_SCALING_OPTIONS, ROPE_SCALINGS, RopeScaling
from shardfn.models.hf.names import _supported_list, named_model, supported_architectures

AT_LEAST = ("num_nextn_predict_layers",)
"""``config.json`` counts of extra layers a checkpoint may hold more of than the model config
uses (fewer is a disagreement); their tensors are then refused by name unless ignored."""




HF_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
"""The values Hugging Face and DeepSeek's code take for yarn keys a ``config.json`` leaves out
(``original_max_position_embeddings`` defaults to ``max_position_embeddings``)."""


def hf_rope(hf: Mapping, *, source: str = "config.json") -> tuple[float | None, dict | None]:
    """``(rope_theta, scaling)`` from a ``config.json`` in either format: the top-level
    ``rope_theta`` / ``rope_scaling`` keys (the scaling's type under ``type`` or ``rope_type``),
    or transformers 5's ``rope_parameters`` (``{"rope_theta", "rope_type", ...}``). ``scaling`` is
    None for plain RoPE, else a mapping for ``model.rope_scaling`` (``{"type": "yarn", ...}``),
    with the yarn keys the file leaves out at the values Hugging Face takes for them.

    Raises:
        ValueError: naming a RoPE type that is not modelled (``linear``, ``dynamic``,
            ``longrope``, ...) or a key of the scaling the models do not have.

    Example:
        hf_rope({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}})
    """
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping) or not ({"rope_type", "type", "rope_theta"} & set(params)):
            raise ValueError(f"{source}: rope_parameters {params!r} is not one set of RoPE parameters (per-layer-type "
                             f"RoPE is not modelled); give {{rope_theta, rope_type, ...}}")
        theta, scaling, name = params.get("rope_theta", hf.get("rope_theta")), dict(params), "rope_parameters"
    else:
        theta, scaling, name = hf.get("rope_theta"), hf.get("rope_scaling"), "rope_scaling"
    if scaling is None:
        return theta, None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"{source}: {name} must be a JSON object or null, got {scaling!r}")
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta" and v is not None}
    kinds = {scaling.pop(k) for k in ("type", "rope_type") if k in scaling}
    if len(kinds) > 1:
        raise ValueError(f"{source}: {name} says both type and rope_type, and they differ: {sorted(kinds)}")
    kind = kinds.pop() if kinds else "default"
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: {name}.partial_rotary_factor={scaling['partial_rotary_factor']}; the models "
                         f"rotate the whole RoPE head dim (partial rotary factor 1)")
    scaling.pop("partial_rotary_factor", None)
    if kind == "default":
        if scaling:
            raise ValueError(f"{source}: {name} has no RoPE scaling type but keys {sorted(scaling)}; give its "
                             f"rope_type ({', '.join(ROPE_SCALINGS)})")
        return theta, None
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"{source}: {name} type {kind!r} is not modelled; the models implement RoPE scaling "
                         f"{', '.join(ROPE_SCALINGS)} (or none: rope_type 'default')")
    if kind == "yarn":
        if scaling.get("truncate", True) is True:   # true, the default: rounded to whole dims (DeepSeek-V3)
            scaling.pop("truncate", None)
        if "attention_factor" in scaling:
            raise ValueError(f"{source}: {name}.attention_factor={scaling['attention_factor']} is not modelled; "
                             f"the models derive the YaRN attention factor from mscale and mscale_all_dim")
        if "original_max_position_embeddings" not in scaling and "max_position_embeddings" in hf:
            scaling["original_max_position_embeddings"] = hf["max_position_embeddings"]
        scaling = {**HF_YARN_DEFAULTS, **scaling}
    unknown = sorted(set(scaling) - set(ROPE_SCALINGS[kind]) - set(ROPE_SCALING_OPTIONS[kind]))
    if unknown:
        raise ValueError(f"{source}: {name}.{unknown[0]} is not modelled for a {kind} scaling (its keys: "
                         f"{', '.join(ROPE_SCALINGS[kind])})")
    return theta, {"type": kind, **scaling}


def _rope_disagreements(theirs: dict | None, ours: RopeScaling | None, name: str,
                        source: str) -> list[tuple[str, str]]:
    """``(what, fix)`` for each way ``config.json``'s RoPE scaling (its key ``name``) differs from
    ``model.rope_scaling``."""
    if theirs is None and ours is None:
        return []
    if theirs is None:
        return [(f"no RoPE scaling but model.rope_scaling={ours.to_dict()}", "model.rope_scaling=null")]
    theirs_cfg = RopeScaling.from_dict(theirs, where=f"{source}: {name}")
    if ours is None or ours.type != theirs_cfg.type:
        mine = "null" if ours is None else ours.type
        return [(f"{name} {theirs_cfg.to_dict()} but model.rope_scaling is {mine}",
                 f"model.rope_scaling={_flow(theirs_cfg.to_dict())}")]
    value = lambda s, k: (s.truncate is not False) if k == "truncate" else getattr(s, k)  # noqa: E731
    return [(f"{name}.{k}={value(theirs_cfg, k)!r} but model.rope_scaling.{k}={value(ours, k)!r}",
             f"model.rope_scaling.{k}={_yaml(value(theirs_cfg, k))}")
            for k in ROPE_SCALINGS[ours.type] + ROPE_SCALING_OPTIONS[ours.type]
            if not _same(value(theirs_cfg, k), value(ours, k))]


def check_hf_config(hf: dict, model_name: str, cfg, *, source: str = "config.json") -> None:
    """ValueError naming every ``config.json`` value our ``model`` config disagrees with.

    Only keys present in ``hf`` are compared. RoPE comes from either format (:func:`hf_rope`),
    and its scaling is compared key by key with ``model.rope_scaling``; RoPE types the models do
    not implement, and biases, are refused by name.

    Example:
        check_hf_config({"hidden_size": 4096, "num_hidden_layers": 32}, "llama", cfg)
    """
    model = named_model(model_name)
    _check_architecture(hf, model_name, model, source)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r}; the models use SwiGLU with silu")
    own_check = getattr(model.module, "hf_config_check", None)
    if own_check is None:
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{source}: {flag} is true, but model {model_name!r} has no biases")
    theta, scaling = hf_rope(hf, source=source)
    hf = {k: v for k, v in hf.items() if k != "rope_theta"}
    if theta is not None:
        hf["rope_theta"] = theta
    table = model.hf_config_keys(cfg)
    wrong = [(f"{hf_key}={value!r} but model.{ours}={getattr(cfg, ours)!r}",
              f"model.{ours}={_yaml(value)}" if ours != "head_dim" else None)
             for hf_key, ours in table.items() if hf_key in hf
             for value in [0 if hf_key == "q_lora_rank" and hf[hf_key] is None else hf[hf_key]]
             if value is not None and not _same(value, getattr(cfg, ours))
             and not (hf_key in AT_LEAST and value > getattr(cfg, ours))]
    name = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
    wrong += _rope_disagreements(scaling, cfg.rope_scaling, name, source)
    if own_check is not None:
        wrong += own_check(hf, cfg)
    if wrong:
        what = "; ".join(w for w, _ in wrong)
        fixes = " ".join(f for _, f in wrong if f is not None)
        fixed_head = any(w.startswith("head_dim=") and f is None for w, f in wrong)
        raise ValueError(f"{source} disagrees with the model config: {what}; "
                         + (f"override {fixes}" if fixes else
                            "head_dim is model.dim / model.n_heads here" if fixed_head else
                            "the model does not compute what this checkpoint needs"))


def _check_architecture(hf: Mapping, model_name: str, model, source: str) -> None:
    """Refuse a ``config.json`` whose ``model_type`` (else ``architectures``) is not ``model``'s,
    naming the model that loads it, or saying it is not modelled and listing what is."""
    model_type, archs = hf.get("model_type"), hf.get("architectures") or []
    if model_type is not None:
        if model_type in model.HF_MODEL_TYPES:
            return
        other = [n for n, (_, types) in supported_architectures().items() if model_type in types]
    elif archs and getattr(model.module, "HF_ARCHITECTURE", None) not in archs:
        other = [n for n, (arch, _) in supported_architectures().items() if arch in archs]
    else:
        return
    what = f"model_type {model_type!r}" + (f" (architectures {list(archs)})" if archs else "")
    if other:
        raise ValueError(f"{source}: {what} is not a {model_name!r} model (model.name={model_name} loads model_type "
                         f"{', '.join(model.HF_MODEL_TYPES)}); set model.name to match the checkpoint: "
                         f"model.name={other[0]}")
    raise ValueError(f"{source}: {what} is not modelled; the architectures shardfn loads: {_supported_list()}")


def hf_config(model_name: str, cfg, *, dtype: torch.dtype = torch.float32,
              rope_interleave: bool | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``model_name`` with ``cfg``, in the format Hugging Face reads
    (top-level ``rope_theta`` / ``rope_scaling``); :func:`check_hf_config` accepts it back.

    Example:
        hf_config("llama", cfg)["architectures"]  # ['LlamaForCausalLM']
    """
    model = named_model(model_name)
    out: dict[str, Any] = {"architectures": [model.HF_ARCHITECTURE], "model_type": model.HF_MODEL_TYPES[0]}
    for hf_key, ours in model.hf_config_keys(cfg).items():
        value = getattr(cfg, ours)
        out[hf_key] = None if hf_key == "q_lora_rank" and value == 0 else value
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
    if "num_key_value_heads" not in out and hasattr(cfg, "n_heads"):  # MLA: one key/value per query head
        out["num_key_value_heads"] = model.layout_units(cfg).get("kv_heads", ("n_heads", cfg.n_heads))[1]
    out["hidden_act"] = "silu"
    extra = getattr(model.module, "hf_config_extra", None)
    for key, value in (extra(cfg) if extra is not None else {}).items():
        out.setdefault(key, value)
    scaling = cfg.rope_scaling
    if scaling is not None:
        out["rope_scaling"] = {"rope_type": scaling.type, "type": scaling.type, **scaling.to_dict()}
        if scaling.type == "yarn":  # Hugging Face derives yarn's factor from these two when both are given
            out["max_position_embeddings"] = round(scaling.factor * scaling.original_max_position_embeddings)
    if rope_interleave is not None:
        out["rope_interleave"] = bool(rope_interleave)
    out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


def _same(value: Any, mine: Any) -> bool:
    if isinstance(mine, tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(mine, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return abs(float(value) - mine) <= 1e-9 * max(1.0, abs(mine))
    return value == mine


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _flow(d: dict) -> str:
    """A mapping as a YAML flow mapping: ``{type: yarn, factor: 40.0}``."""
    return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in d.items()) + "}"
