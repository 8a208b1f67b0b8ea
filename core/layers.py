"""Pure transformer layers: each is a function of its parameters (a dict of tensors) and inputs.

Conventions (see docs/architecture.md):

- Linear weights are ``[in, out]`` and applied as ``x @ w``.
- Attention tensors are ``[B, H, S, D]`` (batch, heads, sequence, head dim), as
  ``scaled_dot_product_attention`` takes them.
- Head counts are read from shapes (``view(B, S, -1, head_dim)``), never from a config, so the
  same code runs on a shard that holds only some of the heads.
- RoPE uses the "rotate half" convention of Hugging Face Llama / GPT-NeoX: the head dim is split
  into two halves ``(x1, x2)`` and rotated as ``(x1 cos - x2 sin, x2 cos + x1 sin)``, with
  frequency ``i`` shared by dims ``i`` and ``i + D/2``. Meta's original checkpoints use the
  interleaved convention (pairs ``(2i, 2i+1)``); load those with ``wq``/``wk`` columns permuted
  as Hugging Face's conversion script does.

    cos, sin = rope_tables(seq_len=16, dim=8, theta=10000.0)
    y = gqa_attention(p, x, cos, sin, head_dim=8)  # x [B, 16, D] -> [B, 16, D]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.profiler import record_function

__all__ = [
    "linear", "embedding", "rms_norm", "rope_tables", "apply_rope", "attention",
    "gqa_attention", "mla_attention", "swiglu",
]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ b)``.

    Args:
        x: ``[..., in]``.
        w: ``[in, out]``.
        b: optional ``[out]``.

    Returns:
        ``[..., out]``.

    Example:
        y = linear(torch.randn(2, 3, 8), torch.randn(8, 16))  # [2, 3, 16]
    """
    y = x @ w
    return y if b is None else y + b


def embedding(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` picked by ``tokens``.

    Args:
        table: ``[vocab, embed]``.
        tokens: integer ``[...]``.

    Returns:
        ``[..., embed]``.

    Example:
        h = embedding(torch.randn(256, 64), torch.tensor([[1, 2, 3]]))  # [1, 3, 64]
    """
    with record_function("shardfn.embedding"):
        return F.embedding(tokens, table)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Root-mean-square norm over the last dim, computed in float32, then scaled by ``w``.

    Args:
        x: ``[..., D]``.
        w: ``[D]``.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x``'s dtype.

    Example:
        y = rms_norm(torch.randn(2, 3, 8), torch.ones(8))  # each row has RMS ~1
    """
    with record_function("shardfn.rms_norm"):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return normed.to(x.dtype) * w


def rope_tables(
    seq_len: int, dim: int, theta: float, *, device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for rotary position embeddings ("rotate half" layout).

    Frequency ``i`` (``theta ** (-2i / dim)``) fills dims ``i`` and ``i + dim/2``.

    Args:
        seq_len: number of positions ``S`` (positions ``0 .. S-1``).
        dim: the rotated head dim ``D`` (even).
        theta: the RoPE base (10000 for Llama 2, 500000 for Llama 3).
        device, dtype: of the returned tables.

    Returns:
        ``(cos, sin)``, each ``[S, D]``.

    Example:
        cos, sin = rope_tables(16, 8, 10000.0)
        cos.shape  # torch.Size([16, 8])
    """
    if dim % 2:
        raise ValueError(f"rope_tables: dim must be even, got {dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))  # [D/2]
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)       # [S, D/2]
    angles = torch.cat([angles, angles], dim=-1)                                                     # [S, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


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
    with record_function("shardfn.rope"):
        return (x * cos + _rotate_half(x) * sin).to(x.dtype)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    Key/value heads are repeated (``repeat_interleave``: query head ``h`` reads kv head
    ``h // (H // Hkv)``) before ``scaled_dot_product_attention``, so the fused kernel sees equal
    head counts; this traces to the same fused ops under ``make_fx`` and ``torch.func.grad`` as
    plain multi-head attention, for which the partitioner has sharding rules.

    Args:
        q: ``[B, H, S, Dqk]``.
        k: ``[B, Hkv, S, Dqk]`` with ``H % Hkv == 0``.
        v: ``[B, Hkv, S, Dv]`` (``Dv`` may differ from ``Dqk``, as in MLA).
        causal: mask future positions.
        scale: softmax scale; default ``1 / sqrt(Dqk)``.

    Returns:
        ``[B, H, S, Dv]``.

    Example:
        q, kv = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
        out = attention(q, kv, kv)  # [2, 4, 16, 8]
    """
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    assert n_heads % n_kv_heads == 0, f"query heads {n_heads} not a multiple of kv heads {n_kv_heads}"
    with record_function("shardfn.attention"):
        if n_kv_heads != n_heads:
            k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)  # [B, H, S, Dqk]
            v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)  # [B, H, S, Dv]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, -1, head_dim).transpose(1, 2)  # [B, S, H*hd] -> [B, H, S, hd]


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)      # [B, H, S, hd] -> [B, S, H*hd]


def gqa_attention(
    p: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, head_dim: int, causal: bool = True,
) -> torch.Tensor:
    """Grouped-query self-attention block (Llama 3): projections, RoPE on q and k, attention, output.

    Args:
        p: ``{"wq": [D, H*hd], "wk": [D, Hkv*hd], "wv": [D, Hkv*hd], "wo": [H*hd, D]}``.
        x: ``[B, S, D]``.
        cos, sin: ``[S, hd]`` from :func:`rope_tables`.
        head_dim: ``hd``; head counts follow from the weights' shapes.
        causal: mask future positions.

    Returns:
        ``[B, S, D]``.

    Example:
        cos, sin = rope_tables(16, 16, 500000.0)
        y = gqa_attention(p, torch.randn(2, 16, 64), cos, sin, head_dim=16)  # [2, 16, 64]
    """
    with record_function("shardfn.gqa_attention"):
        q = apply_rope(_split_heads(linear(x, p["wq"]), head_dim), cos, sin)  # [B, H, S, hd]
        k = apply_rope(_split_heads(linear(x, p["wk"]), head_dim), cos, sin)  # [B, Hkv, S, hd]
        v = _split_heads(linear(x, p["wv"]), head_dim)                        # [B, Hkv, S, hd]
        return linear(_merge_heads(attention(q, k, v, causal=causal)), p["wo"])


def mla_attention(
    p: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
    qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, norm_eps: float = 1e-6, causal: bool = True,
) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3), in its training ("naive") form.

    Queries go through a low-rank bottleneck with an RMS norm (``wq_a``, ``q_norm``, ``wq_b``), or
    a direct ``wq`` when the config has ``q_lora_rank = 0``. Keys and values come from one
    compressed latent ``c_kv`` (``kv_lora_rank``, RMS-normed) expanded per head by ``wkv_b``, plus
    a RoPE key of ``qk_rope_head_dim`` shared by all heads. Each head's query/key is
    ``[nope | rope]``; the softmax scale is ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.

    Args:
        p: ``wq_a [D, q_lora]``, ``q_norm [q_lora]``, ``wq_b [q_lora, H*(nope+rope)]`` -- or
            ``wq [D, H*(nope+rope)]`` --, ``wkv_a [D, kv_lora + rope]``, ``kv_norm [kv_lora]``,
            ``wkv_b [kv_lora, H*(nope+v)]``, ``wo [H*v, D]``.
        x: ``[B, S, D]``.
        cos, sin: ``[S, rope]`` from :func:`rope_tables` with ``dim = qk_rope_head_dim``.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head sizes.
        norm_eps: of ``q_norm`` and ``kv_norm``.
        causal: mask future positions.

    Returns:
        ``[B, S, D]``.

    Example:
        cos, sin = rope_tables(16, 8, 10000.0)
        y = mla_attention(p, x, cos, sin, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    """
    nope, rope, vd = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    with record_function("shardfn.mla_attention"):
        if "wq" in p:
            q = linear(x, p["wq"])                                                 # [B, S, H*(nope+rope)]
        else:
            q = linear(rms_norm(linear(x, p["wq_a"]), p["q_norm"], norm_eps), p["wq_b"])
        q = _split_heads(q, nope + rope)                                           # [B, H, S, nope+rope]
        q_nope, q_rope = q.split([nope, rope], dim=-1)

        kv_a = linear(x, p["wkv_a"])                                               # [B, S, kv_lora+rope]
        c_kv, k_rope = kv_a.split([kv_a.shape[-1] - rope, rope], dim=-1)
        kv = linear(rms_norm(c_kv, p["kv_norm"], norm_eps), p["wkv_b"])             # [B, S, H*(nope+v)]
        k_nope, v = _split_heads(kv, nope + vd).split([nope, vd], dim=-1)          # [B, H, S, nope], [.., v]
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin)                         # [B, 1, S, rope]

        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)              # [B, H, S, nope+rope]
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        out = attention(q, k, v, causal=causal, scale=1.0 / math.sqrt(nope + rope))  # [B, H, S, v]
        return linear(_merge_heads(out), p["wo"])


def swiglu(p: dict, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU feed-forward: ``(silu(x @ w1) * (x @ w3)) @ w2``.

    Args:
        p: ``{"w1": [D, F], "w3": [D, F], "w2": [F, D]}``.
        x: ``[..., D]``.

    Returns:
        ``[..., D]``.

    Example:
        p = {"w1": torch.randn(64, 256), "w3": torch.randn(64, 256), "w2": torch.randn(256, 64)}
        y = swiglu(p, torch.randn(2, 16, 64))  # [2, 16, 64]
    """
    with record_function("shardfn.swiglu"):
        return linear(F.silu(linear(x, p["w1"])) * linear(x, p["w3"]), p["w2"])
