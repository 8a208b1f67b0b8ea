"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v biases) with a softmax top-k mixture
of experts plus one shared expert scaled by a sigmoid gate of its own.

Each MoE layer computes ``routed(x) + sigmoid(x @ shared_gate) * swiglu_shared(x)``; the router
keeps the softmax's top ``top_k``, renormalised when ``norm_topk_prob`` (Qwen1.5-MoE-A2.7B and
Qwen2-57B-A14B: false). The math and the parameter table are ``models.decoder``'s.

    cfg = models.get("qwen2_moe").Config()
    loss(models.get("qwen2_moe").init(cfg, seed=0), {"inputs": tokens, "targets": targets}, cfg)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardfn.models import decoder
from shardfn.models.contract import check
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
    """Qwen2-MoE hyperparameters: ``models.decoder.MoEConfig``'s and ``shared_expert_ffn_dim``
    (the shared expert's hidden size). Defaults: the tiny debug model."""

    QKV_BIAS: ClassVar[bool] = True

    shared_expert_ffn_dim: int = 64
    norm_topk_prob: bool = False

    def __post_init__(self):
        super().__post_init__()
        check(self.shared_expert_ffn_dim >= 1, "shared_expert_ffn_dim", f"must be >= 1, got "
                                                                        f"{self.shared_expert_ffn_dim}")


READS_POSITIONS = True
HF_MODEL_TYPES = ("qwen2_moe",)
HF_ARCHITECTURE = "Qwen2MoeForCausalLM"
