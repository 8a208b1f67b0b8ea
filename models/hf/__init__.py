"""Hugging Face safetensors checkpoints <-> shardfn parameter trees (any model with ``hf_tensors``:
``models.llama``, ``models.moe``, the families on ``models.decoder``: ``qwen3``, ``qwen2``,
``mistral``, ``qwen3_moe``, ``mixtral``, ``qwen2_moe``; and ``models.gpt_oss``).

A directory of HF-format ``*.safetensors`` files (with ``model.safetensors.index.json`` when the
weights are sharded over several files, and optionally the ``config.json`` beside them) loads
into the pure models' parameter trees, and a tree writes back out the same way:

    params = load("Llama-3-8B/", "llama", cfg.model)                  # the whole tree, float32
    save("out/", params, "llama", cfg.model, max_shard_bytes=5 << 30)  # *.safetensors + index.json
    layout("moe", cfg.model)                                          # the mapping below, as data

A run loads its initial parameters from such a directory with ``train.init_from=DIR`` (the
config key; ``shardfn train train.init_from=DIR``). This module lives in ``models/`` because
the mapping is knowledge of the models' parameter names; it does no parallelism, but builds any
boxes of our leaves it is asked for (``regions=``), so each rank reads only what it holds.

Name mapping (``i`` an HF layer, ``e`` an expert; ``.T``: HF's ``nn.Linear`` weights are
``[out, in]``, ours ``[in, out]``; our per-layer tensors are stacked along a leading layers dim,
the routed experts' along a second, expert dim):

    HF key                                             ours                          how
    model.embed_tokens.weight                          embed [V, D]                  as is
    model.norm.weight                                  norm [D]                      as is
    lm_head.weight                                     out [D, V]                    .T (absent when tie_embeddings)
    model.layers.{i}.input_layernorm.weight            <stack>.attn_norm [L, D]      stacked
    model.layers.{i}.post_attention_layernorm.weight   <stack>.mlp_norm [L, D]       stacked
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   <stack>.attn.w{q,k,v,o}       .T, stacked (GQA)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight    <dense stack>.mlp.w{1,3,2}    .T, stacked
  DeepSeek-V3 / Kimi-K2 (models.moe) multi-head latent attention:
    self_attn.q_a_proj.weight                          attn.wq_a [L, D, q_lora]      .T
    self_attn.q_a_layernorm.weight                     attn.q_norm [L, q_lora]
    self_attn.q_b_proj.weight                          attn.wq_b [L, q_lora, H*(n+r)] .T, rope rows de-interleaved
    self_attn.q_proj.weight (q_lora_rank = 0)          attn.wq [L, D, H*(n+r)]       .T, rope rows de-interleaved
    self_attn.kv_a_proj_with_mqa.weight                attn.wkv_a [L, D, kv_lora+r]  .T, rope rows de-interleaved
    self_attn.kv_a_layernorm.weight                    attn.kv_norm [L, kv_lora]
    self_attn.kv_b_proj.weight                         attn.wkv_b [L, kv_lora, H*(n+v)] .T
    self_attn.o_proj.weight                            attn.wo [L, H*v, D]           .T
  DeepSeek-V3 MoE layers (HF layers first_k_dense .. n_layers-1 -> moe_layers 0 .. Lm-1):
    mlp.gate.weight                                    moe_layers.router [Lm, D, E]  .T
    mlp.gate.e_score_correction_bias                   moe_layers.router_bias [Lm, E]
    mlp.experts.{e}.{gate,up,down}_proj.weight         moe_layers.experts.w{1,3,2} [Lm, E, ..] .T, by layer, expert
    mlp.shared_experts.{gate,up,down}_proj.weight      moe_layers.shared.w{1,3,2}    .T
  gpt-oss (models.gpt_oss; every layer MoE, experts fused per layer in HF too, gate/up interleaved):
    self_attn.{q,k,v,o}_proj.bias                      layers.attn.b{q,k,v,o}        stacked
    self_attn.sinks                                    layers.attn.sinks [L, H]      stacked
    mlp.router.weight, mlp.router.bias                 layers.router [L, D, E] (.T), layers.router_bias [L, E]
    mlp.experts.gate_up_proj [E, D, 2F], _bias         layers.experts.w13, b13       as is, stacked
    mlp.experts.down_proj [E, F, D], _bias             layers.experts.w2, b2         as is, stacked
  DeepSeek-V3 multi-token prediction (HF layers n_layers .. n_layers+K-1 -> mtp 0 .. K-1, K = mtp_depth):
    enorm.weight, hnorm.weight                         mtp.enorm, mtp.hnorm [K, D]
    eh_proj.weight                                     mtp.eh_proj [K, 2D, D]        .T
    shared_head.norm.weight                            mtp.norm [K, D]
    input_layernorm.weight, self_attn.*, mlp.*, ...    mtp.block.*                   as the MoE layers
    embed_tokens.weight, shared_head.head.weight       (copies of embed and out)     written, never read

``<stack>`` is ``layers`` for Llama; for the MoE model it is ``dense_layers`` for HF layers
``0 .. first_k_dense-1`` and ``moe_layers`` for the rest. The MTP modules use the main model's
embedding and output head (DeepSeek-V3 shares them); HF stores a copy of each under every MTP
layer, which :func:`save` writes (inference engines read them there) and :func:`from_hf` accepts
without reading (2 x V x D values per depth that are the main model's).

FP8: DeepSeek-V3's released weights are ``float8_e4m3fn`` with a float32 ``<key>_scale_inv``
per 128 x 128 block (``[ceil(out / 128), ceil(in / 128)]``; ``quantization_config`` in
``config.json``, :func:`hf_fp8_block`). They are dequantized as they are read,
``float32(fp8[r, c]) * scale_inv[r // 128, c // 128]``, then cast to the asked ``dtype``; an FP8
tensor without its scale is an error naming it. Read through :class:`SafetensorsDir`, a box
reads only its rows and columns of each HF tensor (and of its grid of scales), through
safetensors' ``get_slice``; the MLA rope rows, permuted within a head, are read by whole heads.

RoPE: our layers use the "rotate half" convention (``core.rope.apply_rope``: dims ``i`` and
``i + d/2`` share frequency ``i``), which is HF Llama's own (its conversion script permuted
Meta's interleaved ``wq``/``wk`` rows), so Llama weights load as they are. HF DeepSeek-V3
(``rope_interleave: true``, its default, and DeepSeek's own modelling code) stores each rotary
pair adjacently and de-interleaves the rope part of q and k at run time; here the rows that
produce it (the last ``r`` of each head of ``q_b_proj``/``q_proj``, the last ``r`` of
``kv_a_proj_with_mqa``) are permuted once at load, ``[0, 2, 4, .., 1, 3, 5, ..]``, so the same
rotate-half attention gives the same result. ``rope_interleave=False`` (or that key false in
``config.json``) loads them as they are.

MXFP4: gpt-oss's released expert weights are ``K_blocks`` (uint8, two FP4 e2m1 codes a byte)
and ``K_scales`` (uint8 e8m0, one power of two per 32 values of a row; ``quantization_config``
``{"quant_method": "mxfp4"}``). Each pair is read as the float32 tensor ``K`` it stands for
(``models.mxfp4``: dequantized, ``[out, in]`` rows transposed to HF's ``[in, out]``), then cast
to ``dtype``; a box reads only its experts' blocks and scales. Half a pair is an error naming it.

Errors name the HF key: a tensor the model needs that no file holds, a tensor of the wrong shape
(with the shape expected from the model config), and a tensor the model has no place for (such
as DeepSeek-V3's multi-token-prediction layer ``model.layers.61.*`` when ``model.mtp_depth=0``;
``ignore=`` takes glob patterns to skip). ``model.layers.*.self_attn.rotary_emb.inv_freq``
buffers, found in older checkpoints, are always skipped. When ``config.json`` is present its
sizes and RoPE are checked against the model config (:func:`check_hf_config`): ``rope_theta`` and
the scaling are read from the top-level ``rope_theta`` / ``rope_scaling`` keys or from
transformers 5's ``rope_parameters`` (:func:`hf_rope`), and the scaling (``llama3`` or ``yarn``)
is compared key by key with ``model.rope_scaling``. Not modelled, so refused there: other RoPE
types (``linear``, ``dynamic``, ``longrope``, ...), and what the model module's
``hf_config_check`` names (biases it has not, windows it does not compute). A ``config.json`` of
another architecture is refused naming the model that loads it (:func:`supported_architectures`);
so is a tensor that is a parameter of another architecture (``FOREIGN_TENSORS``: a QK-norm
weight, a q/k/v bias, ...), never with a hint to skip it. A directory without ``config.json``
is refused unless the caller states it (``load(..., hf_config=)``): the weights do not say a
window, the RoPE or the norm eps. :func:`save` writes a ``config.json`` (:func:`hf_config`) with
every key ``from_pretrained`` needs, which :func:`load` accepts back.

One module per part: ``names`` (the name mapping: ``layout``, ``from_hf``, ``to_hf``),
``read`` (one HF tensor's box in our orientation), ``fp8`` (block scales), ``safetensors_dir``
(the files), ``config_json`` (``config.json`` read, checked and written) and ``checkpoint``
(``load`` and ``save`` a directory). Every public name is importable from here (``hf.load``).
"""

from shardfn.models.hf.checkpoint import load, save
from shardfn.models.hf.config_json import check_hf_config, hf_config, hf_rope
from shardfn.models.hf.fp8 import hf_fp8_block
from shardfn.models.hf.names import from_hf, layout, named_model, supported_architectures, to_hf
from shardfn.models.hf.safetensors_dir import INDEX_FILE, SafetensorsDir, TensorSlice, read_dir
from shardfn.models.hf_names import HFTensor

__all__ = ["HFTensor", "layout", "from_hf", "to_hf", "read_dir", "load", "save", "check_hf_config", "hf_config",
           "hf_rope", "hf_fp8_block", "supported_architectures", "SafetensorsDir", "TensorSlice", "INDEX_FILE",
           "named_model"]
