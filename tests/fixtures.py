"""What the tests and the benchmarks share: a tiny stacked-layer model, a config's training state
after a few steps, a fake train step to auto-shard, a median timer and a measured peak of memory.

The benchmarks import this module too (``benchmarks/`` puts ``tests/`` on ``sys.path``), so a
benchmark measures the same model a test checks.

    params, batch = tiny_params(8), tiny_batch(rows=8)
    loss = tiny_loss(params, batch)
    cfg, model, params, opt_state = trained_state("moe_tiny", ["train.batch_size=4"], steps=1)
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from shardfn import models
from shardfn.config import load_config
from shardfn.runtime import data
from shardfn.runtime.train_step import make_optimizer, make_train_step

# ----------------------------------------------------------------------------- a tiny stacked-layer model


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def tiny_loss(p, batch):
    """Embedding, residual SwiGLU layers with RMSNorm (stacked ``[L, ...]`` leaves), output head,
    mean cross-entropy: the shape of a transformer, small enough for any test.

        tiny_loss(tiny_params(4), tiny_batch())   # 0-d tensor
    """
    h = p["embed"][batch["inputs"]]                                  # [B, S, D]
    for i in range(p["layers"]["w1"].shape[0]):
        w = {k: v[i] for k, v in p["layers"].items()}
        x = rms_norm(h, w["norm"])
        h = h + (F.silu(x @ w["w1"]) * (x @ w["w3"])) @ w["w2"]       # [B, S, D]
    logits = rms_norm(h, p["norm"]) @ p["head"]                      # [B, S, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1))


def tiny_params(n_layers: int, *, dim: int = 16, hidden: int = 32, vocab: int = 64, seed: int = 0) -> dict:
    """The :func:`tiny_loss` parameters, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / s[-2] ** 0.5  # noqa: E731
    return {
        "embed": torch.randn(vocab, dim, generator=g),
        "layers": {"norm": 1 + 0.1 * torch.randn(n_layers, dim, generator=g), "w1": r(n_layers, dim, hidden),
                   "w3": r(n_layers, dim, hidden), "w2": r(n_layers, hidden, dim)},
        "norm": torch.ones(dim),
        "head": r(dim, vocab),
    }


def tiny_batches(steps: int, *, rows: int = 8, seq: int = 8, vocab: int = 64, seed: int = 1) -> list[dict]:
    """``steps`` batches of random token ids for :func:`tiny_loss`."""
    g = torch.Generator().manual_seed(seed)
    return [{"inputs": torch.randint(0, vocab, (rows, seq), generator=g),
             "targets": torch.randint(0, vocab, (rows, seq), generator=g)} for _ in range(steps)]


# ----------------------------------------------------------------------------- a run config's state


def trained_state(config=None, overrides=(), *, steps: int = 1, rows: int = 4, seq: int = 16):
    """``(cfg, model, params, opt_state)`` of a run config after ``steps`` real optimizer steps on
    batches of ``rows x seq`` (every state leaf nonzero).

        cfg, model, params, state = trained_state("moe_tiny", ["train.warmup_steps=1"])
    """
    cfg = load_config(config, list(overrides))
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, cfg.train.seed)
    opt = make_optimizer(cfg.train, model)
    state = opt.init(params)
    step = make_train_step(model, cfg.model, opt)
    tokens = data.from_config(cfg.data)
    for s in range(steps):
        params, state, _ = step(params, state, data.get_batch(tokens, s, batch_size=rows, seq_len=seq))
    return cfg, model, params, state


def fake_train_step(config: str, overrides, mesh):
    """A config's train step on ``mesh`` with fake bf16 parameters, optimizer state and batch (nothing
    allocated): ``(step, (params, opt_state, batch), param_axes)``, for auto-sharding.

        step, args, axes = fake_train_step("llama_tiny", [], sf.Mesh({"dp": 2, "tp": 2}, fake=True))
    """
    from shardfn.core._torch_private import fake_mode
    from shardfn.runtime.partitioned import expert_region, layout

    cfg = load_config(config, list(overrides))
    model = models.get(cfg.model_name)
    with fake_mode():
        params = model.init(cfg.model, 0, dtype=torch.bfloat16)
        opt = make_optimizer(cfg.train, model)
        opt_state = opt.init(params)
        shape = (cfg.train.batch_size, cfg.train.seq_len)
        batch = {"inputs": torch.zeros(shape, dtype=torch.long), "targets": torch.zeros(shape, dtype=torch.long)}
    experts = expert_region(model, cfg.model, mesh, layout(cfg, model, params, opt_state, mesh))
    return (
        make_train_step(model, cfg.model, opt, experts=experts),
        (params, opt_state, batch),
        model.param_axes(cfg.model),
    )


# ----------------------------------------------------------------------------- timing


def median_seconds(fn: Callable[[], object], n: int, warmup: int = 2) -> float:
    """The median wall time of ``n`` calls of ``fn`` after ``warmup`` untimed ones.

        median_seconds(lambda: step(params, state, batch), 10)
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ----------------------------------------------------------------------------- memory


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""Set in a process's environment before it starts, so that glibc maps every block of 128 KiB and
more on its own and unmaps it when freed (by default the threshold grows as large blocks are
freed, and later ones reuse heap pages already resident, which no RSS counter sees)."""


def peak_rss_increase(fn: Callable[[], object]) -> tuple[object, int]:
    """``fn()``'s result and the most bytes of resident memory it added at once (Linux: the peak
    RSS counter is reset first, then read back). In a process started with :data:`MEASURE_ENV`,
    CPU tensors of 128 KiB and more are their own mappings, returned when freed, so for them this
    is the allocator's peak; smaller ones may reuse heap pages already resident (counted as 0).

        out, peak = peak_rss_increase(lambda: step(params, state, batch))
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_bytes("VmRSS")
    out = fn()
    return out, _status_bytes("VmHWM") - before


def shared_experts_outside_exchange() -> Callable[[], None]:
    """Patches that restore the MoE layer's old order (the shared experts after the routed ones,
    outside the expert-parallel exchange), for comparing against it. Returns the undo."""
    from shardfn.runtime import moe_dispatch

    init = moe_dispatch.ExpertRegion.__init__

    def no_shared(self, *args, shared=False, **kwargs):  # takes_shared false: core.moe.moe_layer runs them after
        init(self, *args, shared=False, **kwargs)

    moe_dispatch.ExpertRegion.__init__ = no_shared

    def undo():
        moe_dispatch.ExpertRegion.__init__ = init
    return undo
