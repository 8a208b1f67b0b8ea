"""Hugging Face safetensors checkpoints <-> shardfn parameter trees (any model with ``hf_tensors``:
``models.llama``, ``models.moe``, and the families on ``models.decoder``: ``qwen3``, ``qwen2``,
``mistral``, ``qwen3_moe``, ``mixtral``).

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

RoPE: our layers use the "rotate half" convention (``core.layers.apply_rope``: dims ``i`` and
``i + d/2`` share frequency ``i``), which is HF Llama's own (its conversion script permuted
Meta's interleaved ``wq``/``wk`` rows), so Llama weights load as they are. HF DeepSeek-V3
(``rope_interleave: true``, its default, and DeepSeek's own modelling code) stores each rotary
pair adjacently and de-interleaves the rope part of q and k at run time; here the rows that
produce it (the last ``r`` of each head of ``q_b_proj``/``q_proj``, the last ``r`` of
``kv_a_proj_with_mqa``) are permuted once at load, ``[0, 2, 4, .., 1, 3, 5, ..]``, so the same
rotate-half attention gives the same result. ``rope_interleave=False`` (or that key false in
``config.json``) loads them as they are.

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
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from shardfn.core.layers import ROPE_SCALINGS, RopeScaling
from shardfn.core.pytree import PyTree, flatten_with_paths, map_with_path
from shardfn.models.hf_names import HFTensor

__all__ = ["HFTensor", "layout", "from_hf", "to_hf", "read_dir", "load", "save", "check_hf_config", "hf_config",
           "hf_rope", "hf_fp8_block", "supported_architectures", "SafetensorsDir", "TensorSlice", "INDEX_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SKIPPED = ("model.layers.*.self_attn.rotary_emb.inv_freq",)
"""HF keys that are buffers, not parameters: always skipped."""
SCALE_SUFFIX = "_scale_inv"
"""An FP8 tensor ``K``'s block scales are the tensor ``K + SCALE_SUFFIX``."""
FP8_BLOCK = (128, 128)
"""Rows and columns of the blocks that share one scale, when ``config.json`` does not say
(``quantization_config.weight_block_size``; DeepSeek-V3's is ``[128, 128]``)."""
AT_LEAST = ("num_nextn_predict_layers",)
"""``config.json`` counts of extra layers a checkpoint may hold more of than the model config
uses (fewer is a disagreement); their tensors are then refused by name unless ignored."""
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))
"""Dtypes that are dequantized with block scales at load."""


def layout(model_name: str, cfg, *, rope_interleave: bool | None = None) -> list[HFTensor]:
    """Every parameter of ``model_name`` and the HF tensors it comes from: the model module's own
    ``hf_tensors`` (``models.llama.hf_tensors``, ``models.moe.hf_tensors``).

    ``rope_interleave`` (MLA only; default True, as HF DeepSeek-V3): whether the HF q/k rope
    rows are stored interleaved (see the module docstring).

    Example:
        [t.path for t in layout("llama", llama.Config())][:3]  # ['embed', 'norm', 'out']
    """
    return named_model(model_name).hf_tensors(cfg, rope_interleave=rope_interleave)


def named_model(model_name: str):
    """The model ``model_name`` resolves to, when it has Hugging Face names (``hf_tensors``).

    Raises:
        ValueError: one line naming the model and the member it lacks.

    Example:
        named_model("llama").HF_ARCHITECTURE   # 'LlamaForCausalLM'
    """
    from shardfn import models

    model = models.get(model_name)
    if not hasattr(model.module, "hf_tensors"):
        raise ValueError(f"model {model_name!r} ({model.source}) has no Hugging Face names: define "
                         f"hf_tensors(cfg) -> list[models.hf_names.HFTensor] (docs/models.md) to export it or to "
                         f"load HF checkpoints")
    return model


# ----------------------------------------------------------------------------- conversion


def _deinterleave(w: torch.Tensor, rope: tuple[int, int, int], inverse: bool = False) -> torch.Tensor:
    """HF rows ``[.., x0, x1, x2, x3, ..]`` of each head's rope part -> ``[x0, x2, .., x1, x3, ..]``."""
    per_head, first, r = rope
    heads = w.reshape(-1, per_head, *w.shape[1:]).clone()          # [H, rows per head, in]
    part = heads[:, first:first + r]
    if inverse:
        part = torch.stack([part[:, : r // 2], part[:, r // 2:]], dim=2).flatten(1, 2)
    else:
        part = torch.cat([part[:, 0::2], part[:, 1::2]], dim=1)
    heads[:, first:first + r] = part
    return heads.reshape(w.shape)


def _stacked_dims(entry: HFTensor) -> int:
    """How many leading dims of our leaf stack HF tensors (layers, experts); 0 for a copy."""
    return 0 if entry.copy else (entry.layers is not None) + bool(entry.experts)


def _hf_shape(entry: HFTensor, ours: Sequence[int]) -> tuple[int, ...]:
    """The shape of one HF tensor of ``entry``, given our stacked parameter's shape."""
    shape = tuple(ours)[_stacked_dims(entry):]
    return shape[::-1] if entry.transpose else shape


def _meta_params(model_name: str, cfg) -> PyTree:
    return named_model(model_name).init(cfg, 0, device="meta")


def from_hf(tensors: Mapping[str, torch.Tensor], model_name: str, cfg, *, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu", rope_interleave: bool | None = None,
            ignore: Iterable[str] = (), source: str = "the checkpoint",
            regions: Mapping[str, tuple[slice, ...]] | None = None,
            fp8_block: Sequence[int] | None = None) -> PyTree:
    """Our parameter tree from HF-named tensors (any mapping, e.g. :func:`read_dir`'s).

    With ``regions`` (``path -> tuple of slices`` of our full leaves) only those boxes are built,
    as a flat dict ``{path: tensor}``, and only the HF tensors of their layers and experts are
    read: a pipeline rank reads its own stages' layers (``runtime.param_source``). When
    ``tensors`` reads slices (:class:`SafetensorsDir`'s ``get_slice``), only the rows and
    columns of the box are read from each of those tensors too (whole heads of rows for the
    MLA rope rows, which are permuted within a head); any other mapping's tensors are sliced
    after.

    FP8 tensors (``float8_e4m3fn``, DeepSeek-V3's released weights) are dequantized with their
    ``<key>_scale_inv`` (one float32 per ``fp8_block`` block, default 128 x 128, the last
    block of a dim partial): ``weight[r, c] = float32(fp8[r, c]) * scale_inv[r // 128, c // 128]``,
    then cast to ``dtype``.

    Raises:
        ValueError: naming the HF key of a missing tensor, one of the wrong shape (with the
            expected shape), one the model has no place for, or an FP8 tensor without its scale.

    Example:
        params = from_hf(safetensors.torch.load_file("model.safetensors"), "llama", cfg)
        llama.apply(params, tokens, cfg)
    """
    entries = layout(model_name, cfg, rope_interleave=rope_interleave)
    meta = _meta_params(model_name, cfg)
    shapes = {path: tuple(x.shape) for path, x in flatten_with_paths(meta)}
    _check_keys(entries, tensors, model_name, cfg, [*SKIPPED, *ignore], source)
    read = _Reader(tensors, tuple(fp8_block or FP8_BLOCK), dtype, source, model_name)
    flat = {}
    for entry in entries:
        if entry.copy or (regions is not None and entry.path not in regions):
            continue
        box = tuple(regions[entry.path]) if regions is not None else ()
        keys, lead, rest = _restrict(entry, box, shapes[entry.path])
        want = _hf_shape(entry, shapes[entry.path])
        out = torch.empty((len(keys), *_box_shape(entry, want, rest)), dtype=dtype, device=device)
        for j, key in enumerate(keys):  # one HF tensor's part in memory at a time
            out[j] = read(key, entry, want, rest)
        flat[entry.path] = out.reshape(*lead, *out.shape[1:]) if _stacked_dims(entry) else out[0]
    if cfg.tie_embeddings and "lm_head.weight" in tensors:
        head, embed = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
        if not torch.equal(head.to(torch.float32), embed.to(torch.float32)):
            raise ValueError(f"{source}: lm_head.weight differs from model.embed_tokens.weight but "
                             f"model.tie_embeddings is true; set model.tie_embeddings=false to load it")
    if regions is not None:
        unknown = sorted(set(regions) - set(flat))
        if unknown:
            raise ValueError(f"from_hf: regions name {unknown}, which model {model_name!r} does not have")
        return flat
    return map_with_path(lambda path, _: flat[path], meta)  # the model's own tree structure and key order


def _restrict(entry: HFTensor, box: tuple[slice, ...], shape: Sequence[int]):
    """The HF keys of the layers and experts ``box`` covers (in stacking order), how many of
    each (the leading dims of what they stack into), and the rest of ``box``: one slice per dim
    of one HF tensor, in our orientation."""
    box = list(box) + [slice(None)] * (len(shape) - len(box))
    layers, experts, lead = (None,), (None,), []
    if entry.layers is not None:
        layers = entry.layers[box[len(lead)]]
        lead.append(len(layers))
    if entry.experts:
        experts = range(entry.experts)[box[len(lead)]]
        lead.append(len(experts))
    keys = [entry.key.format(i=i, e=e) for i in layers for e in experts]
    return keys, tuple(lead), tuple(box[len(lead):])


def _box_shape(entry: HFTensor, want: tuple[int, ...], rest: tuple[slice, ...]) -> tuple[int, ...]:
    """The shape of ``rest`` of one HF tensor of shape ``want``, in our orientation."""
    ours = want[::-1] if entry.transpose else want
    return tuple(len(range(n)[s]) for n, s in zip(ours, rest))


def _open(tensors: Mapping, key: str):
    """``key``'s tensor, or a view of it that reads only what is indexed (``get_slice``): either
    way something with ``shape``, ``dtype`` and ``[index]``."""
    get_slice = getattr(tensors, "get_slice", None)
    return get_slice(key) if get_slice is not None else tensors[key]


class _Reader:
    """Reads one HF tensor's part of a box in our orientation: sliced, dequantized (FP8), rope
    rows de-interleaved, transposed, cast to ``dtype``."""

    def __init__(self, tensors: Mapping, fp8_block: tuple[int, ...], dtype: torch.dtype, source: str,
                 model_name: str):
        if len(fp8_block) != 2 or not all(isinstance(b, int) and b >= 1 for b in fp8_block):
            raise ValueError(f"from_hf: fp8_block must be two positive ints (rows, columns), got {fp8_block!r}")
        self.tensors, self.block, self.dtype = tensors, fp8_block, dtype
        self.source, self.model_name = source, model_name

    def __call__(self, key: str, entry: HFTensor, want: tuple[int, ...], rest: tuple[slice, ...]) -> torch.Tensor:
        src = _open(self.tensors, key)
        if tuple(src.shape) != want:
            raise ValueError(f"{self.source}: {key} has shape {tuple(src.shape)}, but model {self.model_name!r} with "
                             f"this config needs {want} for {entry.path}; check the model.* sizes against the "
                             f"checkpoint's config.json")
        if not src.dtype.is_floating_point:
            raise ValueError(f"{self.source}: {key} has dtype {src.dtype}; parameters are floating point")
        ours = want[::-1] if entry.transpose else want
        spans = [range(n)[s] for n, s in zip(ours, rest)]
        if any(len(r) == 0 for r in spans):
            return torch.empty([len(r) for r in spans], dtype=self.dtype)
        direct = all(r.step == 1 for r in spans)   # a strided box is read whole and sliced after
        window = [(r.start, r.stop) if direct else (0, n) for r, n in zip(spans, ours)]
        hf = window[::-1] if entry.transpose else list(window)
        crop = None
        if entry.rope is not None:  # the permutation stays within a head: read whole heads of rows
            per_head, (a, b) = entry.rope[0], hf[0]
            hf[0] = (a // per_head * per_head, -(-b // per_head) * per_head)
            crop = slice(a - hf[0][0], b - hf[0][0])
        x = self._read(key, src, hf, want)
        if entry.rope is not None:
            x = _deinterleave(x, entry.rope)[crop]
        x = x.t() if entry.transpose else x
        return (x if direct else x[rest]).to(self.dtype)

    def _read(self, key: str, src, window: list[tuple[int, int]], shape: tuple[int, ...]) -> torch.Tensor:
        """The HF box ``window`` (``(start, stop)`` per dim) of ``key``, dequantized to float32 when FP8."""
        x = src[tuple(slice(a, b) for a, b in window)]
        if x.dtype not in FP8_DTYPES:
            return x
        scale_key = key + SCALE_SUFFIX
        if scale_key not in self.tensors:
            raise ValueError(f"{self.source}: {key} is {x.dtype} but the checkpoint has no {scale_key} to dequantize "
                             f"it with; an FP8 weight needs its block scales (or load a bf16 copy of the checkpoint)")
        if x.dim() != 2:
            raise ValueError(f"{self.source}: {key} is {x.dtype} with shape {shape}; only 2-D weights with a "
                             f"[rows / {self.block[0]}, columns / {self.block[1]}] grid of scales are dequantized")
        scales = _open(self.tensors, scale_key)
        grid = tuple(-(-n // b) for n, b in zip(shape, self.block))
        if tuple(scales.shape) != grid:
            raise ValueError(f"{self.source}: {scale_key} has shape {tuple(scales.shape)}, but {key} {list(shape)} "
                             f"in blocks of {list(self.block)} needs {grid}; check quantization_config."
                             f"weight_block_size in config.json")
        first = [a // b for (a, _), b in zip(window, self.block)]
        s = scales[tuple(slice(f, -(-stop // b)) for f, (_, stop), b in zip(first, window, self.block))]
        s = s.to(torch.float32)                                     # [row blocks, column blocks] of the window
        for dim, ((a, stop), b, f) in enumerate(zip(window, self.block, first)):  # one scale per element
            s = s.repeat_interleave(b, dim).narrow(dim, a - f * b, stop - a)
        return x.to(torch.float32).mul_(s)


def _check_keys(entries, tensors: Mapping, model_name: str, cfg, ignore: list, source: str) -> None:
    present = set(tensors)
    needed = [k for e in entries if not e.copy for k in e.keys()]
    known = set(needed) | {k for e in entries if e.copy for k in e.keys()}
    foreign = [(k, what) for k in sorted(present - known) for what in [_architecture_of(k, known)]
               if what is not None and not any(fnmatch.fnmatchcase(k, p) for p in ignore)]
    if foreign:
        key, what = foreign[0]
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise ValueError(f"{source}: tensor {key}{more} is {what}, which model {model_name!r} does not have: the "
                         f"checkpoint is another architecture. Its config.json names it (put it beside the weights); "
                         f"the architectures shardfn loads: {_supported_list()}")
    missing = [k for k in needed if k not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: missing tensor {missing[0]}{more}, needed by model {model_name!r} with "
                         f"model.n_layers={cfg.n_layers}; check the model.* sizes, and model.name, against the "
                         f"checkpoint's config.json")
    known |= {"lm_head.weight"} if cfg.tie_embeddings else set()
    for scale in sorted(k for k in present - known if k.endswith(SCALE_SUFFIX) and k[:-len(SCALE_SUFFIX)] in known):
        base = scale[:-len(SCALE_SUFFIX)]
        base_dtype = _open(tensors, base).dtype
        if base_dtype not in FP8_DTYPES:
            raise ValueError(f"{source}: {scale} is a block scale for {base}, which is {base_dtype}, not FP8; remove "
                             f"the scale or skip it with ignore=['{scale}']")
        known.add(scale)
    extra = sorted(k for k in present - known if not any(fnmatch.fnmatchcase(k, p) for p in ignore))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(f"{source}: unknown tensor {extra[0]}{more}: model {model_name!r} with this config has "
                         f"no parameter for it{_extra_hint(extra[0], cfg)}")


FOREIGN_TENSORS: tuple[tuple[str, str], ...] = (
    ("model.layers.*.self_attn.[qk]_norm.weight", "a QK-norm weight (Qwen3, Qwen3-MoE: model.name=qwen3, qwen3_moe)"),
    ("model.layers.*.self_attn.[qkv]_proj.bias", "a q/k/v projection bias (Qwen2: model.name=qwen2)"),
    ("model.layers.*.block_sparse_moe.*", "a Mixtral expert or router (model.name=mixtral)"),
    ("model.layers.*.mlp.shared_expert.*", "a Qwen2-MoE shared expert (model.name=qwen2_moe)"),
    ("model.layers.*.mlp.shared_expert_gate.*", "a Qwen2-MoE shared-expert gate (model.name=qwen2_moe)"),
    ("model.layers.*.self_attn.sinks", "a gpt-oss attention sink (not modelled)"),
    ("model.layers.*.mlp.router.*", "a gpt-oss router (not modelled)"),
    ("model.layers.*.mlp.experts.*", "a routed expert (Qwen3-MoE: model.name=qwen3_moe; DeepSeek-V3: moe)"),
    ("model.layers.*.mlp.gate.weight", "a mixture-of-experts router (model.name=qwen3_moe or moe)"),
    ("model.layers.*.mlp.gate.e_score_correction_bias", "DeepSeek-V3's router bias (model.name=moe)"),
    ("model.layers.*.self_attn.kv_a_proj_with_mqa.weight", "a multi-head latent attention weight (model.name=moe)"),
    ("*.bias", "a bias"),
)
"""HF key patterns that are parameters of some architecture: a checkpoint holding one the model
has no place for is another architecture, and is never told to skip it."""


def _architecture_of(key: str, known: set[str]) -> str | None:
    """What ``key`` is a parameter of, when that is a kind of tensor the model (whose HF keys are
    ``known``) has none of; None for anything else (the model's own kind of tensor past its
    layers, an FP8 scale, a buffer: reported as unknown tensors)."""
    for pattern, what in FOREIGN_TENSORS:
        if fnmatch.fnmatchcase(key, pattern):
            return None if any(fnmatch.fnmatchcase(k, pattern) for k in known) else what
    return None


def _extra_hint(key: str, cfg) -> str:
    parts = key.split(".")
    taken = cfg.n_layers + getattr(cfg, "mtp_depth", 0)
    if key.startswith("model.layers.") and len(parts) > 2 and parts[2].isdigit() and int(parts[2]) >= taken:
        depth = int(parts[2]) - cfg.n_layers + 1
        mtp = f"; a multi-token-prediction layer loads with model.mtp_depth={depth}" if hasattr(cfg, "mtp_depth") \
            else ""
        return (f"; its layer {parts[2]} is past model.n_layers={cfg.n_layers}{mtp} (or set model.n_layers, or skip "
                f"it with ignore=['model.layers.{parts[2]}.*'])")
    if key.endswith(SCALE_SUFFIX):
        return f"; it is the FP8 block scale of {key[:-len(SCALE_SUFFIX)]}, which the model has no place for either"
    return ("; if it is a buffer or a copy, not a parameter of the checkpoint's architecture (its config.json "
            "names that architecture), skip it with ignore=[pattern]")


def to_hf(params: PyTree, model_name: str, cfg, *, rope_interleave: bool | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors of our parameter tree (the inverse of :func:`from_hf`); the copies HF
    keeps of a parameter (DeepSeek-V3's MTP embedding and head) are written too.

    Example:
        safetensors.torch.save_file(to_hf(params, "llama", cfg), "model.safetensors")
    """
    flat = dict(flatten_with_paths(params))
    out = {}
    for entry in layout(model_name, cfg, rope_interleave=rope_interleave):
        x = flat[entry.path].detach().cpu()
        shape = _hf_shape(entry, x.shape)
        pieces = x.reshape(-1, *(shape[::-1] if entry.transpose else shape))       # [HF tensors, ours per tensor]
        pieces = [pieces[0]] * len(entry.keys()) if entry.copy else pieces
        for key, piece in zip(entry.keys(), pieces):
            piece = piece.t() if entry.transpose else piece
            if entry.rope is not None:
                piece = _deinterleave(piece, entry.rope, inverse=True)
            assert tuple(piece.shape) == shape
            out[key] = piece.clone(memory_format=torch.contiguous_format) if entry.copy else piece.contiguous()
    return out


# ----------------------------------------------------------------------------- files


class SafetensorsDir(Mapping):
    """The tensors of an HF checkpoint directory, read lazily (one file handle per shard)."""

    def __init__(self, directory: str | os.PathLike):
        from safetensors import safe_open

        d = Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"train.init_from: {str(d)!r} is not a directory; give a directory of "
                                    f"Hugging Face *.safetensors files")
        self.directory = d
        index = d / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map' "
                                 f"of tensor name -> file): {e}") from None
            files = sorted(set(weight_map.values()))
            for name in files:
                if not (d / name).is_file():
                    key = next(k for k, v in weight_map.items() if v == name)
                    raise FileNotFoundError(f"{index} maps {key} to {name}, which is not in {d}")
        else:
            files = sorted(p.name for p in d.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"train.init_from: {str(d)!r} holds no *.safetensors files (and no "
                                        f"{INDEX_FILE})")
            weight_map = None
        self._handles = {}
        self._where: dict[str, str] = {}
        self.bytes_read = 0  # tensor bytes handed out so far (whole tensors and slices)
        for name in files:
            try:
                handle = self._handles[name] = safe_open(str(d / name), framework="pt")
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise ValueError(f"{d / name}: not a readable safetensors file ({e})") from None
            for key in handle.keys():
                if weight_map is None and key in self._where:
                    raise ValueError(f"{d}: tensor {key} is in both {self._where[key]} and {name}; "
                                     f"remove one, or add a {INDEX_FILE} saying which to use")
                if weight_map is None or weight_map.get(key) == name:
                    self._where[key] = name
        if weight_map is not None:
            for key, name in weight_map.items():
                if key not in self._where:
                    raise ValueError(f"{index} maps {key} to {name}, but {name} has no tensor {key}")

    def __getitem__(self, key: str) -> torch.Tensor:
        x = self._handles[self._where[key]].get_tensor(key)
        self.bytes_read += x.numel() * x.element_size()
        return x

    def get_slice(self, key: str) -> "TensorSlice":
        """``key``'s tensor, not yet read: its ``shape`` and ``dtype`` come from the file header,
        and ``[index]`` (one slice per dim) reads only that box.

        Example:
            part = read_dir("ckpt/").get_slice("model.embed_tokens.weight")[0:64, 128:256]
        """
        return TensorSlice(self, key, self._handles[self._where[key]].get_slice(key))

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def config(self) -> dict | None:
        """The directory's ``config.json``, or None."""
        path = self.directory / "config.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""The safetensors header's dtype names."""


class TensorSlice:
    """One tensor of a :class:`SafetensorsDir`, read only where indexed."""

    def __init__(self, owner: SafetensorsDir, key: str, handle):
        self._owner, self._key, self._handle = owner, key, handle

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._handle.get_shape())

    @property
    def dtype(self) -> torch.dtype:
        name = self._handle.get_dtype()
        if name not in SAFETENSORS_DTYPES:
            raise ValueError(f"{self._owner.directory}: {self._key} has safetensors dtype {name}, which the loader "
                             f"does not read ({', '.join(SAFETENSORS_DTYPES)})")
        return SAFETENSORS_DTYPES[name]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        x = self._handle[index]
        self._owner.bytes_read += x.numel() * x.element_size()
        return x


def read_dir(directory: str | os.PathLike) -> SafetensorsDir:
    """The HF tensors of ``directory`` as a lazy mapping ``{key: tensor}``.

    Example:
        sorted(read_dir("Llama-3-8B/"))[:2]  # ['lm_head.weight', 'model.embed_tokens.weight']
    """
    return SafetensorsDir(directory)


def load(directory: str | os.PathLike, model_name: str, cfg, *, dtype: torch.dtype = torch.float32,
         device: torch.device | str = "cpu", rope_interleave: bool | None = None,
         ignore: Iterable[str] = (), regions: Mapping[str, tuple[slice, ...]] | None = None,
         hf_config: Mapping | None = None) -> PyTree:
    """Our parameter tree from an HF-format directory, its ``config.json`` checked against ``cfg``;
    with ``regions``, only those boxes of our leaves, reading only their rows and columns of
    their layers' and experts' tensors (:func:`from_hf`). FP8 block-quantized weights
    (``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``)
    are dequantized to ``dtype`` as they are read.

    A directory without ``config.json`` is refused unless the caller states what it would say:
    ``hf_config=`` (a ``config.json`` as a mapping; :func:`hf_config` writes ours), which is then
    checked like the file. The weights alone do not tell a sliding window, RoPE or norm eps.

    Example:
        params = load("Llama-3-8B/", "llama", load_config("llama3_8b").model)
        llama.apply(params, tokens, cfg)
    """
    tensors = read_dir(directory)
    stated, hf_config = hf_config, tensors.config()
    where = str(Path(directory) / "config.json")
    if hf_config is None:
        if stated is None:
            raise ValueError(
                f"{where}: no such file. The weights alone do not say what config.json would (a sliding window, "
                f"RoPE, norm eps, which tensors are biases or norms: Mistral weights have Llama's names), so nothing "
                f"is assumed: put the checkpoint's config.json beside its weights, or state it, e.g. hf.load(..., "
                f"hf_config=hf.hf_config({model_name!r}, cfg)) to say it is model.name={model_name} exactly as "
                f"model.* says")
        hf_config, where = dict(stated), "hf_config="
    elif stated is not None:
        check_hf_config(dict(stated), model_name, cfg, source="hf_config=")
    check_hf_config(hf_config, model_name, cfg, source=where)
    if rope_interleave is None and "rope_interleave" in hf_config:
        rope_interleave = bool(hf_config["rope_interleave"])
    block = hf_fp8_block(hf_config, source=where)
    return from_hf(tensors, model_name, cfg, dtype=dtype, device=device, rope_interleave=rope_interleave,
                   ignore=ignore, source=str(directory), regions=regions, fp8_block=block)


def hf_fp8_block(hf: Mapping, *, source: str = "config.json") -> tuple[int, int] | None:
    """The FP8 scale block ``(rows, columns)`` of a ``config.json``'s ``quantization_config``, or
    None when it has none. Only block-wise FP8 (``quant_method: fp8``, ``fmt: e4m3``, as
    DeepSeek-V3 publishes it) is read; its ``activation_scheme`` is about inference and ignored
    here, since the weights are dequantized at load.

    Raises:
        ValueError: naming another quantization method or format, or a malformed block size.

    Example:
        hf_fp8_block({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})  # (128, 128)
    """
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8":
        method = q.get("quant_method") if isinstance(q, Mapping) else q
        raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not read; the loader dequantizes "
                         f"block-wise FP8 weights (quant_method 'fp8') only: load a bf16 or fp32 copy instead")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{source}: quantization_config.fmt {q['fmt']!r} is not read; the loader dequantizes "
                         f"float8 e4m3 weights (fmt 'e4m3')")
    block = q.get("weight_block_size", list(FP8_BLOCK))
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(f"{source}: quantization_config.weight_block_size must be two positive ints [rows, "
                         f"columns], got {block!r}")
    return int(block[0]), int(block[1])


def save(directory: str | os.PathLike, params: PyTree, model_name: str, cfg, *,
         max_shard_bytes: int | None = None, rope_interleave: bool | None = None) -> list[Path]:
    """Write ``params`` as HF safetensors (sharded with an index when over ``max_shard_bytes``) and
    their ``config.json`` (:func:`hf_config`: sizes, RoPE, dtype).

    Example:
        save("out/", params, "llama", cfg, max_shard_bytes=5 << 30)  # [out/model-00001-of-00002.safetensors, ...]
    """
    from safetensors.torch import save_file

    tensors = to_hf(params, model_name, cfg, rope_interleave=rope_interleave)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    shards: list[dict] = [{}]
    size = 0
    for key, x in tensors.items():
        nbytes = x.numel() * x.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = x
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        total = sum(x.numel() * x.element_size() for x in tensors.values())
        (d / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for name, shard in zip(names, shards):
        save_file(shard, str(d / name), metadata={"format": "pt"})
    dtype = next((x.dtype for x in tensors.values() if x.is_floating_point()), torch.float32)
    config = hf_config(model_name, cfg, dtype=dtype, rope_interleave=rope_interleave)
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [d / n for n in names]


# ----------------------------------------------------------------------------- config.json


HF_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
"""The values Hugging Face and DeepSeek's code take for yarn keys a ``config.json`` leaves out
(``original_max_position_embeddings`` defaults to ``max_position_embeddings``)."""


def hf_rope(hf: Mapping, *, source: str = "config.json") -> tuple[float | None, dict | None]:
    """``(rope_theta, scaling)`` from a ``config.json`` in either format: the top-level
    ``rope_theta`` / ``rope_scaling`` keys (the scaling's type under ``type`` or ``rope_type``),
    or transformers 5's ``rope_parameters`` (``{"rope_theta", "rope_type", ...}``). ``scaling`` is
    None for plain RoPE, else a mapping for ``model.rope_scaling`` (``{"type": "yarn", ...}``),
    with the yarn keys the file leaves out at the values Hugging Face takes for them.

    Raises:
        ValueError: naming a RoPE type that is not modelled (``linear``, ``dynamic``,
            ``longrope``, ...) or a key of the scaling the models do not have.

    Example:
        hf_rope({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}})
    """
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping) or not ({"rope_type", "type", "rope_theta"} & set(params)):
            raise ValueError(f"{source}: rope_parameters {params!r} is not one set of RoPE parameters (per-layer-type "
                             f"RoPE is not modelled); give {{rope_theta, rope_type, ...}}")
        theta, scaling, name = params.get("rope_theta", hf.get("rope_theta")), dict(params), "rope_parameters"
    else:
        theta, scaling, name = hf.get("rope_theta"), hf.get("rope_scaling"), "rope_scaling"
    if scaling is None:
        return theta, None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"{source}: {name} must be a JSON object or null, got {scaling!r}")
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta" and v is not None}
    kinds = {scaling.pop(k) for k in ("type", "rope_type") if k in scaling}
    if len(kinds) > 1:
        raise ValueError(f"{source}: {name} says both type and rope_type, and they differ: {sorted(kinds)}")
    kind = kinds.pop() if kinds else "default"
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: {name}.partial_rotary_factor={scaling['partial_rotary_factor']}; the models "
                         f"rotate the whole RoPE head dim (partial rotary factor 1)")
    scaling.pop("partial_rotary_factor", None)
    if kind == "default":
        if scaling:
            raise ValueError(f"{source}: {name} has no RoPE scaling type but keys {sorted(scaling)}; give its "
                             f"rope_type ({', '.join(ROPE_SCALINGS)})")
        return theta, None
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"{source}: {name} type {kind!r} is not modelled; the models implement RoPE scaling "
                         f"{', '.join(ROPE_SCALINGS)} (or none: rope_type 'default')")
    if kind == "yarn":
        if scaling.pop("truncate", True) is not True:
            raise ValueError(f"{source}: {name}.truncate is false; the models round the YaRN correction range to "
                             f"whole dims (truncate true), as DeepSeek-V3 does")
        if "attention_factor" in scaling:
            raise ValueError(f"{source}: {name}.attention_factor={scaling['attention_factor']} is not modelled; "
                             f"the models derive the YaRN attention factor from mscale and mscale_all_dim")
        if "original_max_position_embeddings" not in scaling and "max_position_embeddings" in hf:
            scaling["original_max_position_embeddings"] = hf["max_position_embeddings"]
        scaling = {**HF_YARN_DEFAULTS, **scaling}
    unknown = sorted(set(scaling) - set(ROPE_SCALINGS[kind]))
    if unknown:
        raise ValueError(f"{source}: {name}.{unknown[0]} is not modelled for a {kind} scaling (its keys: "
                         f"{', '.join(ROPE_SCALINGS[kind])})")
    return theta, {"type": kind, **scaling}


def _rope_disagreements(theirs: dict | None, ours: RopeScaling | None, name: str,
                        source: str) -> list[tuple[str, str]]:
    """``(what, fix)`` for each way ``config.json``'s RoPE scaling (its key ``name``) differs from
    ``model.rope_scaling``."""
    if theirs is None and ours is None:
        return []
    if theirs is None:
        return [(f"no RoPE scaling but model.rope_scaling={ours.to_dict()}", "model.rope_scaling=null")]
    theirs_cfg = RopeScaling.from_dict(theirs, where=f"{source}: {name}")
    if ours is None or ours.type != theirs_cfg.type:
        mine = "null" if ours is None else ours.type
        return [(f"{name} {theirs_cfg.to_dict()} but model.rope_scaling is {mine}",
                 f"model.rope_scaling={_flow(theirs_cfg.to_dict())}")]
    return [(f"{name}.{k}={getattr(theirs_cfg, k)!r} but model.rope_scaling.{k}={getattr(ours, k)!r}",
             f"model.rope_scaling.{k}={_yaml(getattr(theirs_cfg, k))}")
            for k in ROPE_SCALINGS[ours.type] if not _same(getattr(theirs_cfg, k), getattr(ours, k))]


def check_hf_config(hf: dict, model_name: str, cfg, *, source: str = "config.json") -> None:
    """ValueError naming every ``config.json`` value our ``model`` config disagrees with.

    Only keys present in ``hf`` are compared. RoPE comes from either format (:func:`hf_rope`),
    and its scaling is compared key by key with ``model.rope_scaling``; RoPE types the models do
    not implement, and biases, are refused by name.

    Example:
        check_hf_config({"hidden_size": 4096, "num_hidden_layers": 32}, "llama", cfg)
    """
    model = named_model(model_name)
    _check_architecture(hf, model_name, model, source)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r}; the models use SwiGLU with silu")
    own_check = getattr(model.module, "hf_config_check", None)
    if own_check is None:
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{source}: {flag} is true, but model {model_name!r} has no biases")
    theta, scaling = hf_rope(hf, source=source)
    hf = {k: v for k, v in hf.items() if k != "rope_theta"}
    if theta is not None:
        hf["rope_theta"] = theta
    table = model.hf_config_keys(cfg)
    wrong = [(f"{hf_key}={value!r} but model.{ours}={getattr(cfg, ours)!r}",
              f"model.{ours}={_yaml(value)}" if ours != "head_dim" else None)
             for hf_key, ours in table.items() if hf_key in hf
             for value in [0 if hf_key == "q_lora_rank" and hf[hf_key] is None else hf[hf_key]]
             if value is not None and not _same(value, getattr(cfg, ours))
             and not (hf_key in AT_LEAST and value > getattr(cfg, ours))]
    name = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
    wrong += _rope_disagreements(scaling, cfg.rope_scaling, name, source)
    if own_check is not None:
        wrong += own_check(hf, cfg)
    if wrong:
        what = "; ".join(w for w, _ in wrong)
        fixes = " ".join(f for _, f in wrong if f is not None)
        fixed_head = any(w.startswith("head_dim=") and f is None for w, f in wrong)
        raise ValueError(f"{source} disagrees with the model config: {what}; "
                         + (f"override {fixes}" if fixes else
                            "head_dim is model.dim / model.n_heads here" if fixed_head else
                            "the model does not compute what this checkpoint needs"))


def supported_architectures() -> dict[str, tuple[str, tuple[str, ...]]]:
    """``model.name -> (HF architecture, HF model types)`` for every registered model with
    Hugging Face names.

    Example:
        supported_architectures()["qwen3"]   # ('Qwen3ForCausalLM', ('qwen3',))
    """
    from shardfn import models

    out = {}
    for name in sorted({**models._env_registry(), **models.REGISTRY}):
        try:
            model = models.get(name)
        except Exception:  # a registered module that does not import is reported where it is used
            continue
        arch = getattr(model.module, "HF_ARCHITECTURE", None)
        if arch and hasattr(model.module, "hf_tensors"):
            out[name] = (arch, tuple(model.HF_MODEL_TYPES))
    return out


def _supported_list() -> str:
    return ", ".join(f"{arch} (model.name={name})" for name, (arch, _) in supported_architectures().items())


def _check_architecture(hf: Mapping, model_name: str, model, source: str) -> None:
    """Refuse a ``config.json`` whose ``model_type`` (else ``architectures``) is not ``model``'s,
    naming the model that loads it, or saying it is not modelled and listing what is."""
    model_type, archs = hf.get("model_type"), hf.get("architectures") or []
    if model_type is not None:
        if model_type in model.HF_MODEL_TYPES:
            return
        other = [n for n, (_, types) in supported_architectures().items() if model_type in types]
    elif archs and getattr(model.module, "HF_ARCHITECTURE", None) not in archs:
        other = [n for n, (arch, _) in supported_architectures().items() if arch in archs]
    else:
        return
    what = f"model_type {model_type!r}" + (f" (architectures {list(archs)})" if archs else "")
    if other:
        raise ValueError(f"{source}: {what} is not a {model_name!r} model (model.name={model_name} loads model_type "
                         f"{', '.join(model.HF_MODEL_TYPES)}); set model.name to match the checkpoint: "
                         f"model.name={other[0]}")
    raise ValueError(f"{source}: {what} is not modelled; the architectures shardfn loads: {_supported_list()}")


def hf_config(model_name: str, cfg, *, dtype: torch.dtype = torch.float32,
              rope_interleave: bool | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``model_name`` with ``cfg``, in the format Hugging Face reads
    (top-level ``rope_theta`` / ``rope_scaling``); :func:`check_hf_config` accepts it back.

    Example:
        hf_config("llama", cfg)["architectures"]  # ['LlamaForCausalLM']
    """
    model = named_model(model_name)
    out: dict[str, Any] = {"architectures": [model.HF_ARCHITECTURE], "model_type": model.HF_MODEL_TYPES[0]}
    for hf_key, ours in model.hf_config_keys(cfg).items():
        value = getattr(cfg, ours)
        out[hf_key] = None if hf_key == "q_lora_rank" and value == 0 else value
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
    if "num_key_value_heads" not in out and hasattr(cfg, "n_heads"):  # MLA: one key/value per query head
        out["num_key_value_heads"] = model.layout_units(cfg).get("kv_heads", ("n_heads", cfg.n_heads))[1]
    out["hidden_act"] = "silu"
    extra = getattr(model.module, "hf_config_extra", None)
    for key, value in (extra(cfg) if extra is not None else {}).items():
        out.setdefault(key, value)
    scaling = cfg.rope_scaling
    if scaling is not None:
        out["rope_scaling"] = {"rope_type": scaling.type, "type": scaling.type, **scaling.to_dict()}
        if scaling.type == "yarn":  # Hugging Face derives yarn's factor from these two when both are given
            out["max_position_embeddings"] = round(scaling.factor * scaling.original_max_position_embeddings)
    if rope_interleave is not None:
        out["rope_interleave"] = bool(rope_interleave)
    out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


def _same(value: Any, mine: Any) -> bool:
    if isinstance(mine, tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(mine, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return abs(float(value) - mine) <= 1e-9 * max(1.0, abs(mine))
    return value == mine


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _flow(d: dict) -> str:
    """A mapping as a YAML flow mapping: ``{type: yarn, factor: 40.0}``."""
    return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in d.items()) + "}"
