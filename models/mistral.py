"""Mistral (``MistralForCausalLM``): grouped-query attention with a sliding window, SwiGLU.

With ``sliding_window = W > 0`` each query reads the ``W`` keys up to and including its own
(``core.layers.sliding_window_attention``, Hugging Face's mask ``q - W < k <= q``), computed on
one device and under dp, fsdp, tp and pp; context parallelism, which reorders the tokens, is
refused by name (``context_refusal``). ``sliding_window = 0`` is full causal attention
(Mistral 7B v0.3, Mistral NeMo). The math and the parameter table are ``models.decoder``'s.

    cfg = models.get("mistral").Config(sliding_window=8)
    loss(models.get("mistral").init(cfg, seed=0), {"inputs": tokens, "targets": targets}, cfg)
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfn.models import decoder
from shardfn.models.contract import check
from shardfn.models.decoder import (  # noqa: F401
    apply,
    block,
    context_refusal,
    hf_config_check,
    hf_config_extra,
    hf_config_keys,
    hf_tensors,
    loss,
    param_table,
)


@dataclass(frozen=True)
class Config(decoder.Config):
    """Mistral hyperparameters: ``models.decoder.Config``'s and ``sliding_window`` (0: none).

    Named sizes (examples/configs):

        name         vocab_size  dim   n_layers  n_heads  n_kv_heads  ffn_dim  window  params
        mistral_7b   32000       4096  32        32       8           14336    4096    7.24B
    """

    sliding_window: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        super().__post_init__()
        check(self.sliding_window >= 0, "sliding_window", f"must be >= 0 (0: no window), got {self.sliding_window}")

    @property
    def window(self) -> int:
        return self.sliding_window


READS_POSITIONS = True
HF_MODEL_TYPES = ("mistral",)
HF_ARCHITECTURE = "MistralForCausalLM"
