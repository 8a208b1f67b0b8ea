"""The vocabulary the models use to name their Hugging Face tensors.

Each model module says which HF tensors make each of its parameters (``hf_tensors(cfg)``), which
``config.json`` keys mean which of its Config fields (``hf_config_keys(cfg)``) and which HF
``model_type`` values it loads (``HF_MODEL_TYPES``); ``models.hf`` does the reading, checking and
writing for any of them.

    HFTensor("layers.attn.wq", "model.layers.{i}.self_attn.q_proj.weight", (0, 1), transpose=True)
"""

from __future__ import annotations

from typing import NamedTuple


class HFTensor(NamedTuple):
    """How one of our parameters is assembled from HF tensors."""

    path: str                        # our dotted path, e.g. "layers.attn.wq"
    key: str                         # HF name, with {i} (layer) and {e} (expert) placeholders
    layers: tuple[int, ...] | None   # HF layer indices stacked along our dim 0; None: not stacked
    experts: int = 0                 # > 0: also stacked over {e} in range(experts), our next dim
    transpose: bool = False          # HF [out, in] -> our [in, out]
    rope: tuple[int, int, int] | None = None  # (rows per head, first rope row, rope rows): de-interleave
    copy: bool = False               # HF stores the whole parameter again under each key: written, never read

    def keys(self) -> list[str]:
        """The HF keys in stacking order (layer-major, then expert).

        Example:
            HFTensor("layers.attn.wq", "model.layers.{i}.self_attn.q_proj.weight", (0, 1)).keys()[0]
            # 'model.layers.0.self_attn.q_proj.weight'
        """
        layers = self.layers if self.layers is not None else (None,)
        experts = range(self.experts) if self.experts else (None,)
        return [self.key.format(i=i, e=e) for i in layers for e in experts]


COMMON_CONFIG_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings", "intermediate_size": "ffn_dim",
}
"""``config.json`` keys every model shares -> Config field."""

GQA_CONFIG_KEYS = {"num_key_value_heads": "n_kv_heads", "head_dim": "head_dim"}
"""The grouped-query attention keys (``head_dim`` is derived here: dim / n_heads)."""


def linear(path: str, key: str, layers, **kw) -> HFTensor:
    """An ``nn.Linear`` weight: HF stores ``[out, in]``, we store ``[in, out]``."""
    return HFTensor(path, key, layers, transpose=True, **kw)


def swiglu(path: str, key: str, layers, experts: int = 0) -> list[HFTensor]:
    """``w1, w3, w2`` of a SwiGLU from HF ``gate_proj, up_proj, down_proj``."""
    return [linear(f"{path}.{ours}", f"{key}.{hf}_proj.weight", layers, experts=experts)
            for ours, hf in (("w1", "gate"), ("w3", "up"), ("w2", "down"))]


def outer(tie_embeddings: bool) -> list[HFTensor]:
    """The embedding, the final norm and (unless tied) the output head."""
    out = [HFTensor("embed", "model.embed_tokens.weight", None), HFTensor("norm", "model.norm.weight", None)]
    return out if tie_embeddings else out + [linear("out", "lm_head.weight", None)]


def norms(stack: str, layers) -> list[HFTensor]:
    """A layer stack's two RMSNorm weights."""
    return [HFTensor(f"{stack}.attn_norm", "model.layers.{i}.input_layernorm.weight", layers),
            HFTensor(f"{stack}.mlp_norm", "model.layers.{i}.post_attention_layernorm.weight", layers)]


def gqa_attention(stack: str, layers) -> list[HFTensor]:
    """``wq wk wv wo`` of grouped-query attention."""
    return [linear(f"{stack}.attn.w{x}", f"model.layers.{{i}}.self_attn.{x}_proj.weight", layers) for x in "qkvo"]
