"""Profiler labels for layers: there only while a profiler records.

    with scope("shardfn.layer.0"):
        h = block(p, h)
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function


def scope(name: str) -> contextlib.AbstractContextManager:
    """``torch.profiler.record_function(name)`` while a profiler records, else a no-op context.

    An unused label still costs an op call per layer per step, and under ``torch.compile`` it
    would split the graph; so it is there only when someone looks.

    Example:
        with scope("shardfn.layer.0"):
            h = block(p, h)
    """
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    from shardfn.core._torch_private import profiler_enabled

    return record_function(name) if profiler_enabled() else contextlib.nullcontext()
