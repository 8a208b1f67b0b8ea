"""The training step as one pure function, and the loop that drives it on one device.

:func:`make_train_step` builds ``train_step(params, opt_state, batch) -> (params, opt_state,
metrics)``: forward, backward, gradient clipping and AdamW in one traceable function with no host
syncs. It is the function the partitioner traces and shards; :func:`build_step` is the seam where
the loop gets the callable it runs (plain or ``torch.compile``'d on one device; a partitioned
``sf.jit`` step for a mesh). :func:`train` is the loop: data, logging, metrics and checkpoints
(sharded, atomic, reshardable: ``runtime/checkpoint.py``).

    cfg = load_config(None, ["train.steps=20"])
    result = train(cfg, metrics_path="metrics.jsonl")
    result.history[-1]["loss"]  # well below the first step's
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from shardfn.core import optim
from shardfn.core.pytree import PyTree, count, map_with_path, tree_map
from shardfn.core.transforms import value_and_grad
from shardfn.runtime import launch
from shardfn.runtime import checkpoint, data
from shardfn.runtime.checkpoint import (  # noqa: F401  (one format on any mesh; re-exported for the loop's users)
    checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint,
)

StepFn = Callable[[PyTree, Any, dict], tuple[PyTree, Any, dict]]
"""``train_step(params, opt_state, batch) -> (params, opt_state, metrics)``."""

FROZEN_SUFFIXES = ("router_bias",)
"""Parameters the optimizer leaves alone (the MoE router's selection bias has no gradient)."""


# ----------------------------------------------------------------------------- the step


def trainable_mask(params: PyTree) -> PyTree:
    """True for every leaf the optimizer updates; False for paths ending in :data:`FROZEN_SUFFIXES`.

    Example:
        trainable_mask({"w": w, "moe_layers": {"router_bias": b}})  # {"w": True, "moe_layers": {"router_bias": False}}
    """
    return map_with_path(lambda path, _: not path.endswith(FROZEN_SUFFIXES), params)


def make_optimizer(train_cfg) -> optim.GradientTransformation:
    """Clipping (if ``grad_clip``) then AdamW on a warmup-cosine schedule, from the ``train`` section.

    Leaves in :data:`FROZEN_SUFFIXES` are masked off (no update, no decay).

    Example:
        opt = make_optimizer(load_config().train)
        opt_state = opt.init(params)
    """
    t = train_cfg
    schedule = optim.warmup_cosine(t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
    adamw = optim.adamw(schedule, t.b1, t.b2, t.eps, t.weight_decay, mask=trainable_mask)
    return optim.chain(optim.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip else adamw


def make_train_step(model, model_cfg, optimizer: optim.GradientTransformation, *,
                    skip_nonfinite: bool = False) -> StepFn:
    """The pure training step: ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

    One call does the loss and its gradient, the optimizer update and
    :func:`~shardfn.core.optim.apply_updates`. It reads no tensor on the host, so ``make_fx``,
    ``torch.compile`` and the partitioner can trace it whole.

    Models with ``loss_and_aux`` (the MoE model) are differentiated through it: their 0-d
    floating-point aux values (``ce_loss``, ``balance_loss``) join the metrics, and the routers'
    selection bias ``moe_layers.router_bias`` -- masked off the optimizer, it has no gradient --
    moves by auxiliary-loss-free balancing (``core.moe.update_expert_bias``, at
    ``model_cfg.bias_update_rate``) from ``aux["expert_counts"]``.

    Args:
        model: a model module (``shardfn.models.llama``): ``loss(params, batch, cfg)`` or
            ``loss_and_aux(params, batch, cfg)``.
        model_cfg: that model's ``Config``.
        optimizer: e.g. :func:`make_optimizer`'s.
        skip_nonfinite: when this step's loss or gradient norm is NaN/Inf, return the incoming
            ``params`` and ``opt_state`` unchanged (:func:`keep_finite`; ``train.nonfinite=skip``).

    Returns:
        ``train_step``; its ``metrics`` are 0-d tensors: ``loss``, ``grad_norm`` (before
        clipping) and ``lr`` (the learning rate this step used), plus the aux scalars.

    Example:
        step = make_train_step(llama, cfg.model, make_optimizer(cfg.train))
        params, opt_state, metrics = step(params, opt_state, batch)
    """
    has_aux = hasattr(model, "loss_and_aux")
    loss = model.loss_and_aux if has_aux else model.loss
    grad_fn = value_and_grad(lambda params, batch: loss(params, batch, model_cfg), has_aux=has_aux)

    def train_step(params, opt_state, batch):
        before = (params, opt_state)
        value, grads = grad_fn(params, batch)
        loss, aux = value if has_aux else (value, {})
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        if "expert_counts" in aux:
            params = _balance_router_bias(params, aux["expert_counts"], model_cfg)
        clip = optim.find_state(opt_state, optim.ClipByGlobalNormState)
        lr = optim.find_state(opt_state, optim.ScaleByLearningRateState)
        metrics = {
            "loss": loss.detach(),
            "grad_norm": clip.global_norm if clip is not None else optim.global_norm(grads),
            "lr": lr.lr if lr is not None else torch.zeros(()),
        }
        for key, x in aux.items():
            if x.ndim == 0 and x.is_floating_point() and key not in metrics:
                metrics[key] = x.detach()
        if "expert_counts" in aux:  # [Lm, E] tokens per expert: load max / mean, per MoE layer
            counts = aux["expert_counts"].to(torch.float32)
            load = counts.amax(-1) / counts.mean(-1).clamp_min(1.0)
            for i in range(load.shape[0]):
                metrics[f"expert_load_max_over_mean/{i}"] = load[i]
        if skip_nonfinite:
            params, opt_state = keep_finite((params, opt_state), before, metrics)
        return params, opt_state, metrics

    return train_step


def keep_finite(new: Any, old: Any, metrics: dict) -> Any:
    """``new`` where ``metrics["loss"]`` and ``metrics["grad_norm"]`` are finite, else ``old``.

    A ``torch.where`` per leaf on a 0-d flag: no host sync, so it traces into (partitioned,
    compiled) steps, and the loop learns of a skip from the metrics it reads anyway.

    Example:
        params, opt_state = keep_finite((new_params, new_state), (params, opt_state), metrics)
    """
    ok = torch.isfinite(metrics["loss"]) & torch.isfinite(metrics["grad_norm"])
    return tree_map(lambda n, o: torch.where(ok, n, o), new, old)


def _balance_router_bias(params: PyTree, counts: torch.Tensor, model_cfg) -> PyTree:
    """``params`` with ``moe_layers.router_bias`` [Lm, E] moved toward balanced expert loads."""
    from shardfn.core.moe import update_expert_bias

    layers = params.get("moe_layers", {}) if isinstance(params, dict) else {}
    if "router_bias" not in layers:
        return params
    bias = update_expert_bias(layers["router_bias"], counts, model_cfg.bias_update_rate)
    return {**params, "moe_layers": {**layers, "router_bias": bias}}


def build_step(cfg, model, optimizer: optim.GradientTransformation, params: PyTree, opt_state: Any,
               *, record: bool = False) -> StepFn:
    """The step callable the loop runs for the run config ``cfg``.

    On one device this is :func:`make_train_step`'s function, ``torch.compile``'d when
    ``train.compile`` is set. This is the one place a mesh-aware step plugs in: for a mesh of more
    than one device, return the same ``train_step`` partitioned with ``sf.jit`` (same signature,
    global batch in, metrics out; ``params`` and ``opt_state`` are the initial values, for
    deriving their specs), and the loop is unchanged.

    Example:
        step = build_step(cfg, llama, opt, params, opt.init(params))
        params, opt_state, metrics = step(params, opt_state, batch)
    """
    if cfg.mesh.pp > 1:
        return _pipeline_step(cfg, model, params, record=record)
    if cfg.mesh.world_size > 1:
        from shardfn.runtime.partitioned import mesh_from_config, partitioned_step

        return partitioned_step(cfg, model, optimizer, params, opt_state, mesh_from_config(cfg))
    step = make_train_step(model, cfg.model, optimizer, skip_nonfinite=cfg.train.nonfinite == "skip")
    if cfg.train.compile:
        step = torch.compile(step)
    return step


def _pipeline_step(cfg, model, params: PyTree, *, record: bool = False) -> StepFn:
    """The pipeline step of this rank with the loop's contract: the first call takes the full
    initial tree and keeps only this rank's stages (and their optimizer state); later calls
    thread those local trees."""
    from shardfn.runtime.executor import build_pipeline_step

    step = build_pipeline_step(cfg, model, params, record=record)
    last_norm = {}  # the latest grad_norm: the one-device optimizer state records it (clipping)

    def run(params, opt_state, batch):
        if not (isinstance(params, dict) and params and all(k.startswith("stage") for k in params)):
            params = step.scatter(params)
            opt_state = step.optimizer.init(params)
        new_params, new_state, metrics = step(params, opt_state, batch)
        if cfg.train.nonfinite == "skip":  # loss and grad_norm are global: every rank skips alike
            new_params, new_state = keep_finite((new_params, new_state), (params, opt_state), metrics)
        last_norm["grad_norm"] = metrics["grad_norm"]
        return new_params, new_state, metrics

    def to_checkpoint(params_local, opt_state):
        """What a save writes: the full trees' structure with this rank's slices as blocks
        (``runtime.checkpoint_blocks``), the optimizer state in :func:`make_optimizer`'s structure."""
        blocks, adam = step.checkpoint_blocks(params_local), step.state_blocks(opt_state)
        if not cfg.train.grad_clip:
            return blocks, adam
        norm = last_norm.get("grad_norm", torch.zeros(()))
        return blocks, (optim.ClipByGlobalNormState(norm.detach().float().reshape(())), adam)

    def checkpoint_like(params_full, opt_state_full):
        """What a load fills in place: this rank's slices of the run's initial trees, as blocks."""
        local = step.scatter(params_full)
        return to_checkpoint(local, step.optimizer.init(local))

    def from_checkpoint(params_blocks, opt_state_blocks):
        """This rank's stages and their optimizer state, from loaded blocks."""
        adam = opt_state_blocks[1] if cfg.train.grad_clip else opt_state_blocks
        return step.from_blocks(params_blocks), step.state_from_blocks(adam, params_blocks)

    run.write_trace = step.write_trace  # Chrome trace of the latest step's actions, all ranks
    run.to_checkpoint, run.checkpoint_like, run.from_checkpoint = to_checkpoint, checkpoint_like, from_checkpoint
    return run


# ----------------------------------------------------------------------------- the loop


class TrainResult(NamedTuple):
    """What :func:`train` returns."""

    params: PyTree
    opt_state: Any
    history: list  # one dict per step run: step, loss, grad_norm, lr, tokens_per_s, time_s
    seconds: float  # wall time of the loop (compilation included)


def nonfinite_message(values: dict) -> str | None:
    """``"loss is nan, grad_norm is inf"`` when a step's loss or grad_norm is not finite, else None.

    Example:
        nonfinite_message({"loss": float("nan"), "grad_norm": 1.0})  # 'loss is nan'
    """
    bad = [f"{k} is {values[k]}" for k in ("loss", "grad_norm") if k in values and not math.isfinite(values[k])]
    return ", ".join(bad) or None


def is_main_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def train(cfg, metrics_path: str | os.PathLike | None = None, log: Callable[[str], Any] = print,
          trace_dir: str | os.PathLike | None = None) -> TrainResult:
    """Train ``cfg.model`` for ``cfg.train.steps`` steps on one device.

    With ``train.checkpoint.every`` it saves sharded checkpoints to ``train.checkpoint.dir`` and
    resumes from the newest complete one there, as ``train.checkpoint.resume`` says (see
    :func:`shardfn.runtime.checkpoint.resume_path`), on any mesh whatever mesh saved it.

    Args:
        cfg: a :class:`~shardfn.core.config.RunConfig`.
        metrics_path: if given, one JSON object per step is written there
            (``step``, ``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``time_s``).
        log: where progress lines go (every ``train.log_every`` steps, and the first and last).
        trace_dir: pipeline runs (``mesh.pp > 1``) write the last step's Chrome trace there.

    ``runtime.threads`` sets torch's CPU thread count for the run (restored afterwards).

    Returns:
        A :class:`TrainResult` with the final parameters and optimizer state and the per-step metrics.

    Example:
        result = train(load_config(None, ["train.steps=20"]), metrics_path="m.jsonl")
        [m["loss"] for m in result.history]
    """
    threads = torch.get_num_threads()
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    try:
        return _train(cfg, metrics_path, log, trace_dir)
    finally:
        torch.set_num_threads(threads)


def _train(cfg, metrics_path, log, trace_dir) -> TrainResult:
    from shardfn import models

    t = cfg.train
    if not is_main_rank():
        log, metrics_path = (lambda line: None), None  # one voice: rank 0 logs and writes metrics
    device = torch.device(cfg.runtime.device)
    model = models.get(cfg.model_name)
    if t.init_from:  # Hugging Face safetensors (models/hf.py); checkpoints still resume over them
        from shardfn.models import hf

        params = hf.load(t.init_from, cfg.model_name, cfg.model, device=device)
    else:
        params = model.init(cfg.model, t.seed, device=device)
    optimizer = make_optimizer(t)
    opt_state = optimizer.init(params)
    start = 0
    ckpt = t.checkpoint
    found = checkpoint.resume_path(cfg)  # by train.checkpoint.resume; None: step 0
    step_fn = build_step(cfg, model, optimizer, params, opt_state, record=trace_dir is not None)
    if found is not None:  # in the step's layout: DTensors of its specs on a mesh, whatever mesh saved it
        start, params, opt_state, *_ = checkpoint.restore(found, cfg, step_fn, params, opt_state)
        log(f"resuming from {found} (step {start})")
    tokens = data.from_config(cfg.data)

    where = f"{device} ({torch.get_num_threads()} threads)" if device.type == "cpu" else str(device)
    log(f"{cfg.model_name}: {count(params):,} params on {where}, mesh world size {cfg.mesh.world_size}, "
        f"batch {t.batch_size}x{t.seq_len}, steps {start}->{t.steps}{', compiled' if t.compile else ''}")
    history: list[dict] = []
    sink = open(metrics_path, "a" if start else "w") if metrics_path else None
    loop_start = time.perf_counter()
    try:
        for step in range(start, t.steps):
            launch.progress(step)  # under `spawn`: the launcher's view of this rank (and test faults)
            batch = data.get_batch(tokens, step, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed, device=device)
            tic = time.perf_counter()
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            values = {k: float(v) for k, v in metrics.items()}  # the one host sync per step
            seconds = time.perf_counter() - tic
            record = {"step": step + 1, **values, "tokens_per_s": t.tokens_per_step / seconds, "time_s": seconds}
            bad = nonfinite_message(values)
            if bad and t.nonfinite == "skip":
                record["skipped"] = True
            history.append(record)
            if sink:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
            if bad and t.nonfinite == "raise":
                raise FloatingPointError(
                    f"step {step + 1}: {bad}; the run stopped there (no checkpoint after it). Lower train.lr, "
                    f"set train.grad_clip, or set train.nonfinite=skip to skip such updates")
            if bad:
                log(f"step {step + 1}: {bad}; skipped the update (train.nonfinite=skip)")
            done = step + 1
            if done == start + 1 or done % t.log_every == 0 or done == t.steps:
                window = history[-min(len(history), t.log_every):]
                tps = t.tokens_per_step * len(window) / sum(r["time_s"] for r in window)
                log(f"step {done:>{len(str(t.steps))}}/{t.steps}  loss {values['loss']:.4f}  "
                    f"lr {values['lr']:.2e}  grad_norm {values['grad_norm']:.3f}  tok/s {tps:,.0f}")
            if ckpt.every and (done % ckpt.every == 0 or done == t.steps):
                saved = step_fn.to_checkpoint(params, opt_state) if hasattr(step_fn, "to_checkpoint") else (params, opt_state)
                save_checkpoint(ckpt.dir, done, *saved, keep=ckpt.keep, config=cfg.to_dict())
    finally:
        if sink:
            sink.close()
    seconds = time.perf_counter() - loop_start
    if trace_dir is not None:
        if not hasattr(step_fn, "write_trace"):
            raise ValueError("--trace records pipeline schedules: set mesh.pp > 1")
        path = step_fn.write_trace(Path(trace_dir) / "pipeline_trace.json")
        if path is not None:
            log(f"wrote the last step's schedule timings to {path} (chrome://tracing)")
    if history:
        log(f"done: {len(history)} steps in {seconds:.1f}s, loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
    return TrainResult(params, opt_state, history, seconds)
