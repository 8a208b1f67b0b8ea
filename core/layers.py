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

Each layer carries a profiler label (:func:`scope`, ``shardfn.rms_norm``, ``shardfn.layer.3``)
while a profiler records; otherwise, and under ``torch.compile``, the labels are not there at all.

RoPE itself (the tables, their ``llama3`` and ``yarn`` scalings, ``apply_rope``) is
``core.rope``; its public names are importable from here as well.

    cos, sin = rope_tables(seq_len=16, dim=8, theta=10000.0)
    y = gqa_attention(p, x, cos, sin, head_dim=8)  # x [B, 16, D] -> [B, 16, D]
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from shardfn.core.pytree import PyTree, tree_flatten, tree_unflatten
from shardfn.core.rope import (  # noqa: F401  (RoPE's public names, as core.layers has them)
    ROPE_SCALING_OPTIONS,
    ROPE_SCALINGS,
    RopeScaling,
    apply_rope,
    rope_inv_freq,
    rope_softmax_factor,
    rope_tables,
    yarn_mscale,
)
from shardfn.core.scope import scope
from shardfn.core.transforms import eager

__all__ = [
    "scope", "unstack", "linear", "embedding", "rms_norm", "RopeScaling", "ROPE_SCALINGS", "yarn_mscale",
    "rope_inv_freq", "rope_softmax_factor", "rope_tables", "apply_rope", "attention",
    "gqa_attention", "mla_attention", "swiglu", "rope_at", "causal_attention",
]


def unstack(tree: PyTree, n: int) -> Iterator[PyTree]:
    """The ``n`` layers of a stacked parameter tree (every leaf ``[n, ...]``), in order, each a
    tree of its slices: ``tree_map(lambda w: w[i], tree)`` for ``i`` in ``range(n)``.

    Eagerly (``core.transforms.eager``, plain tensors) each leaf is unbound once, so the
    backward stacks the layers' gradients in one op instead of adding ``n`` full-size,
    zero-filled ones (what ``w[i]``'s backward makes). Traced (``make_fx``, ``torch.compile``) or inside a
    ``torch.func`` transform each slice is ``w[i]``, ``select(w, 0, i)``: the partitioner finds
    a layer's parameters by it (the pipeline split, remat). The values are the same either way.

    Example:
        for p in unstack(params["layers"], cfg.n_layers):
            h = block(p, h, cos, sin, cfg)
    """
    leaves, treedef = tree_flatten(tree)
    if eager() and all(type(w) is torch.Tensor and w.shape[0] == n for w in leaves):
        per_leaf = [torch.unbind(w, 0) for w in leaves]
        return (tree_unflatten(treedef, [s[i] for s in per_leaf]) for i in range(n))
    return (tree_unflatten(treedef, [w[i] for w in leaves]) for i in range(n))  # each layer's slices as it comes


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
    with scope("shardfn.embedding"):
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
    with scope("shardfn.rms_norm"):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return normed.to(x.dtype) * w


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    Query head ``h`` reads kv head ``h // (H // Hkv)``. Eagerly or under ``torch.compile``, on
    plain tensors, the kernel reads the groups itself (``enable_gqa=True``), with no repeated
    copies going forward nor their gradients summed coming back: the same output, and key/value
    gradients that differ only in the order each group's sum is taken (forward and backward ~9%
    faster at llama_tiny's shapes on one CPU thread, ``benchmarks/bench_eager_forms.py``). Traced by ``make_fx``
    (the partitioner's trace) or inside a ``torch.func`` transform, the key/value heads are
    repeated (``repeat_interleave``) before ``scaled_dot_product_attention``, so the fused kernel
    sees equal head counts, which the partitioner's sharding rules split over heads; once
    lowered to a rank's own shapes, ``partition.passes.grouped_heads`` hands the kernels the groups
    unrepeated again.

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
    with scope("shardfn.attention"):
        if n_kv_heads != n_heads and (torch.compiler.is_compiling() or eager()) \
                and all(type(t) is torch.Tensor for t in (q, k, v)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        if n_kv_heads != n_heads:
            k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)  # [B, H, S, Dqk]
            v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)  # [B, H, S, Dv]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *,
                             scale: float | None = None) -> torch.Tensor:
    """Causal attention where each query sees only the last ``window`` keys, itself included:
    query ``i`` reads key ``j`` iff ``i - window < j <= i`` (Mistral's sliding window, as Hugging
    Face computes it). With ``window >= S`` it is :func:`attention`, causal.

    Args:
        q: ``[B, H, S, Dqk]``; k: ``[B, Hkv, S, Dqk]``; v: ``[B, Hkv, S, Dv]`` (``H % Hkv == 0``).
        window: keys per query (``>= 1``).
        scale: softmax scale; default ``1 / sqrt(Dqk)``.

    Returns:
        ``[B, H, S, Dv]``.

    Example:
        q, kv = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
        out = sliding_window_attention(q, kv, kv, 4)  # each token reads itself and the 3 before it
    """
    s = q.shape[2]
    if window >= s:
        return attention(q, k, v, causal=True, scale=scale)
    with scope("shardfn.sliding_window_attention"):
        i = torch.arange(s, device=q.device)
        keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # [S query, S key]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)                              # [B, H, S, Dqk]
            v = v.repeat_interleave(groups, dim=1)                              # [B, H, S, Dv]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # A masked softmax in plain ops, which every layout's sharding rules split (torch's rules
        # for the fused kernel take no mask); it holds [B, H, S, S] scores.
        scores = (q @ k.transpose(-2, -1)).float() * scale                      # [B, H, S, S]
        probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        return probs.to(q.dtype) @ v                                            # [B, H, S, Dv]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, *, window: int = 0,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention with a learned sink logit per head (gpt-oss): each query's softmax runs
    over its keys and one extra logit ``sinks[h]`` whose probability is dropped, so a head may
    attend to nothing. ``window > 0``: each query reads only the last ``window`` keys, as
    :func:`sliding_window_attention`. A masked softmax in plain ops, holding ``[B, H, S, S]``.

    Args:
        q: ``[B, H, S, Dqk]``; k: ``[B, Hkv, S, Dqk]``; v: ``[B, Hkv, S, Dv]`` (``H % Hkv == 0``).
        sinks: ``[H]`` logits.
        window: keys per query (0: every key up to the query's own).
        scale: softmax scale; default ``1 / sqrt(Dqk)``.

    Returns:
        ``[B, H, S, Dv]``.

    Example:
        out = sink_attention(torch.randn(2, 4, 16, 8), kv, kv, torch.zeros(4), window=4)   # kv [2, 2, 16, 8]
    """
    with scope("shardfn.sink_attention"):
        s = q.shape[2]
        i = torch.arange(s, device=q.device)
        keep = i[None, :] <= i[:, None]                                        # [S query, S key]
        if window:
            keep = keep & (i[None, :] > i[:, None] - window)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)                              # [B, H, S, Dqk]
            v = v.repeat_interleave(groups, dim=1)                              # [B, H, S, Dv]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = ((q @ k.transpose(-2, -1)).float() * scale).masked_fill(~keep, float("-inf"))  # [B, H, S, S]
        sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)               # [B, H, S, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return probs.to(q.dtype) @ v                                            # [B, H, S, Dv]


def clamped_swiglu(gate_up: torch.Tensor, *, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's gated activation of interleaved gate/up columns (``[..., 2F] -> [..., F]``):
    ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``,
    with ``gate = gate_up[..., 0::2]`` and ``up = gate_up[..., 1::2]``.

    Example:
        h = clamped_swiglu(torch.randn(3, 16))   # [3, 8]
    """
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def rope_at(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables' rows at each token's position, for tokens that come in any order.

    Args:
        cos, sin: ``[S, D]`` from :func:`rope_tables` (``S`` above every position).
        positions: ``[B, S']`` int64.

    Returns:
        ``(cos, sin)``, each ``[B, 1, S', D]`` (broadcast over heads by :func:`apply_rope`).

    Example:
        cos, sin = rope_at(*rope_tables(16, 8, 10000.0), torch.arange(16).flip(0).expand(2, 16))
    """
    return embedding(cos, positions).unsqueeze(1), embedding(sin, positions).unsqueeze(1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, *,
                     scale: float | None = None) -> torch.Tensor:
    """Causal :func:`attention`, or with ``positions`` (``[B, S]``, tokens in any order) the
    keys at positions up to each query's own (``core.positional_attention``, the op a layout
    splits over the sequence).

    Example:
        out = causal_attention(q, k, v, torch.arange(16).expand(2, 16))   # [B, H, S, Dv]
    """
    if positions is None:
        return attention(q, k, v, causal=True, scale=scale)
    from shardfn.core.positional_attention import positional_attention

    return positional_attention(q, k, v, positions, positions, scale=scale)


def _split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, -1, head_dim).transpose(1, 2)  # [B, S, H*hd] -> [B, H, S, hd]


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)      # [B, H, S, hd] -> [B, S, H*hd]


def gqa_attention(
    p: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, head_dim: int, causal: bool = True,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query self-attention block (Llama 3): projections, RoPE on q and k, attention, output.

    Args:
        p: ``{"wq": [D, H*hd], "wk": [D, Hkv*hd], "wv": [D, Hkv*hd], "wo": [H*hd, D]}``.
        x: ``[B, S, D]``.
        cos, sin: ``[S, hd]`` from :func:`rope_tables` (``[B, 1, S, hd]`` from :func:`rope_at` with ``positions``).
        head_dim: ``hd``; head counts follow from the weights' shapes.
        causal: mask future positions.
        positions: ``[B, S]`` each token's position when the tokens are not in order (causal only).

    Returns:
        ``[B, S, D]``.

    Example:
        cos, sin = rope_tables(16, 16, 500000.0)
        y = gqa_attention(p, torch.randn(2, 16, 64), cos, sin, head_dim=16)  # [2, 16, 64]
    """
    with scope("shardfn.gqa_attention"):
        q = apply_rope(_split_heads(linear(x, p["wq"]), head_dim), cos, sin)  # [B, H, S, hd]
        k = apply_rope(_split_heads(linear(x, p["wk"]), head_dim), cos, sin)  # [B, Hkv, S, hd]
        v = _split_heads(linear(x, p["wv"]), head_dim)                        # [B, Hkv, S, hd]
        out = attention(q, k, v, causal=causal) if positions is None else causal_attention(q, k, v, positions)
        return linear(_merge_heads(out), p["wo"])


def mla_attention(
    p: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
    qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, norm_eps: float = 1e-6, causal: bool = True,
    scale: float | None = None, positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3), in its training ("naive") form.

    Queries go through a low-rank bottleneck with an RMS norm (``wq_a``, ``q_norm``, ``wq_b``), or
    a direct ``wq`` when the config has ``q_lora_rank = 0``. Keys and values come from one
    compressed latent ``c_kv`` (``kv_lora_rank``, RMS-normed) expanded per head by ``wkv_b``, plus
    a RoPE key of ``qk_rope_head_dim`` shared by all heads. Each head's query/key is
    ``[nope | rope]``; the softmax scale is ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``
    unless ``scale`` is given (a YaRN scaling multiplies it by :func:`rope_softmax_factor`).

    Args:
        p: ``wq_a [D, q_lora]``, ``q_norm [q_lora]``, ``wq_b [q_lora, H*(nope+rope)]`` -- or
            ``wq [D, H*(nope+rope)]`` --, ``wkv_a [D, kv_lora + rope]``, ``kv_norm [kv_lora]``,
            ``wkv_b [kv_lora, H*(nope+v)]``, ``wo [H*v, D]``.
        x: ``[B, S, D]``.
        cos, sin: ``[S, rope]`` from :func:`rope_tables` with ``dim = qk_rope_head_dim``.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head sizes.
        norm_eps: of ``q_norm`` and ``kv_norm`` (DeepSeek-V3 uses 1e-6 whatever its other norms use).
        causal: mask future positions.
        scale: the softmax scale; default ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.
        positions: ``[B, S]`` each token's position when the tokens are not in order (causal only;
            ``cos``/``sin`` then ``[B, 1, S, rope]`` from :func:`rope_at`).

    Returns:
        ``[B, S, D]``.

    Example:
        cos, sin = rope_tables(16, 8, 10000.0)
        y = mla_attention(p, x, cos, sin, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    """
    nope, rope, vd = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    with scope("shardfn.mla_attention"):
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
        scale = 1.0 / math.sqrt(nope + rope) if scale is None else scale
        if positions is None:
            out = attention(q, k, v, causal=causal, scale=scale)                   # [B, H, S, v]
        else:
            out = causal_attention(q, k, v, positions, scale=scale)
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
    with scope("shardfn.swiglu"):
        return linear(F.silu(linear(x, p["w1"])) * linear(x, p["w3"]), p["w2"])


NO_IGNORED_TARGET = torch.iinfo(torch.int64).min
"""The ``ignore_index`` :func:`cross_entropy` passes: no real target equals it, so every position
counts, and a negative target is an out-of-bounds error rather than a position silently left out."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, in float32.

    The mean is the sum over positions divided by their number, a constant of the shapes, rather
    than by a count of the targets kept (``F.cross_entropy``'s mean with ``ignore_index``): on a
    mesh that splits the batch the count would be a partial sum, all-reduced between the forward
    and the backward, where every rank waits for the slowest (without it dp2 and fsdp2 steps are
    0.5-6% faster; docs/partitioner.md). The value and its gradient are ``F.cross_entropy``'s
    mean, to the bit.

    Example:
        cross_entropy(torch.zeros(2, 3, 256), torch.zeros(2, 3, dtype=torch.long))  # log(256)
    """
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), flat, reduction="sum",
                            ignore_index=NO_IGNORED_TARGET)
    return total / flat.numel()
