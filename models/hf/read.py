"""One HF tensor's box read in our orientation: sliced, dequantized (FP8), rope rows
de-interleaved, transposed, cast.

    read = _Reader(tensors, (128, 128), torch.float32, "ckpt/", "moe")
    x = read(key, entry, hf_shape, box)
"""

from __future__ import annotations

from typing import Mapping

import torch

from shardfn.models.hf.fp8 import FP8_DTYPES, SCALE_SUFFIX
from shardfn.models.hf_names import HFTensor


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
