"""Rotary position embeddings (RoPE): the tables, their scalings and applying them.

RoPE uses the "rotate half" convention of Hugging Face Llama / GPT-NeoX: the head dim is split
into two halves ``(x1, x2)`` and rotated as ``(x1 cos - x2 sin, x2 cos + x1 sin)``, with
frequency ``i`` shared by dims ``i`` and ``i + D/2``.

RoPE scaling (:class:`RopeScaling`) stretches a model past the context it was pretrained on:
``llama3`` (Llama 3.1-3.3) and ``yarn`` (DeepSeek-V3, Kimi-K2) rescale the inverse frequencies
(:func:`rope_inv_freq`); ``yarn`` also scales the tables by a magnitude factor and, in DeepSeek's
attention, the softmax scale (:func:`rope_softmax_factor`). The formulas follow the published
definitions of Hugging Face transformers (``modeling_rope_utils``) and DeepSeek-V3's modelling code.

    cos, sin = rope_tables(seq_len=16, dim=8, theta=10000.0)
    q = apply_rope(q, cos, sin)                     # q [B, H, 16, 8]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardfn.core.scope import scope
from shardfn.core.transforms import eager

ROPE_SCALINGS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
}
"""RoPE scaling type -> the keys it needs (all of them, no defaults)."""

ROPE_SCALING_OPTIONS: dict[str, tuple[str, ...]] = {"llama3": (), "yarn": ("truncate",)}
"""RoPE scaling type -> the keys it may leave out: ``truncate`` (yarn; true when left out)."""


def _scaling_options() -> str:
    return "; ".join(f"{kind} ({', '.join(keys)})" for kind, keys in ROPE_SCALINGS.items())


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling: its ``type`` (``llama3`` or ``yarn``) and the keys of that type; the keys
    of the other type are None. Frozen and hashable, so a model Config holding one stays so.

    ``factor``: the context extension; ``original_max_position_embeddings``: the pretraining
    context. ``llama3``: wavelengths under ``original / high_freq_factor`` keep their frequency,
    those over ``original / low_freq_factor`` are divided by ``factor``, those between blend
    smoothly. ``yarn``: a linear ramp over the dims between the correction dims of
    ``beta_fast`` and ``beta_slow`` rotations blends extrapolated (unchanged) and interpolated
    (divided by ``factor``) frequencies; the tables are scaled by
    ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` and DeepSeek's
    attention multiplies its softmax scale by ``yarn_mscale(factor, mscale_all_dim) ** 2``.
    ``truncate`` (yarn only; None means true): the correction range rounded out to whole dims,
    as DeepSeek-V3 does; false keeps its fractional ends (gpt-oss).

    Example:
        s = RopeScaling.from_dict({"type": "llama3", "factor": 8, "low_freq_factor": 1,
                                   "high_freq_factor": 4, "original_max_position_embeddings": 8192})
    """

    type: str
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def __post_init__(self):
        problem = _scaling_problem(self)
        if problem:
            raise ValueError(f"rope_scaling{problem}")

    def to_dict(self) -> dict:
        """``{"type": ..., <its keys>}`` (the keys of its type only).

        Example:
            RopeScaling.from_dict(s.to_dict()) == s  # True
        """
        out = {"type": self.type, **{k: getattr(self, k) for k in ROPE_SCALINGS[self.type]}}
        return out if self.truncate is None else {**out, "truncate": self.truncate}

    @classmethod
    def from_dict(cls, d, *, where: str = "rope_scaling") -> "RopeScaling | None":
        """A validated scaling from a mapping (``type`` or ``rope_type``, and the type's keys);
        None and a RopeScaling pass through. A null value counts as not given.

        Raises:
            ValueError: naming ``where`` (``model.rope_scaling``) for an unknown type, a missing,
                unknown or non-numeric key, or a value out of range; the message lists the types
                and their keys.

        Example:
            RopeScaling.from_dict({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
        """
        if d is None or isinstance(d, cls):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be a mapping with a type and its keys, or null; got {d!r}. "
                             f"Types: {_scaling_options()}")
        d = {k: v for k, v in d.items() if v is not None}
        kinds = {d.pop(k) for k in ("type", "rope_type") if k in d}
        if len(kinds) > 1:
            raise ValueError(f"{where}: type and rope_type disagree ({sorted(kinds)}); give one of them")
        kind = kinds.pop() if kinds else None
        if kind not in ROPE_SCALINGS:
            raise ValueError(f"{where}.type {kind!r} is not a supported RoPE scaling; valid types and their keys: "
                             f"{_scaling_options()} (or {where}: null for plain RoPE)")
        need = ROPE_SCALINGS[kind]
        missing = [k for k in need if k not in d]
        if missing:
            raise ValueError(f"{where} of type {kind} is missing {', '.join(missing)}; it needs "
                             f"{', '.join(need)}")
        unknown = sorted(k for k in d if k not in need + ROPE_SCALING_OPTIONS[kind])
        if unknown:
            raise ValueError(f"{where}: {unknown[0]} is not a key of a {kind} scaling; valid keys: type, "
                             f"{', '.join(need + ROPE_SCALING_OPTIONS[kind])}")
        if "truncate" in d and not isinstance(d["truncate"], bool):
            raise ValueError(f"{where}.truncate must be true or false, got {d['truncate']!r}")
        values = {}
        for k in need:
            v = d[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{where}.{k} must be a number, got {v!r}")
            if k == "original_max_position_embeddings":
                if not float(v).is_integer():
                    raise ValueError(f"{where}.{k} must be a whole number of positions, got {v!r}")
                v = int(v)
            values[k] = v if k == "original_max_position_embeddings" else float(v)
        try:
            return cls(type=kind, **values, **({"truncate": d["truncate"]} if "truncate" in d else {}))
        except ValueError as e:
            raise ValueError(f"{where}{str(e)[len('rope_scaling'):]}") from None


def _scaling_problem(s: RopeScaling) -> str | None:
    if s.type not in ROPE_SCALINGS:
        return f".type {s.type!r} is not supported; valid types and their keys: {_scaling_options()}"
    need = ROPE_SCALINGS[s.type]
    for k in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if (getattr(s, k) is None) == (k in need):
            return (f".{k} must be given for a {s.type} scaling" if k in need
                    else f".{k} is not a key of a {s.type} scaling; valid keys: type, {', '.join(need)}")
    if s.truncate is not None and s.type != "yarn":
        return f".truncate is not a key of a {s.type} scaling; valid keys: type, {', '.join(need)}"
    if not s.factor >= 1:
        return f".factor must be >= 1 (the context extension), got {s.factor}"
    if not s.original_max_position_embeddings >= 1:
        return f".original_max_position_embeddings must be >= 1, got {s.original_max_position_embeddings}"
    if s.type == "llama3" and not 0 < s.low_freq_factor < s.high_freq_factor:
        return (f".low_freq_factor = {s.low_freq_factor} and .high_freq_factor = {s.high_freq_factor} must "
                f"satisfy 0 < low_freq_factor < high_freq_factor")
    if s.type == "yarn":
        for k in ("beta_fast", "beta_slow"):
            if not getattr(s, k) > 0:
                return f".{k} must be > 0 (a number of rotations), got {getattr(s, k)}"
        for k in ("mscale", "mscale_all_dim"):
            if not getattr(s, k) >= 0:
                return f".{k} must be >= 0, got {getattr(s, k)}"
    return None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude factor ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``).

    Example:
        yarn_mscale(40.0, 1.0)  # 1.3689
    """
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_correction_dim(rotations: float, dim: int, theta: float, original: int) -> float:
    """The (fractional) dim index whose frequency turns ``rotations`` times over ``original`` positions."""
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None = None, *,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The ``dim / 2`` inverse frequencies ``theta ** (-2i / dim)``, rescaled by ``scaling``.

    Args:
        dim: the rotated head dim (even).
        theta: the RoPE base.
        scaling: None (plain RoPE), or a ``llama3`` / ``yarn`` :class:`RopeScaling`.
        device: of the result.

    Returns:
        ``[dim / 2]`` float32.

    Example:
        llama31 = RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)
        rope_inv_freq(128, 500000.0, llama31)  # [64]: Llama 3.1's frequencies
    """
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))  # [D/2]
    if scaling is None:
        return inv
    f = scaling.factor
    if scaling.type == "llama3":
        original = scaling.original_max_position_embeddings
        lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = ((original / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
        blended = (1 - smooth) * inv / f + smooth * inv
        return torch.where(wavelen < original / hi, inv, torch.where(wavelen > original / lo, inv / f, blended))
    low = _yarn_correction_dim(scaling.beta_fast, dim, theta, scaling.original_max_position_embeddings)
    high = _yarn_correction_dim(scaling.beta_slow, dim, theta, scaling.original_max_position_embeddings)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / span).clamp(0.0, 1.0)
    return inv / f * ramp + inv * (1 - ramp)  # ramp 0: extrapolate (keep), 1: interpolate (divide)


def rope_softmax_factor(scaling: RopeScaling | None) -> float:
    """What DeepSeek-V3's attention multiplies its softmax scale by: ``yarn_mscale(factor,
    mscale_all_dim) ** 2`` for ``yarn``, else 1.

    Example:
        ds = RopeScaling("yarn", 40.0, 4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
        rope_softmax_factor(ds)  # 1.3689 ** 2 (DeepSeek-V3)
    """
    if scaling is None or scaling.type != "yarn":
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _table_factor(scaling: RopeScaling | None) -> float:
    if scaling is None or scaling.type != "yarn":
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)


def rope_tables(
    seq_len: int, dim: int, theta: float, *, scaling: RopeScaling | None = None,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for rotary position embeddings ("rotate half" layout).

    Frequency ``i`` (``theta ** (-2i / dim)``, rescaled by ``scaling``: :func:`rope_inv_freq`)
    fills dims ``i`` and ``i + dim/2``. A ``yarn`` scaling also multiplies both tables by
    ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)``.

    Args:
        seq_len: number of positions ``S`` (positions ``0 .. S-1``).
        dim: the rotated head dim ``D`` (even).
        theta: the RoPE base (10000 for Llama 2, 500000 for Llama 3).
        scaling: None (plain RoPE) or a :class:`RopeScaling`.
        device, dtype: of the returned tables.

    Returns:
        ``(cos, sin)``, each ``[S, D]``. Eagerly (``core.transforms.eager``) they are built once
        per set of arguments and shared by later calls: read them, do not write to them.

    Example:
        cos, sin = rope_tables(16, 8, 10000.0)
        cos.shape  # torch.Size([16, 8])
    """
    if dim % 2:
        raise ValueError(f"rope_tables: dim must be even, got {dim}")
    if eager():
        device = torch.device(device) if device is not None else torch.get_default_device()
        return _cached_rope_tables(seq_len, dim, float(theta), scaling, device, dtype)
    return _rope_tables(seq_len, dim, theta, scaling, device, dtype)


@functools.lru_cache(maxsize=32)
def _cached_rope_tables(seq_len: int, dim: int, theta: float, scaling: RopeScaling | None,
                        device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_tables` built once per ``(seq_len, dim, theta, scaling, device, dtype)``:
    eager forwards share them (read-only; ``apply_rope`` never writes to them)."""
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable by autograd later
        return _rope_tables(seq_len, dim, theta, scaling, device, dtype)


def _rope_tables(seq_len, dim, theta, scaling, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_inv_freq(dim, theta, scaling, device=device)                                     # [D/2]
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)       # [S, D/2]
    angles = torch.cat([angles, angles], dim=-1)                                                     # [S, D]
    cos, sin = angles.cos(), angles.sin()
    m = _table_factor(scaling)
    if m != 1.0:
        cos, sin = cos * m, sin * m
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by position ("rotate half" convention, see :func:`rope_tables`).

    Args:
        x: ``[..., S, D]``, e.g. ``[B, H, S, D]``.
        cos, sin: ``[S, D]`` from :func:`rope_tables`.

    Returns:
        ``[..., S, D]`` in ``x``'s dtype.

    Example:
        cos, sin = rope_tables(16, 8, 10000.0)
        q = apply_rope(torch.randn(2, 4, 16, 8), cos, sin)  # [2, 4, 16, 8]
    """
    with scope("shardfn.rope"):
        if eager():  # the sign on the [S, D] table, not on half of x: (-x2) * s == x2 * (-s) to the bit
            s1, s2 = sin.chunk(2, dim=-1)
            return (x * cos + _swap_halves(x) * torch.cat([-s1, s2], dim=-1)).to(x.dtype)
        return (x * cos + _rotate_half(x) * sin).to(x.dtype)
