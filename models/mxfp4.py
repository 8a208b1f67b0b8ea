"""MXFP4 weights (gpt-oss's released experts), dequantized as a checkpoint is read.

A quantized HF tensor ``K`` is stored as two: ``K_blocks`` (uint8 ``[..., R, G, 16]``: each
byte two FP4 e2m1 values, the low nibble first) and ``K_scales`` (uint8 ``[..., R, G]``: one
e8m0 power of two per block of 32 values, ``2 ** (scale - 127)``). Row ``r`` of the stored
matrix is ``G * 32`` values; gpt-oss stores ``[out, in]`` and its parameter is ``[in, out]``, so
the dequantized tensor is the stored matrix transposed (``[..., G * 32, R]``), the layout
Hugging Face's ``GptOssExperts`` holds.

    w = dequantize(blocks, scales)        # blocks [E, 2F, D/32, 16], scales [E, 2F, D/32] -> [E, D, 2F]
    tensors = MXFP4Tensors(read_dir(d))   # K_blocks + K_scales seen as one float32 K, read lazily
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

BLOCKS, SCALES = "_blocks", "_scales"
"""Suffixes of the two stored halves of an MXFP4 tensor."""
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each 4-bit code (sign, two exponent bits, one mantissa bit)."""
SCALE_BIAS = 127
"""An e8m0 scale ``s`` means ``2 ** (s - 127)``."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., G * 32, R]`` of MXFP4 ``blocks [..., R, G, 16]`` and ``scales [..., R, G]``.

    Example:
        dequantize(torch.full((1, 2, 1, 16), 0x21, dtype=torch.uint8), torch.full((1, 2, 1), 128, dtype=torch.uint8))
        # [1, 32, 2]: 1.0, 2.0, 1.0, 2.0, ... (codes 1 and 2 are 0.5 and 1.0, times 2)
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape[:-1]) != tuple(scales.shape) \
            or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 needs uint8 blocks [..., rows, groups, 16] and uint8 scales [..., rows, groups]; got "
                         f"blocks {blocks.dtype} {list(blocks.shape)} and scales {scales.dtype} {list(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()        # [..., R, G, 32]
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1))
    return values.flatten(-2).transpose(-1, -2)                                         # [..., G*32, R]


class _Quantized:
    """One MXFP4 tensor seen as its dequantized float32 value: ``shape``, ``dtype`` and ``[index]``,
    reading only the leading-dim entries and rows ``index`` covers."""

    def __init__(self, tensors: Mapping, key: str):
        get = getattr(tensors, "get_slice", None)
        self.blocks = get(key + BLOCKS) if get else tensors[key + BLOCKS]
        self.scales = get(key + SCALES) if get else tensors[key + SCALES]
        self.key = key
        *lead, rows, groups, _ = self.blocks.shape
        self.shape = (*lead, groups * 32, rows)
        self.dtype = torch.float32

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        *lead, cols, rows = index
        stored = (*lead, rows)                                                           # the rows are dim -3 of blocks
        return dequantize(self.blocks[stored], self.scales[stored])[..., cols, :]


class MXFP4Tensors(Mapping):
    """``tensors`` with each ``K_blocks`` / ``K_scales`` pair seen as one float32 tensor ``K``
    (:func:`dequantize`d when read; ``get_slice(K)`` reads only the experts and rows asked).
    A ``K_blocks`` without its ``K_scales`` (or the reverse) stays as it is, so the loader
    names it.

    Example:
        MXFP4Tensors(read_dir("gpt-oss-20b/"))["model.layers.0.mlp.experts.down_proj"].shape   # [32, 2880, 2880]
    """

    def __init__(self, tensors: Mapping):
        self.tensors = tensors
        self.quantized = {k[:-len(BLOCKS)] for k in tensors if k.endswith(BLOCKS) and k[:-len(BLOCKS)] + SCALES in
                          tensors}
        self._keys = [k for k in tensors if k.removesuffix(BLOCKS) not in self.quantized
                      and k.removesuffix(SCALES) not in self.quantized] + sorted(self.quantized)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.quantized:
            q = _Quantized(self.tensors, key)
            return q[tuple(slice(None) for _ in q.shape)]
        return self.tensors[key]

    def get_slice(self, key: str):
        """``key``'s tensor, read only where indexed (as ``models.hf.SafetensorsDir.get_slice``)."""
        if key in self.quantized:
            return _Quantized(self.tensors, key)
        get = getattr(self.tensors, "get_slice", None)
        return get(key) if get else self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.quantized or (key in self.tensors and isinstance(key, str)
                                         and key.removesuffix(BLOCKS) not in self.quantized
                                         and key.removesuffix(SCALES) not in self.quantized)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def has_mxfp4(tensors: Mapping) -> bool:
    """Whether ``tensors`` holds any ``K_blocks`` / ``K_scales`` pair."""
    return any(k.endswith(BLOCKS) and k[:-len(BLOCKS)] + SCALES in tensors for k in tensors)
