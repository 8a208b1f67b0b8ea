"""DeepSeek-V3 / Kimi-K2 mixture-of-experts transformer as pure functions over stacked parameters.

``first_k_dense`` dense layers (attention + SwiGLU), then ``n_layers - first_k_dense`` MoE layers
(attention + routed and shared experts, ``shardfn.core.moe``). Attention is multi-head latent
attention (``attention: mla``) or grouped-query attention (``attention: gqa``).

    cfg = Config.from_dict({"n_experts": 8, "top_k": 2})
    params = models.get("moe").init(cfg, seed=0)
    logits = apply(params, tokens, cfg)                                    # [B, S] -> [B, S, vocab]
    loss_value, aux = loss_and_aux(params, {"inputs": x, "targets": y}, cfg)
    aux["expert_counts"]                                                   # [n_moe_layers, n_experts]

Parameters (``Ld``/``Lm`` dense/MoE layers, ``D`` dim, ``H`` heads, ``E`` experts, ``Fe`` expert
ffn dim, ``Fs = n_shared_experts * Fe``; ``n``/``r``/``v`` the MLA nope/rope/value head dims):

    embed                          [V, D]                  (vocab, embed)
    {dense,moe}_layers.attn_norm   [L, D]                  (layers, norm)
    {dense,moe}_layers.attn.*      MLA: wq_a [L, D, q_lora], q_norm [L, q_lora], wq_b [L, q_lora, H*(n+r)]
                                        (or wq [L, D, H*(n+r)] when q_lora_rank = 0),
                                        wkv_a [L, D, kv_lora + r], kv_norm [L, kv_lora],
                                        wkv_b [L, kv_lora, H*(n+v)], wo [L, H*v, D]
                                   GQA: wq, wk, wv, wo as in models.llama
    {dense,moe}_layers.mlp_norm    [L, D]                  (layers, norm)
    dense_layers.mlp.{w1,w3}       [Ld, D, F]              (layers, embed, mlp);  w2 [Ld, F, D]
    moe_layers.router              [Lm, D, E]              (layers, embed, None)
    moe_layers.router_bias         [Lm, E]                 (layers, None)  selection only, no gradient
    moe_layers.experts.{w1,w3}     [Lm, E, D, Fe]          (layers, expert, embed, expert_mlp)
    moe_layers.experts.w2          [Lm, E, Fe, D]          (layers, expert, expert_mlp, embed)
    moe_layers.shared.{w1,w3}      [Lm, D, Fs]             (layers, embed, mlp);  w2 [Lm, Fs, D]
    norm                           [D]                     (norm,)
    out                            [D, V]                  (embed, vocab)  absent when tie_embeddings
    mtp.{enorm,hnorm,norm}         [K, D]                  (layers, norm)  multi-token prediction, K = mtp_depth
    mtp.eh_proj                    [K, 2D, D]              (layers, None, embed)
    mtp.block.*                    [K, ...]                one MoE layer per depth, as moe_layers.*

``dense_layers`` is absent when ``first_k_dense = 0``, ``moe_layers.shared`` when
``n_shared_experts = 0`` and ``mtp`` when ``mtp_depth = 0`` (the default). The wkv_a output dim
(latent + shared rope key) has no logical axis.

Multi-token prediction (DeepSeek-V3, ``mtp_depth = K``): depth ``k`` projects
``[enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]`` with ``eh_proj``, runs its own MoE layer, and the
main model's output head (after the depth's own ``norm``) predicts ``t_{i+k+1}``; the embedding
and the head are the main model's. The loss adds ``mtp_loss_weight`` (DeepSeek-V3: 0.3 for its
first 10T tokens, then 0.1) times the mean over depths of their cross-entropy
(:func:`apply_with_mtp`, :func:`mtp_loss`). The weight is a model field, not a ``train`` key,
because ``loss_and_aux(params, batch, cfg)`` is all a step calls and the model layer does not
import the run config; override it as ``model.mtp_loss_weight=0.1``. :func:`apply` and
:func:`apply_with_aux` skip the MTP modules, as inference does.
RoPE may be scaled (``rope_scaling``: ``yarn`` as DeepSeek-V3 and Kimi-K2 publish it, or
``llama3``; see ``core.layers.RopeScaling``). With ``yarn`` the MLA softmax scale is multiplied by
``yarn_mscale(factor, mscale_all_dim) ** 2`` as in DeepSeek-V3's attention; GQA attention gets the
scaled tables only, as Hugging Face's Llama-family attention does. The MLA latent norms
(``attn.q_norm``, ``attn.kv_norm``) use eps 1e-6 whatever ``norm_eps`` says, as DeepSeek-V3's
code does. No parallelism here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shardfn.core import layers as L
from shardfn.core import moe
from shardfn.core.init import normal, ones, stacked, zeros
from shardfn.core.layers import RopeScaling, cross_entropy
from shardfn.core.pytree import PyTree, tree_map
from shardfn.core.regional import repeated
from shardfn.models import check, config_from_dict, hf_names
from shardfn.models.hf_names import HFTensor

ATTENTIONS = ("mla", "gqa")
MLA_NORM_EPS = 1e-6
"""eps of the MLA latent norms (``q_a_layernorm``, ``kv_a_layernorm``): DeepSeek-V3 builds them with
its RMSNorm's default, not ``rms_norm_eps``."""
GROUPED_MM_MULTIPLE = 8
"""``dim`` and ``expert_ffn_dim`` must be multiples of this: the grouped GEMM needs 16-byte rows
in bfloat16 (8 elements), which also covers float32 (4)."""


@dataclass(frozen=True)
class Config:
    """MoE transformer hyperparameters. Defaults are a tiny debug model (like ``moe_tiny``).

    Named sizes:

        name              dim   layers  dense  heads  experts  top_k  shared  Fe    groups  score
        moe_tiny          64    3       1      4      8        2      1       32    1       sigmoid
        deepseek_v3_671b  7168  61      3      128    256      8      1       2048  8 (4)   sigmoid
        kimi_k2_1t        7168  61      1      64     384      8      1       2048  1       sigmoid
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 3
    first_k_dense: int = 1        # the first k layers use a dense SwiGLU of ffn_dim
    n_heads: int = 4
    attention: str = "mla"        # "mla" | "gqa"
    # grouped-query attention (attention: gqa); head_dim = dim / n_heads
    n_kv_heads: int = 4
    # multi-head latent attention (attention: mla)
    q_lora_rank: int = 32         # 0: a direct wq, no query bottleneck
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # feed-forward
    ffn_dim: int = 256            # dense layers
    n_experts: int = 8            # routed experts per MoE layer
    top_k: int = 2
    n_shared_experts: int = 1
    expert_ffn_dim: int = 32      # hidden size of one expert (shared experts: n_shared * this)
    # routing
    score_func: str = "sigmoid"   # "softmax" | "sigmoid"
    n_groups: int = 1             # expert groups for node-limited routing (1: no limit)
    topk_groups: int = 1          # groups a token may use
    route_scale: float = 1.0
    norm_topk_prob: bool = True   # divide the top-k weights by their sum
    aux_loss_alpha: float = 0.0   # sequence-wise balance loss coefficient (0: off)
    bias_update_rate: float = 1e-3  # aux-loss-free balancing speed, for the train step
    # the rest
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # yarn | llama3 (core.layers.RopeScaling); None: plain RoPE
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    # multi-token prediction (DeepSeek-V3): depth k predicts the token k+1 ahead (0: none)
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3  # lambda: the loss adds lambda * the mean over depths of their cross-entropy

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.first_k_dense

    @property
    def head_dim(self) -> int:
        """The GQA head dim (``dim / n_heads``)."""
        return self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The rotated head dim: ``qk_rope_head_dim`` for MLA, ``head_dim`` for GQA."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling, where="model.rope_scaling"))
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "n_experts", "top_k", "expert_ffn_dim",
                    "n_groups", "topk_groups")
        for key in positive:
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        check(0 <= self.first_k_dense < self.n_layers, "first_k_dense",
              f"= {self.first_k_dense} must be in [0, model.n_layers = {self.n_layers}) so at least one layer is MoE")
        check(self.attention in ATTENTIONS, "attention", f"must be one of {', '.join(ATTENTIONS)}, got "
                                                         f"{self.attention!r}")
        if self.attention == "gqa":
            self._check_gqa()
        else:
            self._check_mla()
        self._check_routing()
        check(self.n_shared_experts >= 0, "n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
        for key in ("dim", "expert_ffn_dim"):
            check(getattr(self, key) % GROUPED_MM_MULTIPLE == 0, key,
                  f"= {getattr(self, key)} must be a multiple of {GROUPED_MM_MULTIPLE} (16-byte rows for the "
                  f"grouped expert GEMM); try {getattr(self, key) + (-getattr(self, key)) % GROUPED_MM_MULTIPLE}")
        for key in ("rope_theta", "norm_eps", "init_std", "route_scale"):
            check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        for key in ("aux_loss_alpha", "bias_update_rate", "mtp_depth", "mtp_loss_weight"):
            check(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")

    def _check_gqa(self):
        check(self.n_kv_heads >= 1, "n_kv_heads", f"must be >= 1, got {self.n_kv_heads}")
        check(self.dim % self.n_heads == 0, "n_heads", f"= {self.n_heads} must divide model.dim = {self.dim}")
        check(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
              f"= {self.n_kv_heads} must divide model.n_heads = {self.n_heads} (grouped-query attention)")
        check(self.head_dim % 2 == 0, "n_heads", f"= {self.n_heads} gives an odd head dim {self.head_dim}; RoPE needs "
                                                 f"it even")

    def _check_mla(self):
        check(self.q_lora_rank >= 0, "q_lora_rank", f"must be >= 0 (0: direct wq), got {self.q_lora_rank}")
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"must be even for RoPE, got {self.qk_rope_head_dim}")

    def _check_routing(self):
        check(self.top_k <= self.n_experts, "top_k", f"= {self.top_k} must be <= model.n_experts = {self.n_experts}")
        check(self.score_func in moe.SCORE_FUNCS, "score_func",
              f"must be one of {', '.join(moe.SCORE_FUNCS)}, got {self.score_func!r}")
        check(self.n_experts % self.n_groups == 0, "n_groups",
              f"= {self.n_groups} must divide model.n_experts = {self.n_experts}")
        check(self.topk_groups <= self.n_groups, "topk_groups",
              f"= {self.topk_groups} must be <= model.n_groups = {self.n_groups}")
        if self.n_groups > 1:
            per_group = self.n_experts // self.n_groups
            check(per_group >= 2, "n_groups", f"= {self.n_groups} leaves {per_group} expert per group; a group "
                  f"scores its top-2 experts, so use at most {self.n_experts // 2} groups")
            check(self.top_k <= self.topk_groups * per_group, "top_k",
                  f"= {self.top_k} exceeds the {self.topk_groups * per_group} experts in model.topk_groups = "
                  f"{self.topk_groups} groups of {per_group}")

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """A validated Config from the ``model`` section of a run config (without ``name``).

        Raises:
            ValueError: naming the key (``model.top_k``) for unknown keys, wrong types or
                inconsistent sizes.

        Example:
            Config.from_dict({"n_experts": 16, "top_k": 4, "n_groups": 4, "topk_groups": 2})
        """
        return config_from_dict(cls, d)


# ----------------------------------------------------------------------------- parameters


def _attention_table(cfg: Config) -> dict:
    D, H, std = cfg.dim, cfg.n_heads, cfg.init_std
    if cfg.attention == "gqa":
        hd = cfg.head_dim
        return {
            "wq": normal((D, H * hd), ("embed", "heads"), std),
            "wk": normal((D, cfg.n_kv_heads * hd), ("embed", "kv_heads"), std),
            "wv": normal((D, cfg.n_kv_heads * hd), ("embed", "kv_heads"), std),
            "wo": normal((H * hd, D), ("heads", "embed"), std),
        }
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        q = {"wq_a": normal((D, cfg.q_lora_rank), ("embed", "q_lora"), std),
             "q_norm": ones((cfg.q_lora_rank,), ("norm",)),
             "wq_b": normal((cfg.q_lora_rank, H * qk), ("q_lora", "heads"), std)}
    else:
        q = {"wq": normal((D, H * qk), ("embed", "heads"), std)}
    return {
        **q,
        "wkv_a": normal((D, cfg.kv_lora_rank + cfg.qk_rope_head_dim), ("embed", None), std),
        "kv_norm": ones((cfg.kv_lora_rank,), ("norm",)),
        "wkv_b": normal((cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim)), ("kv_lora", "heads"), std),
        "wo": normal((H * cfg.v_head_dim, D), ("heads", "embed"), std),
    }


def _swiglu_table(dim: int, hidden: int, std: float) -> dict:
    return {"w1": normal((dim, hidden), ("embed", "mlp"), std),
            "w3": normal((dim, hidden), ("embed", "mlp"), std),
            "w2": normal((hidden, dim), ("mlp", "embed"), std)}


def _moe_table(cfg: Config) -> dict:
    D, E, Fe, std = cfg.dim, cfg.n_experts, cfg.expert_ffn_dim, cfg.init_std
    table = {
        "router": normal((D, E), ("embed", None), std),
        "router_bias": zeros((E,), (None,)),
        "experts": {"w1": normal((E, D, Fe), ("expert", "embed", "expert_mlp"), std),
                    "w3": normal((E, D, Fe), ("expert", "embed", "expert_mlp"), std),
                    "w2": normal((E, Fe, D), ("expert", "expert_mlp", "embed"), std)},
    }
    if cfg.n_shared_experts:
        table["shared"] = _swiglu_table(D, cfg.n_shared_experts * Fe, std)
    return table


def param_table(cfg: Config) -> PyTree:
    """Every parameter's shape, logical axes and initialiser (see the module docstring)."""
    D, V, std = cfg.dim, cfg.vocab_size, cfg.init_std

    def layer(ffn: dict) -> dict:
        return {"attn_norm": ones((D,), ("norm",)), "attn": _attention_table(cfg), "mlp_norm": ones((D,), ("norm",)),
                **ffn}

    table = {"embed": normal((V, D), ("vocab", "embed"), std)}
    if cfg.first_k_dense:
        table["dense_layers"] = stacked(cfg.first_k_dense, layer({"mlp": _swiglu_table(D, cfg.ffn_dim, std)}))
    table["moe_layers"] = stacked(cfg.n_moe_layers, layer(_moe_table(cfg)))
    table["norm"] = ones((D,), ("norm",))
    if not cfg.tie_embeddings:
        table["out"] = normal((D, V), ("embed", "vocab"), std)
    if cfg.mtp_depth:
        table["mtp"] = stacked(cfg.mtp_depth, {
            "enorm": ones((D,), ("norm",)), "hnorm": ones((D,), ("norm",)),
            "eh_proj": normal((2 * D, D), (None, "embed"), std),
            "block": layer(_moe_table(cfg)), "norm": ones((D,), ("norm",))})
    return table


# ----------------------------------------------------------------------------- facts for the layers above


FROZEN = ("moe_layers.router_bias", "mtp.block.router_bias")
"""Parameters the optimizer leaves alone: the routers' selection bias moves by :func:`aux_update`."""


def stacks(cfg: Config) -> list[tuple[str, int]]:
    """The stacked-layer subtrees, in network order, with their layer counts (empty ones left out).
    The multi-token-prediction modules (``mtp``, stacked over depth) are not in this sequence:
    they branch off the main model's last hidden state.

    Example:
        stacks(Config())  # [("dense_layers", 1), ("moe_layers", 2)]
    """
    return [(k, n) for k, n in (("dense_layers", cfg.first_k_dense), ("moe_layers", cfg.n_moe_layers)) if n > 0]


def pipeline_refusal(cfg: Config) -> tuple[str, str] | None:
    """``(config key, why)`` when the model cannot be split into pipeline stages yet, else None:
    the multi-token-prediction modules branch off the last hidden state and reuse the embedding.

    Example:
        pipeline_refusal(Config(mtp_depth=1))[0]  # "model.mtp_depth"
    """
    if cfg.mtp_depth:
        return ("model.mtp_depth", f"{cfg.mtp_depth}: the multi-token-prediction modules do not run in pipeline "
                                   f"stages yet; set model.mtp_depth=0")
    return None


def context_refusal(cfg: Config) -> tuple[str, str] | None:
    """``(config key, why)`` when the model cannot take its tokens reordered (``batch["positions"]``):
    multi-token prediction shifts the tokens in order.

    Example:
        context_refusal(Config(mtp_depth=1))[0]  # "model.mtp_depth"
    """
    if cfg.mtp_depth:
        return ("model.mtp_depth", f"{cfg.mtp_depth}: multi-token prediction shifts the tokens in order; "
                                   f"set model.mtp_depth=0")
    return None


def with_layers(cfg: Config, counts: dict) -> Config:
    """``cfg`` with ``counts[stack]`` layers in each stack (a reduced model the planner traces).

    Example:
        with_layers(Config(), {"dense_layers": 1, "moe_layers": 1}).n_layers  # 2
    """
    dense = counts.get("dense_layers", 0)
    return dataclasses.replace(cfg, first_k_dense=dense, n_layers=dense + counts.get("moe_layers", 0))


def attention_shape(cfg: Config) -> tuple[int, int, int]:
    """``(heads, query/key head dim, value head dim)``, for attention FLOPs."""
    if cfg.attention == "mla":
        return cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.n_heads, cfg.head_dim, cfg.head_dim


def kv_width(cfg: Config) -> int:
    """Elements of K plus V per token that attention reads (what context parallelism gathers):
    MLA's per-head keys and values after ``wkv_b`` expands the latent."""
    if cfg.attention == "mla":
        return cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return 2 * cfg.n_kv_heads * cfg.head_dim


def aux_update(params: PyTree, aux: dict, cfg: Config) -> PyTree:
    """``params`` after the step's non-gradient update: each router's selection bias moved by
    auxiliary-loss-free balancing (:func:`shardfn.core.moe.update_expert_bias`) from
    ``aux["expert_counts"]``, whose rows are the ``moe_layers`` the tree holds (a pipeline stage
    passes the counts of its own layers).

    Example:
        params = aux_update(params, aux, cfg)   # aux from loss_and_aux
    """
    layers = params.get("moe_layers", {}) if isinstance(params, dict) else {}
    if "router_bias" in layers:
        bias = moe.update_expert_bias(layers["router_bias"], aux["expert_counts"], cfg.bias_update_rate)
        params = {**params, "moe_layers": {**layers, "router_bias": bias}}
    mtp = params.get("mtp", {}) if isinstance(params, dict) else {}
    if "router_bias" in mtp.get("block", {}) and "mtp_expert_counts" in aux:
        bias = moe.update_expert_bias(mtp["block"]["router_bias"], aux["mtp_expert_counts"], cfg.bias_update_rate)
        params = {**params, "mtp": {**mtp, "block": {**mtp["block"], "router_bias": bias}}}
    return params


def aux_metrics(aux: dict) -> dict[str, torch.Tensor]:
    """Per MoE layer ``i``, ``expert_load_max_over_mean/i``: the most-loaded expert's tokens over
    the mean, from ``aux["expert_counts"]`` ``[n_moe_layers, n_experts]``; per MTP depth ``k``
    (``aux["mtp_expert_counts"]``), ``expert_load_max_over_mean/mtp{k}``.

    Example:
        aux_metrics({"expert_counts": torch.tensor([[4, 0, 2, 2]])})  # {"expert_load_max_over_mean/0": tensor(2.)}
    """
    out = {}
    for key, name in (("expert_counts", "{i}"), ("mtp_expert_counts", "mtp{i}")):
        if key not in aux:
            continue
        counts = aux[key].to(torch.float32)
        load = counts.amax(-1) / counts.mean(-1).clamp_min(1.0)
        out.update({"expert_load_max_over_mean/" + name.format(i=i + (key != "expert_counts")): load[i]
                    for i in range(load.shape[0])})
    return out


HF_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
"""Hugging Face ``model_type`` values this model loads (``DeepseekV3ForCausalLM``)."""
HF_ARCHITECTURE = "DeepseekV3ForCausalLM"
"""The ``architectures`` entry of the ``config.json`` that ``models.hf.save`` writes."""


def _hf_mla(stack: str, layers: tuple[int, ...], cfg: Config, rope_interleave: bool) -> list[HFTensor]:
    a, k = f"{stack}.attn", "model.layers.{i}.self_attn"
    n, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_rope = (n + r, n, r) if rope_interleave else None
    kv_rope = (cfg.kv_lora_rank + r, cfg.kv_lora_rank, r) if rope_interleave else None
    if cfg.q_lora_rank:
        q = [hf_names.linear(f"{a}.wq_a", f"{k}.q_a_proj.weight", layers),
             HFTensor(f"{a}.q_norm", f"{k}.q_a_layernorm.weight", layers),
             hf_names.linear(f"{a}.wq_b", f"{k}.q_b_proj.weight", layers, rope=q_rope)]
    else:
        q = [hf_names.linear(f"{a}.wq", f"{k}.q_proj.weight", layers, rope=q_rope)]
    return q + [
        hf_names.linear(f"{a}.wkv_a", f"{k}.kv_a_proj_with_mqa.weight", layers, rope=kv_rope),
        HFTensor(f"{a}.kv_norm", f"{k}.kv_a_layernorm.weight", layers),
        hf_names.linear(f"{a}.wkv_b", f"{k}.kv_b_proj.weight", layers),
        hf_names.linear(f"{a}.wo", f"{k}.o_proj.weight", layers),
    ]


def hf_tensors(cfg: Config, *, rope_interleave: bool | None = None) -> list[HFTensor]:
    """Every parameter and the HF tensors it is made of (see ``models.hf``). HF layers
    ``0 .. first_k_dense-1`` are ``dense_layers``, the rest ``moe_layers``, and layers
    ``n_layers .. n_layers+mtp_depth-1`` the multi-token-prediction modules (``mtp``).

    ``rope_interleave`` (MLA; default True, as HF DeepSeek-V3): the q/k rope rows are stored
    interleaved and are permuted once at load to our rotate-half layout.

    Example:
        [t.path for t in hf_tensors(Config())][-1]  # 'moe_layers.shared.w2'
    """
    interleave = True if rope_interleave is None else rope_interleave

    def stack(name: str, layers: tuple[int, ...]) -> list[HFTensor]:
        attn = (hf_names.gqa_attention(name, layers) if cfg.attention == "gqa"
                else _hf_mla(name, layers, cfg, interleave))
        return hf_names.norms(name, layers) + attn

    out = hf_names.outer(cfg.tie_embeddings)
    dense, routed = tuple(range(cfg.first_k_dense)), tuple(range(cfg.first_k_dense, cfg.n_layers))
    if dense:
        out += stack("dense_layers", dense) + hf_names.swiglu("dense_layers.mlp", "model.layers.{i}.mlp", dense)
    out += stack("moe_layers", routed) + _hf_moe_ffn("moe_layers", routed, cfg)
    if cfg.mtp_depth:
        depths = tuple(range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth))
        out += _hf_mtp(depths, cfg) + stack("mtp.block", depths) + _hf_moe_ffn("mtp.block", depths, cfg)
    return out


def _hf_moe_ffn(stack: str, layers: tuple[int, ...], cfg: Config) -> list[HFTensor]:
    mlp = "model.layers.{i}.mlp"
    out = [hf_names.linear(f"{stack}.router", f"{mlp}.gate.weight", layers),
           HFTensor(f"{stack}.router_bias", f"{mlp}.gate.e_score_correction_bias", layers)]
    out += hf_names.swiglu(f"{stack}.experts", f"{mlp}.experts.{{e}}", layers, cfg.n_experts)
    if cfg.n_shared_experts:
        out += hf_names.swiglu(f"{stack}.shared", f"{mlp}.shared_experts", layers)
    return out


def _hf_mtp(layers: tuple[int, ...], cfg: Config) -> list[HFTensor]:
    """The MTP modules' own tensors, and the copies HF keeps of the shared embedding and head
    (written by ``models.hf.save``, never read: the modules use the main model's)."""
    k = "model.layers.{i}"
    head = (HFTensor("embed", f"{k}.shared_head.head.weight", layers, copy=True) if cfg.tie_embeddings
            else hf_names.linear("out", f"{k}.shared_head.head.weight", layers, copy=True))
    return [HFTensor("mtp.enorm", f"{k}.enorm.weight", layers), HFTensor("mtp.hnorm", f"{k}.hnorm.weight", layers),
            hf_names.linear("mtp.eh_proj", f"{k}.eh_proj.weight", layers),
            HFTensor("mtp.norm", f"{k}.shared_head.norm.weight", layers),
            HFTensor("embed", f"{k}.embed_tokens.weight", layers, copy=True), head]


def hf_config_keys(cfg: Config) -> dict[str, str]:
    """``config.json`` key -> Config field, for checking a checkpoint's config against ours."""
    keys = {**hf_names.COMMON_CONFIG_KEYS, "first_k_dense_replace": "first_k_dense", "q_lora_rank": "q_lora_rank",
            "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
            "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "n_routed_experts": "n_experts",
            "num_experts_per_tok": "top_k", "n_shared_experts": "n_shared_experts",
            "moe_intermediate_size": "expert_ffn_dim", "scoring_func": "score_func", "n_group": "n_groups",
            "topk_group": "topk_groups", "routed_scaling_factor": "route_scale", "norm_topk_prob": "norm_topk_prob",
            "num_nextn_predict_layers": "mtp_depth"}
    return {**keys, **hf_names.GQA_CONFIG_KEYS} if cfg.attention == "gqa" else keys


# ----------------------------------------------------------------------------- forward


def _attention(p: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    if cfg.attention == "gqa":
        return L.gqa_attention(p, x, cos, sin, head_dim=cfg.head_dim, positions=positions)
    scale = L.rope_softmax_factor(cfg.rope_scaling) / (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** 0.5
    return L.mla_attention(p, x, cos, sin, qk_nope_head_dim=cfg.qk_nope_head_dim,
                           qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, norm_eps=MLA_NORM_EPS,
                           scale=scale, positions=positions)


@repeated
def dense_block(p: PyTree, h: torch.Tensor, cos, sin, cfg: Config, positions=None) -> torch.Tensor:
    """One dense layer; ``p`` is a slice of ``params["dense_layers"]``."""
    h = h + _attention(p["attn"], L.rms_norm(h, p["attn_norm"], cfg.norm_eps), cos, sin, cfg, positions)
    return h + L.swiglu(p["mlp"], L.rms_norm(h, p["mlp_norm"], cfg.norm_eps))   # [B, S, D]


def moe_block(p: PyTree, h: torch.Tensor, cos, sin, cfg: Config, experts=None,
              positions=None) -> tuple[torch.Tensor, dict]:
    """One MoE layer; ``p`` is a slice of ``params["moe_layers"]``. Returns ``(h, aux)``.
    ``experts`` runs the routed experts (``core.moe.moe_layer``'s ``routed_fn``; None: this device).
    ``positions`` ``[B, S]``: the tokens' positions when they are not in order (``llama.apply``)."""
    h = h + _attention(p["attn"], L.rms_norm(h, p["attn_norm"], cfg.norm_eps), cos, sin, cfg, positions)
    y, aux = moe.moe_layer(p, L.rms_norm(h, p["mlp_norm"], cfg.norm_eps), cfg, routed_fn=experts)
    return h + y, aux                                                            # [B, S, D]


def _hidden(params: PyTree, tokens: torch.Tensor, cfg: Config, experts=None, positions=None):
    """The main model's final-normed hidden state ``[B, S, D]``, the RoPE tables and ``aux``.
    ``positions`` ``[B, S]``: the tokens' positions when they are not in order (``llama.apply``)."""
    h = L.embedding(params["embed"], tokens)                                      # [B, S, D]
    cos, sin = L.rope_tables(tokens.shape[1], cfg.rope_dim, cfg.rope_theta, scaling=cfg.rope_scaling,
                             device=h.device, dtype=h.dtype)
    if positions is not None:
        cos, sin = L.rope_at(cos, sin, positions)                                 # [B, 1, S, rope]
    for i, p in enumerate(L.unstack(params["dense_layers"], cfg.first_k_dense) if cfg.first_k_dense else []):
        with L.scope(f"shardfn.layer.{i}"):
            h = dense_block(p, h, cos, sin, cfg, positions)
    counts, balance = [], []
    for i, p in enumerate(L.unstack(params["moe_layers"], cfg.n_moe_layers)):
        with L.scope(f"shardfn.layer.{cfg.first_k_dense + i}"):
            h, aux = moe_block(p, h, cos, sin, cfg, experts, positions)
        counts.append(aux["expert_counts"])
        balance.append(aux["balance_loss"])
    h = L.rms_norm(h, params["norm"], cfg.norm_eps)
    aux = {"expert_counts": torch.stack(counts), "balance_loss": torch.stack(balance).sum()}
    return h, cos, sin, aux


def _head(params: PyTree, cfg: Config) -> torch.Tensor:
    return params["embed"].t() if cfg.tie_embeddings else params["out"]          # [D, V]


def apply_with_aux(params: PyTree, tokens: torch.Tensor, cfg: Config, *, experts=None,
                   positions=None) -> tuple[torch.Tensor, dict]:
    """Logits ``[B, S, vocab]`` and ``aux``: ``expert_counts`` ``[n_moe_layers, E]`` int64 and
    ``balance_loss`` (0-d, the sum over layers, already times ``aux_loss_alpha``). The
    multi-token-prediction modules do not run (:func:`apply_with_mtp` runs them).

    Example:
        logits, aux = apply_with_aux(params, tokens, cfg)
    """
    h, _, _, aux = _hidden(params, tokens, cfg, experts, positions)
    return L.linear(h, _head(params, cfg)), aux                                   # [B, S, V]


def mtp_block(p: PyTree, h: torch.Tensor, emb: torch.Tensor, cos, sin, cfg: Config,
              experts=None) -> tuple[torch.Tensor, dict]:
    """One multi-token-prediction module (DeepSeek-V3): ``eh_proj [enorm(emb); hnorm(h)]``, then
    one MoE layer. ``p`` is a slice of ``params["mtp"]``; ``h`` ``[B, S', D]`` the previous
    depth's hidden state, ``emb`` ``[B, S', D]`` the embeddings of the tokens ``k`` ahead.
    Returns ``(h_k, aux)``, ``h_k`` ``[B, S', D]`` before the module's ``norm``.

    Example:
        h1, aux = mtp_block(tree_map(lambda w: w[0], params["mtp"]), h[:, :-1], emb, cos, sin, cfg)
    """
    x = torch.cat([L.rms_norm(emb, p["enorm"], cfg.norm_eps), L.rms_norm(h, p["hnorm"], cfg.norm_eps)], -1)
    return moe_block(p["block"], L.linear(x, p["eh_proj"]), cos, sin, cfg, experts)   # [B, S', 2D] -> [B, S', D]


def apply_with_mtp(params: PyTree, tokens: torch.Tensor, cfg: Config, *,
                   experts=None) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """Main logits ``[B, S, V]``, the logits of each multi-token-prediction depth ``k = 1 ..
    mtp_depth`` (``[B, S-k, V]``: position ``i`` predicts token ``i+k+1``) and ``aux``
    (:func:`apply_with_aux`'s, with ``mtp_expert_counts`` ``[mtp_depth, E]`` and the MTP
    layers' balance loss added to ``balance_loss``).

    Depth ``k`` combines position ``i``'s hidden state of depth ``k-1`` with the embedding of
    token ``i+k`` (``tokens[:, k:]``), so it covers the ``S-k`` positions whose token ``i+k`` is
    an input. Depth 1 starts from the main model's final-normed hidden state (the state
    DeepSeek-V3's MTP weights are served and trained on in vLLM, SGLang and Megatron-LM); depth
    ``k+1`` from depth ``k``'s block output, before the module's ``norm`` (the report's
    ``h^k``). Every depth predicts with the main model's embedding and output head.

    Example:
        logits, mtp_logits, aux = apply_with_mtp(params, tokens, Config(mtp_depth=1))
        mtp_logits[0].shape  # [B, S - 1, vocab]
    """
    if cfg.mtp_depth >= tokens.shape[1]:
        raise ValueError(f"model.mtp_depth={cfg.mtp_depth} needs sequences longer than {cfg.mtp_depth} tokens "
                         f"(depth k predicts token i+k+1 from token i+k), got {tokens.shape[1]}; raise "
                         f"train.seq_len or lower model.mtp_depth")
    h, cos, sin, aux = _hidden(params, tokens, cfg, experts)
    head = _head(params, cfg)
    logits, depths, counts, balance = L.linear(h, head), [], [], [aux["balance_loss"]]
    for k in range(1, cfg.mtp_depth + 1):
        n = tokens.shape[1] - k
        with L.scope(f"shardfn.mtp.{k}"):
            p = tree_map(lambda w: w[k - 1], params["mtp"])
            emb = L.embedding(params["embed"], tokens[:, k:])                        # [B, S-k, D]: tokens i+k
            h, mtp_aux = mtp_block(p, h[:, :n], emb, cos[:n], sin[:n], cfg, experts)
            depths.append(L.linear(L.rms_norm(h, p["norm"], cfg.norm_eps), head))  # [B, S-k, V]
        counts.append(mtp_aux["expert_counts"])
        balance.append(mtp_aux["balance_loss"])
    if counts:
        aux = {**aux, "mtp_expert_counts": torch.stack(counts), "balance_loss": torch.stack(balance).sum()}
    return logits, depths, aux


def apply(params: PyTree, tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` for ``tokens [B, S]`` int64.

    Example:
        logits = apply(models.get("moe").init(Config(), 0), torch.zeros(2, 16, dtype=torch.long), Config())
    """
    return apply_with_aux(params, tokens, cfg)[0]


def mtp_loss(depths: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """The mean over depths of each depth's mean cross-entropy: depth ``k``'s logits ``[B, S-k, V]``
    against ``targets[:, k:]`` (``targets`` ``[B, S]`` are the next tokens of the inputs).
    DeepSeek-V3 writes each depth's sum over its ``S-k`` positions divided by ``S``; here it is
    their mean, as Megatron-LM computes it.

    Example:
        mtp_loss([torch.zeros(2, 15, 256)], torch.zeros(2, 16, dtype=torch.long))  # log(256)
    """
    return torch.stack([cross_entropy(x, targets[:, k:]) for k, x in enumerate(depths, 1)]).mean()


def loss_and_aux(params: PyTree, batch: dict, cfg: Config, *, experts=None) -> tuple[torch.Tensor, dict]:
    """Training loss (mean cross-entropy + balance loss, + ``mtp_loss_weight`` times the
    multi-token-prediction loss when ``mtp_depth > 0``) and ``aux``.

    ``aux``: ``expert_counts`` ``[n_moe_layers, n_experts]`` (tokens routed to each expert; feed
    it to ``core.moe.update_expert_bias`` for ``moe_layers.router_bias``), ``balance_loss`` and
    ``ce_loss`` (0-d); with MTP also ``mtp_loss`` (0-d, :func:`mtp_loss`, before the weight) and
    ``mtp_expert_counts`` ``[mtp_depth, n_experts]``. ``experts``: how the routed experts run,
    ``(x, indices, weights, w1, w2, w3) -> y`` (None: on this device,
    ``core.moe.routed_experts``); a layout passes its per-rank region (expert parallelism)
    here, and the model code does not change.

    Example:
        (value, aux), grads = value_and_grad(loss_and_aux, has_aux=True)(params, batch, cfg)
    """
    if not cfg.mtp_depth:  # batch["positions"]: the tokens' positions when a layout reordered them
        logits, aux = apply_with_aux(params, batch["inputs"], cfg, experts=experts, positions=batch.get("positions"))
        ce = cross_entropy(logits, batch["targets"])
        return ce + aux["balance_loss"], {**aux, "ce_loss": ce.detach()}
    if "positions" in batch:
        raise ValueError("model.mtp_depth > 0 reads the tokens in order (depth k shifts them by k), but the batch "
                         "has reordered tokens (batch['positions']); set model.mtp_depth=0")
    logits, depths, aux = apply_with_mtp(params, batch["inputs"], cfg, experts=experts)
    ce, mtp = cross_entropy(logits, batch["targets"]), mtp_loss(depths, batch["targets"])
    value = ce + aux["balance_loss"] + cfg.mtp_loss_weight * mtp
    return value, {**aux, "ce_loss": ce.detach(), "mtp_loss": mtp.detach()}
