"""Qwen3 dense (``Qwen3ForCausalLM``): grouped-query attention with QK-norm, SwiGLU, untied head.

QK-norm is an RMSNorm over each head's query and key, before RoPE. The math and the parameter
table are ``models.decoder``'s (its docstring lists every parameter); this module fixes the
family and its Hugging Face names.

    cfg = models.get("qwen3").Config.from_dict({"dim": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16})
    params = models.get("qwen3").init(cfg, seed=0)
    loss(params, {"inputs": tokens, "targets": targets}, cfg)
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
    """Qwen3 hyperparameters (``models.decoder.Config``'s fields). Defaults: the tiny debug model.

    Named sizes (examples/configs):

        name       vocab_size  dim   n_layers  n_heads  n_kv_heads  head_dim  ffn_dim  tied   params
        qwen3_8b   151936      4096  36        32       8           128       12288    no     8.19B
        qwen3_32b  151936      5120  64        64       8           128       25600    no     32.8B
    """

    QK_NORM: ClassVar[bool] = True


READS_POSITIONS = True
HF_MODEL_TYPES = ("qwen3",)
HF_ARCHITECTURE = "Qwen3ForCausalLM"
