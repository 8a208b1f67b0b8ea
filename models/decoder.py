"""The grouped-query decoder that Qwen2, Qwen3, Mistral, Qwen3-MoE, Qwen2-MoE and Mixtral share, as pure functions.

Each family is a module of its own (``models.qwen3``, ``models.qwen2``, ``models.mistral``,
``models.qwen3_moe``, ``models.qwen2_moe``, ``models.mixtral``) whose ``Config`` subclasses :class:`Config` here and
fixes, as class constants, what makes the family (``QK_NORM``, ``QKV_BIAS``, the HF names of its
experts); the math and the parameter table are these. Every layer is pre-norm:

    h = h + attention(rms_norm(h))      # GQA; + q/k/v biases (Qwen2); + QK-norm (Qwen3); window (Mistral)
    h = h + mlp(rms_norm(h))            # SwiGLU, or a softmax top-k mixture of experts (Qwen3-MoE, Mixtral;
                                        # Qwen2-MoE adds a shared expert behind a sigmoid gate)

Parameters (``L`` layers, ``D`` dim, ``H``/``Hkv`` heads, ``hd`` head dim, ``F`` ffn dim, ``E``
experts, ``Fe`` expert ffn dim, ``V`` vocab):

    embed                  [V, D]          (vocab, embed)
    layers.attn_norm       [L, D]          (layers, norm)
    layers.attn.wq         [L, D, H*hd]    (layers, embed, heads);  wk, wv [L, D, Hkv*hd]; wo [L, H*hd, D]
    layers.attn.bq         [L, H*hd]       (layers, heads);  bk, bv [L, Hkv*hd]        QKV_BIAS only
    layers.attn.q_norm     [L, hd]         (layers, norm);  k_norm the same           QK_NORM only
    layers.mlp_norm        [L, D]          (layers, norm)
    layers.mlp.w1, w3      [L, D, F]       (layers, embed, mlp);  w2 [L, F, D]        dense layers
    layers.router          [L, D, E]       (layers, embed, None)                      MoE layers
    layers.experts.w1, w3  [L, E, D, Fe]   (layers, expert, embed, expert_mlp);  w2 [L, E, Fe, D]
    layers.shared.w1, w3   [L, D, Fs]      (layers, embed, mlp);  w2 [L, Fs, D]       Qwen2-MoE's shared expert
    layers.shared_gate     [L, D, 1]       (layers, embed, None)
    norm                   [D]             (norm,)
    out                    [D, V]          (embed, vocab)      absent when tie_embeddings

An MoE config whose layers are not all MoE (``mlp_only_layers``, ``decoder_sparse_step``) holds
two stacks, ``dense_layers`` and ``moe_layers``, run in the Hugging Face layer order. RoPE is
"rotate half", Hugging Face's own layout, so no weight is permuted at load. No parallelism here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from shardfn.core import layers as L
from shardfn.core import moe
from shardfn.core.init import normal, ones, stacked
from shardfn.core.layers import RopeScaling
from shardfn.core.pytree import PyTree
from shardfn.core.regional import repeated
from shardfn.models import hf_names
from shardfn.models.contract import check, config_from_dict
from shardfn.models.hf_names import HFTensor


@dataclass(frozen=True)
class Config:
    """Sizes every family shares; a family's Config adds its own fields and constants.

    ``head_dim``: None means ``dim // n_heads`` (Qwen3 sets it: Qwen3-32B has ``64 * 128 != 5120``).
    """

    QK_NORM: ClassVar[bool] = False      # RMSNorm over each head's query and key, before RoPE (Qwen3)
    QKV_BIAS: ClassVar[bool] = False     # biases on the q, k and v projections (Qwen2)
    HF_EXPERTS: ClassVar[str] = "qwen"   # HF names of the experts: "qwen" (mlp.experts.{e}.gate_proj) or "mixtral"

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None
    ffn_dim: int = 128
    rope_theta: float = 1000000.0
    rope_scaling: RopeScaling | None = None   # llama3 | yarn (core.layers.RopeScaling); None: plain RoPE
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling, where="model.rope_scaling"))
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        if self.head_dim is None:
            check(self.dim % self.n_heads == 0, "n_heads",
                  f"= {self.n_heads} must divide model.dim = {self.dim} (or give model.head_dim)")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        check(isinstance(self.head_dim, int) and self.head_dim >= 2 and self.head_dim % 2 == 0, "head_dim",
              f"must be an even int (RoPE rotates pairs), got {self.head_dim!r}")
        check(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
              f"= {self.n_kv_heads} must divide model.n_heads = {self.n_heads} (grouped-query attention)")
        check(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        check(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        check(self.init_std > 0, "init_std", f"must be > 0, got {self.init_std}")

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """A validated Config from the ``model`` section of a run config (without ``name``).

        Example:
            models.get("qwen3").Config.from_dict({"dim": 128, "n_heads": 8, "head_dim": 32})
        """
        return config_from_dict(cls, d)

    # ---- what the layers hold (the MoE families override these)

    @property
    def window(self) -> int:
        """Keys each query reads (0: all before it)."""
        return 0

    def moe_layers(self) -> tuple[int, ...]:
        """The HF indices of the layers whose feed-forward is a mixture of experts."""
        return ()


@dataclass(frozen=True)
class MoEConfig(Config):
    """A decoder whose feed-forward is a softmax top-k mixture of experts, in every layer that
    ``decoder_sparse_step`` and ``mlp_only_layers`` leave MoE (Hugging Face's rule: layer ``i``
    is MoE iff ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``); the others
    are dense SwiGLU of ``ffn_dim``. ``norm_topk_prob``: the top-k weights renormalised to sum
    to 1 (Mixtral: always; Qwen3-MoE: its config says)."""

    n_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        check(self.n_experts >= 1, "n_experts", f"must be >= 1, got {self.n_experts}")
        check(1 <= self.top_k <= self.n_experts, "top_k", f"must be in 1 .. model.n_experts, got {self.top_k}")
        check(self.expert_ffn_dim >= 1, "expert_ffn_dim", f"must be >= 1, got {self.expert_ffn_dim}")
        check(self.decoder_sparse_step >= 1, "decoder_sparse_step", f"must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        check(not bad, "mlp_only_layers", f"names layers {bad} outside 0 .. model.n_layers-1")

    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)


# ----------------------------------------------------------------------------- parameters


def _layer_table(cfg: Config, is_moe: bool) -> dict:
    D, hd, std = cfg.dim, cfg.head_dim, cfg.init_std
    H, Hkv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    attn = {"wq": normal((D, H), ("embed", "heads"), std), "wk": normal((D, Hkv), ("embed", "kv_heads"), std),
            "wv": normal((D, Hkv), ("embed", "kv_heads"), std), "wo": normal((H, D), ("heads", "embed"), std)}
    if cfg.QKV_BIAS:
        attn.update(bq=normal((H,), ("heads",), std), bk=normal((Hkv,), ("kv_heads",), std),
                    bv=normal((Hkv,), ("kv_heads",), std))
    if cfg.QK_NORM:
        attn.update(q_norm=ones((hd,), ("norm",)), k_norm=ones((hd,), ("norm",)))
    layer = {"attn_norm": ones((D,), ("norm",)), "attn": attn, "mlp_norm": ones((D,), ("norm",))}
    if not is_moe:
        F_ = cfg.ffn_dim
        layer["mlp"] = {"w1": normal((D, F_), ("embed", "mlp"), std), "w3": normal((D, F_), ("embed", "mlp"), std),
                        "w2": normal((F_, D), ("mlp", "embed"), std)}
        return layer
    E, Fe, Fs = cfg.n_experts, cfg.expert_ffn_dim, getattr(cfg, "shared_expert_ffn_dim", 0)
    layer["router"] = normal((D, E), ("embed", None), std)
    if Fs:  # Qwen2-MoE: one shared expert, scaled by a sigmoid gate of its own
        layer["shared"] = {"w1": normal((D, Fs), ("embed", "mlp"), std), "w3": normal((D, Fs), ("embed", "mlp"), std),
                           "w2": normal((Fs, D), ("mlp", "embed"), std)}
        layer["shared_gate"] = normal((D, 1), ("embed", None), std)
    layer["experts"] = {"w1": normal((E, D, Fe), ("expert", "embed", "expert_mlp"), std),
                        "w3": normal((E, D, Fe), ("expert", "embed", "expert_mlp"), std),
                        "w2": normal((E, Fe, D), ("expert", "expert_mlp", "embed"), std)}
    return layer


def layer_stacks(cfg: Config) -> list[tuple[str, tuple[int, ...], bool]]:
    """``(stack, HF layer indices, is MoE)`` for each parameter stack, in table order.

    Example:
        layer_stacks(qwen3_moe.Config(n_layers=4, mlp_only_layers=(0,)))
        # [('dense_layers', (0,), False), ('moe_layers', (1, 2, 3), True)]
    """
    sparse = set(cfg.moe_layers())
    every = tuple(range(cfg.n_layers))
    if not sparse:
        return [("layers", every, False)]
    if len(sparse) == cfg.n_layers:
        return [("layers", every, True)]
    return [("dense_layers", tuple(i for i in every if i not in sparse), False),
            ("moe_layers", tuple(sorted(sparse)), True)]


def param_table(cfg: Config) -> PyTree:
    """Every parameter's shape, logical axes and initialiser (see the module docstring)."""
    V, D, std = cfg.vocab_size, cfg.dim, cfg.init_std
    table = {"embed": normal((V, D), ("vocab", "embed"), std)}
    for name, layers, is_moe in layer_stacks(cfg):
        table[name] = stacked(len(layers), _layer_table(cfg, is_moe))
    table["norm"] = ones((D,), ("norm",))
    if not cfg.tie_embeddings:
        table["out"] = normal((D, V), ("embed", "vocab"), std)
    return table


# ----------------------------------------------------------------------------- forward


def _heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, -1, hd).transpose(1, 2)                                   # [B, S, H*hd] -> [B, H, S, hd]


def attention(p: PyTree, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention with the family's biases, QK-norm and sliding window. ``[B, S, D]``."""
    hd, eps = cfg.head_dim, cfg.norm_eps
    q = _heads(L.linear(x, p["wq"], p.get("bq")), hd)                             # [B, H, S, hd]
    k = _heads(L.linear(x, p["wk"], p.get("bk")), hd)                             # [B, Hkv, S, hd]
    v = _heads(L.linear(x, p["wv"], p.get("bv")), hd)                             # [B, Hkv, S, hd]
    if cfg.QK_NORM:
        q, k = L.rms_norm(q, p["q_norm"], eps), L.rms_norm(k, p["k_norm"], eps)
    q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
    if positions is not None:   # a layout reordered the tokens (a window is refused there: context_refusal)
        out = L.causal_attention(q, k, v, positions)
    elif cfg.window:
        out = L.sliding_window_attention(q, k, v, cfg.window)
    else:
        out = L.attention(q, k, v, causal=True)                                   # [B, H, S, hd]
    b, _, s, _ = out.shape
    return L.linear(out.transpose(1, 2).reshape(b, s, -1), p["wo"])               # [B, S, D]


def route(router: torch.Tensor, x: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every expert (float32), the top-k kept, renormalised when ``norm_topk_prob``.

    Returns:
        ``(indices [T, k] int64, weights [T, k] in x's dtype)``.
    """
    scores = torch.softmax(L.linear(x, router).float(), dim=-1)                    # [T, E]
    weights, indices = scores.topk(cfg.top_k, dim=-1)                              # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return indices, weights.to(x.dtype)


def mixture(p: PyTree, x: torch.Tensor, cfg: MoEConfig, experts=None) -> torch.Tensor:
    """The routed experts of one layer; ``experts`` runs them (None: ``core.moe.routed_experts``)."""
    b, s, d = x.shape
    flat = x.reshape(b * s, d)                                                    # [T, D]
    indices, weights = route(p["router"], flat, cfg)
    e = p["experts"]
    y = (experts or moe.routed_experts)(flat, indices, weights, e["w1"], e["w2"], e["w3"])       # [T, D]
    if "shared" in p:
        y = y + torch.sigmoid(L.linear(flat, p["shared_gate"])) * L.swiglu(p["shared"], flat)
    return y.view(b, s, d)


@repeated
def block(p: PyTree, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config, experts=None,
          positions: torch.Tensor | None = None) -> torch.Tensor:
    """One pre-norm layer; ``p`` is one layer's slice of a stack. ``[B, S, D]``."""
    h = h + attention(p["attn"], L.rms_norm(h, p["attn_norm"], cfg.norm_eps), cos, sin, cfg, positions)
    x = L.rms_norm(h, p["mlp_norm"], cfg.norm_eps)
    return h + (mixture(p, x, cfg, experts) if "router" in p else L.swiglu(p["mlp"], x))


def apply(params: PyTree, tokens: torch.Tensor, cfg: Config, *, positions: torch.Tensor | None = None,
          experts=None) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` for ``tokens`` ``[B, S]`` (``positions`` as in ``models.llama.apply``).

    Example:
        logits = apply(models.get("qwen3").init(cfg, 0), torch.zeros(2, 16, dtype=torch.long), cfg)
    """
    h = L.embedding(params["embed"], tokens)                                      # [B, S, D]
    cos, sin = L.rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta, scaling=cfg.rope_scaling,
                             device=h.device, dtype=h.dtype)
    if positions is not None:
        cos, sin = L.rope_at(cos, sin, positions)                                 # [B, 1, S, hd]
    order = sorted((i, name, j) for name, layers, _ in layer_stacks(cfg) for j, i in enumerate(layers))
    slices = {name: list(L.unstack(params[name], len(layers))) for name, layers, _ in layer_stacks(cfg)}
    for i, name, j in order:
        with L.scope(f"shardfn.layer.{i}"):
            h = block(slices[name][j], h, cos, sin, cfg, experts, positions)
    h = L.rms_norm(h, params["norm"], cfg.norm_eps)
    return L.linear(h, params["embed"].t() if cfg.tie_embeddings else params["out"])  # [B, S, V]


def loss(params: PyTree, batch: dict, cfg: Config, *, experts=None) -> torch.Tensor:
    """Mean cross-entropy of :func:`apply` against ``batch["targets"]``; ``batch["positions"]``
    optional. ``experts``: the routed experts as a function (a layout's all-to-all region).

    Example:
        loss(params, {"inputs": x, "targets": y}, cfg)  # 0-d tensor
    """
    logits = apply(params, batch["inputs"], cfg, positions=batch.get("positions"), experts=experts)
    return L.cross_entropy(logits, batch["targets"])


# ----------------------------------------------------------------------------- contract members


def stacks(cfg: Config) -> list[tuple[str, int]]:
    """The layer stacks in table order."""
    return [(name, len(layers)) for name, layers, _ in layer_stacks(cfg)]


def with_layers(cfg: Config, counts: dict) -> Config:
    """``cfg`` with ``counts[stack]`` layers per stack (dense layers first when there are two)."""
    if "layers" in counts:
        return dataclasses.replace(cfg, n_layers=counts["layers"])
    dense, sparse = counts.get("dense_layers", 0), counts.get("moe_layers", 0)
    return dataclasses.replace(cfg, n_layers=dense + sparse, decoder_sparse_step=1, mlp_only_layers=tuple(range(dense)))


def pipeline_refusal(cfg: Config) -> tuple[str, str] | None:
    """Pipeline stages split the stacks in table order: dense and MoE layers that interleave
    cannot be cut that way."""
    st = layer_stacks(cfg)
    if len(st) == 2 and max(st[0][1]) > min(st[1][1]):
        return ("mlp_only_layers", f"the dense layers {list(st[0][1])} and the MoE layers interleave, but pipeline "
                                   f"stages run the dense_layers stack before the moe_layers stack")
    return None


def context_refusal(cfg: Config) -> tuple[str, str] | None:
    """A sliding window is not computed on reordered tokens (context parallelism)."""
    if cfg.window:
        return ("sliding_window", f"= {cfg.window}: the sliding-window attention is not computed on tokens a "
                                  f"layout reorders; train with model.sliding_window=0 (full causal attention) "
                                  f"or without cp")
    return None


def experts_per_token(cfg: Config) -> int:
    return cfg.top_k if cfg.moe_layers() else 0


# ----------------------------------------------------------------------------- Hugging Face names


def _experts_hf(stack: str, layers: tuple[int, ...], cfg: MoEConfig) -> list[HFTensor]:
    if cfg.HF_EXPERTS == "mixtral":
        m = "model.layers.{i}.block_sparse_moe"
        return [hf_names.linear(f"{stack}.router", m + ".gate.weight", layers)] + [
            hf_names.linear(f"{stack}.experts.{w}", m + f".experts.{{e}}.{w}.weight", layers, experts=cfg.n_experts)
            for w in ("w1", "w3", "w2")]
    m = "model.layers.{i}.mlp"
    out = [hf_names.linear(f"{stack}.router", m + ".gate.weight", layers)] + hf_names.swiglu(
        f"{stack}.experts", m + ".experts.{e}", layers, cfg.n_experts)
    if getattr(cfg, "shared_expert_ffn_dim", 0):
        out += hf_names.swiglu(f"{stack}.shared", m + ".shared_expert", layers)
        out.append(hf_names.linear(f"{stack}.shared_gate", m + ".shared_expert_gate.weight", layers))
    return out


def hf_tensors(cfg: Config, *, rope_interleave: bool | None = None) -> list[HFTensor]:
    """Every parameter and the HF tensors it is made of (see ``models.hf``). Hugging Face stores
    these families' RoPE in our rotate-half layout: nothing is permuted.

    Example:
        [t.key for t in hf_tensors(qwen3.Config())][3]  # 'model.layers.{i}.input_layernorm.weight'
    """
    if rope_interleave:
        raise ValueError("rope_interleave=True: these checkpoints store RoPE in the rotate-half layout")
    out = hf_names.outer(cfg.tie_embeddings)
    for name, layers, is_moe in layer_stacks(cfg):
        out += hf_names.norms(name, layers) + hf_names.gqa_attention(name, layers)
        if cfg.QKV_BIAS:
            out += [HFTensor(f"{name}.attn.b{x}", f"model.layers.{{i}}.self_attn.{x}_proj.bias", layers) for x in "qkv"]
        if cfg.QK_NORM:
            out += [HFTensor(f"{name}.attn.{x}_norm", f"model.layers.{{i}}.self_attn.{x}_norm.weight", layers)
                    for x in "qk"]
        out += _experts_hf(name, layers, cfg) if is_moe else hf_names.swiglu(f"{name}.mlp", "model.layers.{i}.mlp",
                                                                             layers)
    return out


def hf_config_keys(cfg: Config) -> dict[str, str]:
    """``config.json`` key -> Config field, for checking a checkpoint's config against ours."""
    keys = {**hf_names.COMMON_CONFIG_KEYS, **hf_names.GQA_CONFIG_KEYS}
    if isinstance(cfg, MoEConfig):
        keys.update(num_experts_per_tok="top_k", norm_topk_prob="norm_topk_prob")
        if cfg.HF_EXPERTS == "mixtral":
            keys.update(num_local_experts="n_experts", intermediate_size="expert_ffn_dim")
        else:
            keys.update(num_experts="n_experts", moe_intermediate_size="expert_ffn_dim",
                        decoder_sparse_step="decoder_sparse_step", mlp_only_layers="mlp_only_layers")
        if hasattr(cfg, "shared_expert_ffn_dim"):
            keys["shared_expert_intermediate_size"] = "shared_expert_ffn_dim"
    return keys



def hf_config_check(hf: dict, cfg: Config) -> list[tuple[str, str | None]]:
    """``(what, fix)`` for each way a ``config.json`` says something these families do not compute
    or that ``cfg`` disagrees with, beyond the keys of :func:`hf_config_keys`: the window
    (``sliding_window``, null meaning none, for the families that have one; Qwen's
    ``use_sliding_window`` / ``layer_types``, not modelled), biases and the activation."""
    wrong: list[tuple[str, str | None]] = []
    if hasattr(cfg, "sliding_window"):
        if "sliding_window" in hf and (hf["sliding_window"] or 0) != cfg.sliding_window:
            theirs = hf["sliding_window"] or 0
            wrong.append((f"sliding_window={hf['sliding_window']!r} but model.sliding_window={cfg.sliding_window}",
                          f"model.sliding_window={theirs}"))
    else:
        if hf.get("use_sliding_window"):
            wrong.append(("use_sliding_window is true, but sliding-window layers are not modelled for this family",
                          None))
    kinds = sorted({k for k in hf.get("layer_types") or () if k != "full_attention"})
    if kinds and not (hasattr(cfg, "sliding_window") and kinds == ["sliding_attention"] and cfg.sliding_window):
        wrong.append((f"layer_types has {', '.join(kinds)} layers, which this family does not model "
                      f"(every layer here is full causal attention)", None))
    if hf.get("attention_bias") and not cfg.QKV_BIAS:
        wrong.append(("attention_bias is true, but this family has no attention biases", None))
    if "qkv_bias" in hf and bool(hf["qkv_bias"]) != cfg.QKV_BIAS:
        wrong.append((f"qkv_bias is {str(bool(hf['qkv_bias'])).lower()}, but this family "
                      f"{'always has' if cfg.QKV_BIAS else 'has no'} q/k/v biases", None))
    if hf.get("mlp_bias"):
        wrong.append(("mlp_bias is true, but the feed-forward has no biases", None))
    return wrong


def hf_config_extra(cfg: Config) -> dict:
    """``config.json`` keys :func:`models.hf.hf_config` writes beyond :func:`hf_config_keys`,
    so that ``from_pretrained`` rebuilds exactly this model."""
    out: dict = {"attention_bias": cfg.QKV_BIAS, "mlp_bias": False, "max_position_embeddings": 32768}
    if hasattr(cfg, "sliding_window"):
        out["sliding_window"] = cfg.sliding_window or None
    else:
        out.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * cfg.n_layers)
    if isinstance(cfg, MoEConfig):
        out.update(router_aux_loss_coef=0.0, output_router_logits=False)
    if hasattr(cfg, "shared_expert_ffn_dim"):
        out["qkv_bias"] = cfg.QKV_BIAS
    return out
