"""gpt-oss (``GptOssForCausalLM``, OpenAI 2025): a grouped-query MoE decoder with attention sinks.

Every layer is pre-norm, as in ``models.decoder``, but each piece is gpt-oss's own:

    h = h + attention(rms_norm(h))   # GQA with q/k/v/o biases and a learned sink logit per head;
                                     # layer_types: "sliding_attention" (last sliding_window keys)
                                     # or "full_attention", alternating from layer 0 (sliding)
    h = h + experts(rms_norm(h))     # router x @ W + b, top-k logits, softmax over those k; experts
                                     # with biases and the clamped SwiGLU of interleaved gate/up

RoPE is YaRN with the correction range left fractional (``truncate: false``), rotate-half. The
output head is not tied. Parameters (``L`` layers, ``D`` dim, ``H``/``Hkv`` heads, ``hd`` head
dim, ``E`` experts, ``F`` expert ffn dim, ``V`` vocab):

    embed, out             [V, D], [D, V]     (vocab, embed), (embed, vocab)
    layers.attn.wq, bq     [L, D, H*hd], [L, H*hd]     wk, wv [L, D, Hkv*hd]; bk, bv [L, Hkv*hd]
    layers.attn.wo, bo     [L, H*hd, D], [L, D]
    layers.attn.sinks      [L, H]             (layers, heads): split with the heads under tp
    layers.router, router_bias  [L, D, E], [L, E]
    layers.experts.w13, b13     [L, E, D, 2F], [L, E, 2F]   gate/up columns interleaved, as HF stores them
    layers.experts.w2, b2       [L, E, F, D], [L, E, D]

    cfg = models.get("gpt_oss").Config()
    loss(models.get("gpt_oss").init(cfg, seed=0), {"inputs": tokens, "targets": targets}, cfg)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from shardfn.core import layers as L
from shardfn.core import moe
from shardfn.core.expert_ffn import ClampedSwiGLU
from shardfn.core.init import normal, ones, stacked
from shardfn.core.layers import RopeScaling
from shardfn.core.pytree import PyTree, flatten_with_paths
from shardfn.core.regional import repeated
from shardfn.models import hf_names
from shardfn.models.contract import check, config_from_dict
from shardfn.models.hf_names import HFTensor

LAYER_TYPES = ("sliding_attention", "full_attention")
YARN = RopeScaling.from_dict({"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                              "truncate": False})
"""gpt-oss's RoPE scaling (its ``config.json``; ``mscale`` 1 and ``mscale_all_dim`` 0: HF's defaults)."""


@dataclass(frozen=True)
class Config:
    """gpt-oss hyperparameters. Defaults: the tiny model. ``layer_types``: None means alternating,
    ``sliding_attention`` first (Hugging Face's default and both published models).

    Named sizes (examples/configs; vocab 201088, dim 2880, 64 heads, 8 kv heads, head_dim 64,
    expert ffn 2880, top-4, window 128); total / active as OpenAI counts them (the embedding
    lookup is not active):

        name           layers  experts  total / active
        gpt_oss_20b    24      32       20.9B / 3.6B
        gpt_oss_120b   36      128      116.8B / 5.1B
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    n_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: int = 32
    sliding_window: int = 128
    layer_types: tuple[str, ...] | None = None
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rope_theta: float = 150000.0
    rope_scaling: RopeScaling | None = YARN
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = False

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling, where="model.rope_scaling"))
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "n_experts", "expert_ffn_dim",
                    "sliding_window"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        check(self.head_dim >= 2 and self.head_dim % 2 == 0, "head_dim", f"must be even (RoPE), got {self.head_dim}")
        check(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
              f"= {self.n_kv_heads} must divide model.n_heads = {self.n_heads} (grouped-query attention)")
        check(1 <= self.top_k <= self.n_experts, "top_k", f"must be in 1 .. model.n_experts, got {self.top_k}")
        check(not self.tie_embeddings, "tie_embeddings", "must be false: gpt-oss has its own output head")
        kinds = tuple(self.layer_types or (LAYER_TYPES[i % 2] for i in range(self.n_layers)))
        check(len(kinds) == self.n_layers and set(kinds) <= set(LAYER_TYPES), "layer_types",
              f"must name one of {', '.join(LAYER_TYPES)} for each of the {self.n_layers} layers, got {list(kinds)}")
        object.__setattr__(self, "layer_types", kinds)
        for key in ("rope_theta", "norm_eps", "init_std", "swiglu_limit", "swiglu_alpha"):
            check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """A validated Config from the ``model`` section of a run config (without ``name``)."""
        return config_from_dict(cls, d)

    def window(self, layer: int) -> int:
        """Keys layer ``layer``'s queries read (0: all before them)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else 0


# ----------------------------------------------------------------------------- parameters


def param_table(cfg: Config) -> PyTree:
    """Every parameter's shape, logical axes and initialiser (see the module docstring)."""
    V, D, std, E, F = cfg.vocab_size, cfg.dim, cfg.init_std, cfg.n_experts, cfg.expert_ffn_dim
    H, Hkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = {"wq": normal((D, H), ("embed", "heads"), std), "bq": normal((H,), ("heads",), std),
            "wk": normal((D, Hkv), ("embed", "kv_heads"), std), "bk": normal((Hkv,), ("kv_heads",), std),
            "wv": normal((D, Hkv), ("embed", "kv_heads"), std), "bv": normal((Hkv,), ("kv_heads",), std),
            "wo": normal((H, D), ("heads", "embed"), std), "bo": normal((D,), ("embed",), std),
            "sinks": normal((cfg.n_heads,), ("heads",), std)}
    experts = {"w13": normal((E, D, 2 * F), ("expert", "embed", "expert_mlp"), std),
               "b13": normal((E, 2 * F), ("expert", "expert_mlp"), std),
               "w2": normal((E, F, D), ("expert", "expert_mlp", "embed"), std),
               "b2": normal((E, D), ("expert", "embed"), std)}
    layer = {"attn_norm": ones((D,), ("norm",)), "attn": attn, "mlp_norm": ones((D,), ("norm",)),
             "router": normal((D, E), ("embed", None), std), "router_bias": normal((E,), (None,), std),
             "experts": experts}
    return {"embed": normal((V, D), ("vocab", "embed"), std), "layers": stacked(cfg.n_layers, layer),
            "norm": ones((D,), ("norm",)), "out": normal((D, V), ("embed", "vocab"), std)}


def param_counts(cfg: Config) -> dict[str, int]:
    """``total`` and ``active`` (per token) parameters, as OpenAI counts them: the routed experts
    count ``top_k / n_experts``, and the embedding table, a lookup, not at all.

    Example:
        param_counts(load_config("gpt_oss_20b").model)   # {'total': 20.91e9, 'active': 3.61e9}
    """
    total = active = 0.0
    for path, p in flatten_with_paths(param_table(cfg), is_leaf=lambda x: hasattr(x, "axes")):
        n = math.prod(p.shape)
        total += n
        active += 0 if path == "embed" else n * (cfg.top_k / cfg.n_experts if "expert" in p.axes else 1)
    return {"total": int(total), "active": int(round(active))}


# ----------------------------------------------------------------------------- forward


def _heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, -1, hd).transpose(1, 2)                                   # [B, S, H*hd] -> [B, H, S, hd]


def attention(p: PyTree, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config,
              window: int) -> torch.Tensor:
    """Grouped-query attention with biases and per-head sinks, over the last ``window`` keys (0: all)."""
    hd = cfg.head_dim
    q = L.apply_rope(_heads(L.linear(x, p["wq"], p["bq"]), hd), cos, sin)        # [B, H, S, hd]
    k = L.apply_rope(_heads(L.linear(x, p["wk"], p["bk"]), hd), cos, sin)        # [B, Hkv, S, hd]
    v = _heads(L.linear(x, p["wv"], p["bv"]), hd)                                 # [B, Hkv, S, hd]
    out = L.sink_attention(q, k, v, p["sinks"], window=window)                    # [B, H, S, hd]
    b, _, s, _ = out.shape
    return L.linear(out.transpose(1, 2).reshape(b, s, -1), p["wo"], p["bo"])      # [B, S, D]


def route(p: PyTree, x: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k router logits (``x @ router + router_bias``) and a softmax over those k.

    Returns:
        ``(indices [T, k] int64, weights [T, k])``.
    """
    top, indices = L.linear(x, p["router"], p["router_bias"]).topk(cfg.top_k, dim=-1)   # [T, k]
    return indices, torch.softmax(top, dim=-1)


def experts(e: PyTree, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, cfg: Config,
            routed=None) -> torch.Tensor:
    """Each token through its top-k experts, each ``clamped_swiglu(x @ w13 + b13) @ w2 + b2``
    (``core.expert_ffn.ClampedSwiGLU``). ``routed`` runs them (None: ``core.moe.routed_experts``,
    dropless on this device; a layout may pass its own). ``[T, D]``."""
    ffn = ClampedSwiGLU(limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
    return (routed or moe.routed_experts)(x, indices, weights, e["w13"], e["b13"], e["w2"], e["b2"], ffn=ffn)


@repeated
def block(p: PyTree, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config, window: int,
          routed=None) -> torch.Tensor:
    """One pre-norm layer; ``p`` is one layer's slice of ``params["layers"]``. ``[B, S, D]``."""
    h = h + attention(p["attn"], L.rms_norm(h, p["attn_norm"], cfg.norm_eps), cos, sin, cfg, window)
    b, s, d = h.shape
    x = L.rms_norm(h, p["mlp_norm"], cfg.norm_eps).reshape(b * s, d)              # [T, D]
    indices, weights = route(p, x, cfg)
    return h + experts(p["experts"], x, indices, weights, cfg, routed).view(b, s, d)


def apply(params: PyTree, tokens: torch.Tensor, cfg: Config, *, experts=None) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` for ``tokens`` ``[B, S]``; ``experts`` as in :func:`loss`.

    Example:
        logits = apply(models.get("gpt_oss").init(cfg, 0), torch.zeros(2, 16, dtype=torch.long), cfg)
    """
    h = L.embedding(params["embed"], tokens)                                      # [B, S, D]
    cos, sin = L.rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta, scaling=cfg.rope_scaling,
                             device=h.device, dtype=h.dtype)
    for i, p in enumerate(L.unstack(params["layers"], cfg.n_layers)):
        with L.scope(f"shardfn.layer.{i}"):
            h = block(p, h, cos, sin, cfg, cfg.window(i), experts)
    return L.linear(L.rms_norm(h, params["norm"], cfg.norm_eps), params["out"])  # [B, S, V]


def loss(params: PyTree, batch: dict, cfg: Config, *, experts=None) -> torch.Tensor:
    """Mean cross-entropy of :func:`apply` against ``batch["targets"]``. ``experts``: the routed
    experts as a function of ``core.moe.routed_experts``' signature (a layout's all-to-all
    region).

    Example:
        loss(params, {"inputs": x, "targets": y}, cfg)  # 0-d tensor
    """
    if "positions" in batch:
        raise ValueError("model gpt_oss reads its tokens in order (sink and sliding-window attention); the batch has "
                         "reordered tokens (batch['positions']): train without cp")
    return L.cross_entropy(apply(params, batch["inputs"], cfg, experts=experts), batch["targets"])


# ----------------------------------------------------------------------------- contract members

READS_POSITIONS = False
HF_MODEL_TYPES = ("gpt_oss",)
HF_ARCHITECTURE = "GptOssForCausalLM"


def with_layers(cfg: Config, counts: dict) -> Config:
    """``cfg`` with ``counts["layers"]`` layers, keeping the alternating layer types."""
    return dataclasses.replace(cfg, n_layers=counts["layers"], layer_types=None)


def context_refusal(cfg: Config) -> tuple[str, str] | None:
    """Sink and sliding-window attention are not computed on tokens a layout reorders."""
    return ("layer_types", f"has sliding-window layers (model.sliding_window = {cfg.sliding_window}) and every layer "
                           f"has attention sinks: neither is computed on tokens a layout reorders; train without cp")


def hf_tensors(cfg: Config, *, rope_interleave: bool | None = None) -> list[HFTensor]:
    """Every parameter and the HF tensors it is made of (see ``models.hf``). The experts are one
    tensor per layer in HF too (``mlp.experts.gate_up_proj [E, D, 2F]``, interleaved), read as they are.

    Example:
        [t.key for t in hf_tensors(Config())][-1]  # 'model.layers.{i}.mlp.experts.down_proj_bias'
    """
    if rope_interleave:
        raise ValueError("rope_interleave=True: gpt-oss checkpoints store RoPE in the rotate-half layout")
    layers, a, m = tuple(range(cfg.n_layers)), "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    out = hf_names.outer(False) + hf_names.norms("layers", layers) + hf_names.gqa_attention("layers", layers)
    out += [HFTensor(f"layers.attn.b{x}", f"{a}.{x}_proj.bias", layers) for x in "qkvo"]
    out += [HFTensor("layers.attn.sinks", f"{a}.sinks", layers),
            hf_names.linear("layers.router", f"{m}.router.weight", layers),
            HFTensor("layers.router_bias", f"{m}.router.bias", layers)]
    return out + [HFTensor(f"layers.experts.{ours}", f"{m}.experts.{theirs}", layers) for ours, theirs in
                  (("w13", "gate_up_proj"), ("b13", "gate_up_proj_bias"), ("w2", "down_proj"),
                   ("b2", "down_proj_bias"))]


def hf_config_keys(cfg: Config) -> dict[str, str]:
    """``config.json`` key -> Config field, for checking a checkpoint's config against ours."""
    keys = {k: v for k, v in hf_names.COMMON_CONFIG_KEYS.items() if k != "intermediate_size"}
    return {**keys, **hf_names.GQA_CONFIG_KEYS, "intermediate_size": "expert_ffn_dim",
            "num_local_experts": "n_experts", "num_experts_per_tok": "top_k", "sliding_window": "sliding_window",
            "layer_types": "layer_types", "swiglu_limit": "swiglu_limit", "swiglu_alpha": "swiglu_alpha"}


def hf_config_check(hf: dict, cfg: Config) -> list[tuple[str, str | None]]:
    """``(what, fix)`` for what a ``config.json`` says that gpt-oss here does not compute."""
    wrong: list[tuple[str, str | None]] = []
    if hf.get("attention_bias") is False:
        wrong.append(("attention_bias is false, but gpt-oss's q/k/v/o projections have biases", None))
    if hf.get("mlp_bias"):
        wrong.append(("mlp_bias is true, which gpt-oss does not have", None))
    return wrong


def hf_config_extra(cfg: Config) -> dict:
    """``config.json`` keys :func:`models.hf.hf_config` writes beyond :func:`hf_config_keys`."""
    return {"attention_bias": True, "router_aux_loss_coef": 0.0, "output_router_logits": False}
