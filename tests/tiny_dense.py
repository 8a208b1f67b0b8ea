"""The smallest dense decoder a user writes for shardfn: a Config, a parameter table with a logical
axis per dim, and a loss (tests/test_model_contract.py trains it on one device, dp2 and pp2).
It reads its tokens in order, so it takes no part in a sequence split."""

from dataclasses import dataclass

from shardfn.core import layers as L
from shardfn.core.init import normal, ones, stacked


@dataclass(frozen=True)
class Config:                                                                       # contract
    vocab_size: int = 256                                                           # contract
    dim: int = 32                                                                   # contract
    n_layers: int = 2                                                               # contract
    n_heads: int = 4                                                                # contract


def param_table(cfg: Config) -> dict:                                               # contract
    D, V = cfg.dim, cfg.vocab_size
    layer = {"attn_norm": ones((D,), ("norm",)),
             "attn": {"wq": normal((D, D), ("embed", "heads")), "wk": normal((D, D), ("embed", "heads")),
                      "wv": normal((D, D), ("embed", "heads")), "wo": normal((D, D), ("heads", "embed"))},
             "mlp_norm": ones((D,), ("norm",)),
             "mlp": {"w1": normal((D, 4 * D), ("embed", "mlp")), "w3": normal((D, 4 * D), ("embed", "mlp")),
                     "w2": normal((4 * D, D), ("mlp", "embed"))}}
    return {"embed": normal((V, D), ("vocab", "embed")), "layers": stacked(cfg.n_layers, layer),  # contract
            "norm": ones((D,), ("norm",)), "out": normal((D, V), ("embed", "vocab"))}            # contract


def loss(params: dict, batch: dict, cfg: Config):                                  # contract
    tokens, hd = batch["inputs"], cfg.dim // cfg.n_heads
    h = L.embedding(params["embed"], tokens)                                        # [B, S, D]
    cos, sin = L.rope_tables(tokens.shape[1], hd, 10000.0, device=h.device, dtype=h.dtype)
    for i, p in enumerate(L.unstack(params["layers"], cfg.n_layers)):
        with L.scope(f"shardfn.layer.{i}"):
            h = h + L.gqa_attention(p["attn"], L.rms_norm(h, p["attn_norm"]), cos, sin, head_dim=hd)
            h = h + L.swiglu(p["mlp"], L.rms_norm(h, p["mlp_norm"]))
    logits = L.linear(L.rms_norm(h, params["norm"]), params["out"])                 # [B, S, V]
    return L.cross_entropy(logits, batch["targets"])                                # contract
