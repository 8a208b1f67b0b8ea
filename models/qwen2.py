"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): grouped-query attention with q, k and v biases, SwiGLU.

The math and the parameter table are ``models.decoder``'s (its docstring lists every parameter,
the biases ``attn.bq``, ``attn.bk``, ``attn.bv`` among them); this module fixes the family and its
Hugging Face names. Qwen2's sliding-window layers (``use_sliding_window: true``) are not modelled:
such a ``config.json`` is refused by name.

    cfg = models.get("qwen2").Config()
    loss(models.get("qwen2").init(cfg, seed=0), {"inputs": tokens, "targets": targets}, cfg)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardfn.models import decoder
from shardfn.models.decoder import (  # noqa: F401
    apply,
    block,
    hf_config_check,
    hf_config_extra,
    hf_config_keys,
    hf_tensors,
    loss,
    param_table,
)


@dataclass(frozen=True)
class Config(decoder.Config):
    """Qwen2 hyperparameters (``models.decoder.Config``'s fields). Defaults: the tiny debug model.

    Named sizes (examples/configs):

        name         vocab_size  dim   n_layers  n_heads  n_kv_heads  ffn_dim  tied   params
        qwen2_5_7b   152064      3584  28        28       4           18944    no     7.62B
    """

    QKV_BIAS: ClassVar[bool] = True


READS_POSITIONS = True
HF_MODEL_TYPES = ("qwen2",)
HF_ARCHITECTURE = "Qwen2ForCausalLM"
