"""Llama 3 dense transformer as pure functions over a stacked parameter tree.

    cfg = Config.from_dict({"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2})
    params = models.get("llama").init(cfg, seed=0)
    logits = apply(params, tokens, cfg)                       # [B, S] -> [B, S, vocab]
    loss(params, {"inputs": tokens, "targets": targets}, cfg)  # mean cross-entropy

Parameters (``L`` layers, ``D`` dim, ``H``/``Hkv`` heads, ``hd`` head dim, ``F`` ffn dim, ``V`` vocab):

    embed               [V, D]          (vocab, embed)
    layers.attn_norm    [L, D]          (layers, norm)
    layers.attn.wq      [L, D, H*hd]    (layers, embed, heads)
    layers.attn.wk      [L, D, Hkv*hd]  (layers, embed, kv_heads)
    layers.attn.wv      [L, D, Hkv*hd]  (layers, embed, kv_heads)
    layers.attn.wo      [L, H*hd, D]    (layers, heads, embed)
    layers.mlp_norm     [L, D]          (layers, norm)
    layers.mlp.w1       [L, D, F]       (layers, embed, mlp)
    layers.mlp.w3       [L, D, F]       (layers, embed, mlp)
    layers.mlp.w2       [L, F, D]       (layers, mlp, embed)
    norm                [D]             (norm,)
    out                 [D, V]          (embed, vocab)      absent when tie_embeddings

RoPE uses the "rotate half" convention (see ``shardfn.core.layers``). No parallelism here: the
partitioner shards this code from the table's logical axes and rules. Everything else a layout,
the planner or a checkpoint needs (``init``, ``param_axes``, ``stacks``, ``layout_units``, ...)
is the contract's default (``models.contract``, docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardfn.core import layers as L
from shardfn.core.init import normal, ones, stacked
from shardfn.core.layers import RopeScaling, cross_entropy
from shardfn.core.pytree import PyTree
from shardfn.core.regional import repeated
from shardfn.models import check, config_from_dict, hf_names
from shardfn.models.hf_names import HFTensor


@dataclass(frozen=True)
class Config:
    """Llama hyperparameters. Defaults are the tiny debug model (``llama_tiny``).

    Named sizes:

        name        vocab_size  dim   n_layers  n_heads  n_kv_heads  ffn_dim  rope_theta
        llama_tiny  256         64    2         4        2           256      10000
        llama3_8b   128256      4096  32        32       8           14336    500000
        llama3_1_8b (llama3_8b's sizes, rope_scaling: llama3, factor 8 over 8192 positions)

    ``rope_scaling``: None (plain RoPE) or a ``llama3`` / ``yarn`` scaling, given as a mapping
    (``{type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4,
    original_max_position_embeddings: 8192}``) and held as a frozen ``core.layers.RopeScaling``.
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # llama3 | yarn (core.layers.RopeScaling); None: plain RoPE
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # logits = h @ embed.T, no separate ``out``
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling, where="model.rope_scaling"))
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        check(self.dim % self.n_heads == 0, "n_heads", f"= {self.n_heads} must divide model.dim = {self.dim}")
        check(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
              f"= {self.n_kv_heads} must divide model.n_heads = {self.n_heads} (grouped-query attention)")
        check(self.head_dim % 2 == 0, "n_heads",
              f"= {self.n_heads} gives an odd head dim {self.head_dim} (dim / n_heads); RoPE needs it even")
        check(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        check(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        check(self.init_std > 0, "init_std", f"must be > 0, got {self.init_std}")

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """A validated Config from the ``model`` section of a run config (without ``name``).

        Raises:
            ValueError: naming the key (``model.n_kv_heads``) for unknown keys, wrong types or
                inconsistent sizes.

        Example:
            Config.from_dict({"dim": 128, "n_heads": 8})
        """
        return config_from_dict(cls, d)


# ----------------------------------------------------------------------------- parameters


def param_table(cfg: Config) -> PyTree:
    """Every parameter's shape, logical axes and initialiser (see the module docstring)."""
    D, F_, V, hd, std = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.head_dim, cfg.init_std
    layer = {
        "attn_norm": ones((D,), ("norm",)),
        "attn": {
            "wq": normal((D, cfg.n_heads * hd), ("embed", "heads"), std),
            "wk": normal((D, cfg.n_kv_heads * hd), ("embed", "kv_heads"), std),
            "wv": normal((D, cfg.n_kv_heads * hd), ("embed", "kv_heads"), std),
            "wo": normal((cfg.n_heads * hd, D), ("heads", "embed"), std),
        },
        "mlp_norm": ones((D,), ("norm",)),
        "mlp": {
            "w1": normal((D, F_), ("embed", "mlp"), std),
            "w3": normal((D, F_), ("embed", "mlp"), std),
            "w2": normal((F_, D), ("mlp", "embed"), std),
        },
    }
    table = {"embed": normal((V, D), ("vocab", "embed"), std), "layers": stacked(cfg.n_layers, layer),
             "norm": ones((D,), ("norm",))}
    if not cfg.tie_embeddings:
        table["out"] = normal((D, V), ("embed", "vocab"), std)
    return table


# ----------------------------------------------------------------------------- Hugging Face names


HF_MODEL_TYPES = ("llama",)
"""Hugging Face ``model_type`` values this model loads (``LlamaForCausalLM``)."""
HF_ARCHITECTURE = "LlamaForCausalLM"
"""The ``architectures`` entry of the ``config.json`` that ``models.hf.save`` writes."""


def hf_tensors(cfg: Config, *, rope_interleave: bool | None = None) -> list[HFTensor]:
    """Every parameter and the HF tensors it is made of (see ``models.hf``).

    HF Llama already uses our "rotate half" RoPE layout, so nothing is permuted
    (``rope_interleave`` is accepted for the common signature and must not be true).

    Example:
        [t.path for t in hf_tensors(Config())][:3]  # ['embed', 'norm', 'out']
    """
    if rope_interleave:
        raise ValueError("rope_interleave=True: Llama checkpoints store RoPE in the rotate-half layout")
    layers = tuple(range(cfg.n_layers))
    return (hf_names.outer(cfg.tie_embeddings) + hf_names.norms("layers", layers)
            + hf_names.gqa_attention("layers", layers) + hf_names.swiglu("layers.mlp", "model.layers.{i}.mlp", layers))


def hf_config_keys(cfg: Config) -> dict[str, str]:
    """``config.json`` key -> Config field, for checking a checkpoint's config against ours."""
    return {**hf_names.COMMON_CONFIG_KEYS, **hf_names.GQA_CONFIG_KEYS}


# ----------------------------------------------------------------------------- forward


@repeated
def block(p: PyTree, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config,
          positions: torch.Tensor | None = None) -> torch.Tensor:
    """One pre-norm transformer layer; ``p`` is one layer's slice of ``params["layers"]``."""
    h = h + L.gqa_attention(p["attn"], L.rms_norm(h, p["attn_norm"], cfg.norm_eps), cos, sin, head_dim=cfg.head_dim,
                            positions=positions)
    return h + L.swiglu(p["mlp"], L.rms_norm(h, p["mlp_norm"], cfg.norm_eps))  # [B, S, D]


def apply(params: PyTree, tokens: torch.Tensor, cfg: Config, *, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Logits for ``tokens``.

    Args:
        params: from :func:`init`.
        tokens: ``[B, S]`` int64.
        cfg: the model's Config.
        positions: ``[B, S]`` int64, each token's position in its sequence when the tokens are
            not in order (a permutation of ``0 .. S-1`` per row); None: ``0 .. S-1``.

    Returns:
        ``[B, S, vocab]`` in the params' dtype.

    Example:
        logits = apply(models.get("llama").init(Config(), 0), torch.zeros(2, 16, dtype=torch.long), Config())
    """
    h = L.embedding(params["embed"], tokens)                                   # [B, S, D]
    cos, sin = L.rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta, scaling=cfg.rope_scaling,
                             device=h.device, dtype=h.dtype)
    if positions is not None:
        cos, sin = L.rope_at(cos, sin, positions)                              # [B, 1, S, hd]
    for i, p in enumerate(L.unstack(params["layers"], cfg.n_layers)):                # one layer's slices
        with L.scope(f"shardfn.layer.{i}"):
            h = block(p, h, cos, sin, cfg, positions)
    h = L.rms_norm(h, params["norm"], cfg.norm_eps)
    out = params["embed"].t() if cfg.tie_embeddings else params["out"]
    return L.linear(h, out)                                                    # [B, S, V]


def loss(params: PyTree, batch: dict, cfg: Config) -> torch.Tensor:
    """Mean cross-entropy of ``apply(params, batch["inputs"])`` against ``batch["targets"]``.

    ``batch["positions"]`` (optional, ``[B, S]``): the
    tokens' positions when a layout has reordered them (context parallelism's load balance).

    Example:
        loss(params, {"inputs": x, "targets": y}, cfg)  # 0-d tensor
    """
    return cross_entropy(apply(params, batch["inputs"], cfg, positions=batch.get("positions")), batch["targets"])
