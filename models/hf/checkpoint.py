"""A checkpoint directory loaded into our parameter tree, or written from one.

    params = load("Llama-3-8B/", "llama", cfg.model)
    save("out/", params, "llama", cfg.model, max_shard_bytes=5 << 30)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import torch

from shardfn.core.pytree import PyTree
from shardfn.models.hf.config_json import check_hf_config, hf_config
from shardfn.models.hf.fp8 import hf_fp8_block
from shardfn.models.hf.names import from_hf, to_hf
from shardfn.models.hf.safetensors_dir import INDEX_FILE, read_dir


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
    block = hf_fp8_block(hf_config, source=where)   # None for MXFP4, whose scales are per 32 values of a row
    return from_hf(tensors, model_name, cfg, dtype=dtype, device=device, rope_interleave=rope_interleave,
                   ignore=ignore, source=str(directory), regions=regions, fp8_block=block)


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
