"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (QK-norm) with a softmax top-k mixture of
experts, no shared experts.

The router takes a softmax over every expert (float32) and keeps the top ``top_k``,
renormalised when ``norm_topk_prob`` (Qwen3-30B-A3B and Qwen3-235B-A22B: true). Layers that
``mlp_only_layers`` / ``decoder_sparse_step`` leave dense are SwiGLU of ``ffn_dim``. The math and
the parameter table are ``models.decoder``'s; ``loss`` takes the routed experts as a function
(``experts=``), which expert parallelism replaces.

    cfg = models.get("qwen3_moe").Config()
    loss(models.get("qwen3_moe").init(cfg, seed=0), {"inputs": tokens, "targets": targets}, cfg)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardfn.models import decoder
from shardfn.models.decoder import (  # noqa: F401
    apply,
    block,
    experts_per_token,
    hf_config_check,
    hf_config_extra,
    hf_config_keys,
    hf_tensors,
    loss,
    param_table,
    pipeline_refusal,
    stacks,
    with_layers,
)


@dataclass(frozen=True)
class Config(decoder.MoEConfig):
    """Qwen3-MoE hyperparameters (``models.decoder.MoEConfig``'s fields). Defaults: the tiny model.

    Named sizes (examples/configs; every layer MoE, ``norm_topk_prob`` true):

        name              vocab   dim   layers  heads  kv  head_dim  experts  top_k  expert_ffn  total / active
        qwen3_30b_a3b     151936  2048  48      32     4   128       128      8      768         30.5B / 3.35B
        qwen3_235b_a22b   151936  4096  94      64     4   128       128      8      1536        235B / 22.2B
    """

    QK_NORM: ClassVar[bool] = True


READS_POSITIONS = True
HF_MODEL_TYPES = ("qwen3_moe",)
HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
