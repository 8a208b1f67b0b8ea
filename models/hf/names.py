"""The name mapping: every parameter of a model and the HF tensors it comes from, both ways.

    [t.path for t in layout("llama", llama.Config())][:3]      # ['embed', 'norm', 'out']
    params = from_hf(read_dir("Llama-3-8B/"), "llama", cfg)
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Mapping, Sequence

import torch

from shardfn.core.pytree import PyTree, flatten_with_paths, map_with_path
from shardfn.models import mxfp4
from shardfn.models.hf.fp8 import FP8_BLOCK, FP8_DTYPES, SCALE_SUFFIX
from shardfn.models.hf.read import _deinterleave, _open, _Reader
from shardfn.models.hf_names import HFTensor

SKIPPED = ("model.layers.*.self_attn.rotary_emb.inv_freq",)
"""HF keys that are buffers, not parameters: always skipped."""


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
    tensors = mxfp4.MXFP4Tensors(tensors) if mxfp4.has_mxfp4(tensors) else tensors
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
        half = [k + suffix for suffix in (mxfp4.BLOCKS, mxfp4.SCALES) for k in missing[:1] if k + suffix in present]
        if half:
            raise ValueError(f"{source}: missing tensor {missing[0]}{more}: the checkpoint has {half[0]} but not the "
                             f"other half of its MXFP4 pair ({missing[0]}{mxfp4.BLOCKS}, uint8 FP4 codes, and "
                             f"{missing[0]}{mxfp4.SCALES}, uint8 e8m0 scales)")
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
    ("model.layers.*.self_attn.sinks", "a gpt-oss attention sink (model.name=gpt_oss)"),
    ("model.layers.*.mlp.router.*", "a gpt-oss router (model.name=gpt_oss)"),
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
