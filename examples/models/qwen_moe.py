"""A Qwen3-style decoder with a Mixtral-style MoE, written on ``shardfn.core`` blocks as a user would.

Every layer: grouped-query attention with QK-norm (an RMSNorm over each head's query and key, as
Qwen3), then a mixture of experts routed by a softmax over all experts and the top-2 of them
renormalised (Mixtral), with no shared experts. Untied output head. Nothing here knows about
devices: a layout shards it from the logical axes of :func:`param_table`, and replaces
``experts`` (the routed experts as a function) when it splits the experts over devices.

    shardfn train --config examples/models/qwen_moe.yaml      # the layouts: see that file

Parameters (``L`` layers, ``D`` dim, ``H``/``Hkv`` heads, ``hd`` head dim, ``E`` experts, ``F``
expert ffn dim, ``V`` vocab):

    embed                    [V, D]          (vocab, embed)
    layers.attn_norm         [L, D]          (layers, norm)
    layers.attn.wq           [L, D, H*hd]    (layers, embed, heads);  wk, wv [L, D, Hkv*hd]; wo [L, H*hd, D]
    layers.attn.q_norm       [L, hd]         (layers, norm);  k_norm the same
    layers.mlp_norm          [L, D]          (layers, norm)
    layers.router            [L, D, E]       (layers, embed, None)
    layers.experts.w1, w3    [L, E, D, F]    (layers, expert, embed, expert_mlp);  w2 [L, E, F, D]
    norm                     [D]             (norm,)
    out                      [D, V]          (embed, vocab)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardfn.core import layers as L
from shardfn.core import moe
from shardfn.core.init import normal, ones, stacked
from shardfn.core.regional import repeated


@dataclass(frozen=True)
class Config:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    n_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: int = 32
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    init_std: float = 0.02


def param_table(cfg: Config) -> dict:
    D, V, E, F, hd, std = cfg.dim, cfg.vocab_size, cfg.n_experts, cfg.expert_ffn_dim, cfg.head_dim, cfg.init_std
    layer = {
        "attn_norm": ones((D,), ("norm",)),
        "attn": {"wq": normal((D, cfg.n_heads * hd), ("embed", "heads"), std),
                 "wk": normal((D, cfg.n_kv_heads * hd), ("embed", "kv_heads"), std),
                 "wv": normal((D, cfg.n_kv_heads * hd), ("embed", "kv_heads"), std),
                 "wo": normal((cfg.n_heads * hd, D), ("heads", "embed"), std),
                 "q_norm": ones((hd,), ("norm",)), "k_norm": ones((hd,), ("norm",))},
        "mlp_norm": ones((D,), ("norm",)),
        "router": normal((D, E), ("embed", None), std),
        "experts": {"w1": normal((E, D, F), ("expert", "embed", "expert_mlp"), std),
                    "w3": normal((E, D, F), ("expert", "embed", "expert_mlp"), std),
                    "w2": normal((E, F, D), ("expert", "expert_mlp", "embed"), std)},
    }
    return {"embed": normal((V, D), ("vocab", "embed"), std), "layers": stacked(cfg.n_layers, layer),
            "norm": ones((D,), ("norm",)), "out": normal((D, V), ("embed", "vocab"), std)}


def _heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, -1, hd).transpose(1, 2)                                   # [B, S, H*hd] -> [B, H, S, hd]


def attention(p: dict, x: torch.Tensor, cos, sin, cfg: Config, positions=None) -> torch.Tensor:
    """GQA with QK-norm: each head's query and key RMS-normed before RoPE."""
    hd, eps = cfg.head_dim, cfg.norm_eps
    q = L.apply_rope(L.rms_norm(_heads(L.linear(x, p["wq"]), hd), p["q_norm"], eps), cos, sin)  # [B, H, S, hd]
    k = L.apply_rope(L.rms_norm(_heads(L.linear(x, p["wk"]), hd), p["k_norm"], eps), cos, sin)  # [B, Hkv, S, hd]
    v = _heads(L.linear(x, p["wv"]), hd)                                                        # [B, Hkv, S, hd]
    out = L.causal_attention(q, k, v, positions)                                                # [B, H, S, hd]
    b, _, s, _ = out.shape
    return L.linear(out.transpose(1, 2).reshape(b, s, -1), p["wo"])                            # [B, S, D]


def mixture(p: dict, x: torch.Tensor, cfg: Config, experts=None) -> torch.Tensor:
    """Softmax over every expert, the top-k kept and renormalised (Mixtral); ``experts`` runs them."""
    b, s, d = x.shape
    flat = x.reshape(b * s, d)                                                    # [T, D]
    scores = torch.softmax(L.linear(flat, p["router"]).float(), dim=-1)          # [T, E]
    weights, indices = scores.topk(cfg.top_k, dim=-1)                             # [T, k]
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    e = p["experts"]
    y = (experts or moe.routed_experts)(flat, indices, weights, e["w1"], e["w2"], e["w3"])
    return y.view(b, s, d)


@repeated
def block(p: dict, h: torch.Tensor, cos, sin, cfg: Config, experts=None, positions=None) -> torch.Tensor:
    h = h + attention(p["attn"], L.rms_norm(h, p["attn_norm"], cfg.norm_eps), cos, sin, cfg, positions)
    return h + mixture(p, L.rms_norm(h, p["mlp_norm"], cfg.norm_eps), cfg, experts)


def loss(params: dict, batch: dict, cfg: Config, *, experts=None) -> torch.Tensor:
    tokens, positions = batch["inputs"], batch.get("positions")
    h = L.embedding(params["embed"], tokens)                                      # [B, S, D]
    cos, sin = L.rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta, device=h.device, dtype=h.dtype)
    if positions is not None:
        cos, sin = L.rope_at(cos, sin, positions)
    for i, p in enumerate(L.unstack(params["layers"], cfg.n_layers)):
        with L.scope(f"shardfn.layer.{i}"):
            h = block(p, h, cos, sin, cfg, experts, positions)
    logits = L.linear(L.rms_norm(h, params["norm"], cfg.norm_eps), params["out"])  # [B, S, V]
    return L.cross_entropy(logits, batch["targets"])
