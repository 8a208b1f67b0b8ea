"""Block-wise FP8 checkpoints: which dtypes are dequantized, the scales' key and block size.

    hf_fp8_block({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})  # (128, 128)
    key + SCALE_SUFFIX                                  # the key of its block scales
"""

from __future__ import annotations

from typing import Mapping

import torch

SCALE_SUFFIX = "_scale_inv"
"""An FP8 tensor ``K``'s block scales are the tensor ``K + SCALE_SUFFIX``."""
FP8_BLOCK = (128, 128)
"""Rows and columns of the blocks that share one scale, when ``config.json`` does not say
(``quantization_config.weight_block_size``; DeepSeek-V3's is ``[128, 128]``)."""


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))
"""Dtypes that are dequantized with block scales at load."""


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
    if q is None or (isinstance(q, Mapping) and q.get("quant_method") == "mxfp4"):
        return None
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8":
        method = q.get("quant_method") if isinstance(q, Mapping) else q
        raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not read; the loader dequantizes "
                         f"block-wise FP8 weights (quant_method 'fp8') and MXFP4 ones (quant_method 'mxfp4', "
                         f"gpt-oss's experts) only: load a bf16 or fp32 copy instead")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{source}: quantization_config.fmt {q['fmt']!r} is not read; the loader dequantizes "
                         f"float8 e4m3 weights (fmt 'e4m3')")
    block = q.get("weight_block_size", list(FP8_BLOCK))
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(f"{source}: quantization_config.weight_block_size must be two positive ints [rows, "
                         f"columns], got {block!r}")
    return int(block[0]), int(block[1])
