"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a softmax top-2 mixture of experts in
every layer, renormalised, no shared experts.

The router takes a softmax over every expert (float32) and keeps the top ``top_k`` weights
renormalised to sum to 1. ``sliding_window`` as in ``models.mistral`` (Mixtral 8x7B: none). The
math and the parameter table are ``models.decoder``'s; Hugging Face names the experts
``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down).

    cfg = models.get("mixtral").Config()
    loss(models.get("mixtral").init(cfg, seed=0), {"inputs": tokens, "targets": targets}, cfg)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardfn.models import decoder
from shardfn.models.contract import check
from shardfn.models.decoder import (  # noqa: F401
    apply,
    block,
    context_refusal,
    experts_per_token,
    hf_config_check,
    hf_config_extra,
    hf_config_keys,
    hf_tensors,
    loss,
    param_table,
)


@dataclass(frozen=True)
class Config(decoder.MoEConfig):
    """Mixtral hyperparameters: ``models.decoder.MoEConfig``'s and ``sliding_window`` (0: none).
    Every layer is MoE and the top-k weights are always renormalised.

    Named sizes (examples/configs):

        name           vocab  dim   layers  heads  kv  experts  top_k  expert_ffn  total / active
        mixtral_8x7b   32000  4096  32      32     8   8        2      14336       46.7B / 12.9B
    """

    HF_EXPERTS: ClassVar[str] = "mixtral"

    sliding_window: int = 0
    norm_eps: float = 1e-5

    def __post_init__(self):
        super().__post_init__()
        check(self.sliding_window >= 0, "sliding_window", f"must be >= 0 (0: no window), got {self.sliding_window}")
        check(self.norm_topk_prob, "norm_topk_prob", "must be true: Mixtral always renormalises the top-k weights")
        check(self.decoder_sparse_step == 1 and not self.mlp_only_layers, "mlp_only_layers",
              "must be empty (and model.decoder_sparse_step 1): every Mixtral layer is MoE")

    @property
    def window(self) -> int:
        return self.sliding_window


READS_POSITIONS = True
HF_MODEL_TYPES = ("mixtral",)
HF_ARCHITECTURE = "MixtralForCausalLM"
