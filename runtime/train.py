"""The training loop: data, logging, metrics and checkpoints around one layout's step.

:func:`train` builds the run's :class:`~shardfn.runtime.step.Step` (``runtime.build``), places
the initial parameters in its layout, resumes from a checkpoint when there is one
(``runtime.checkpoint``: sharded, atomic, reshardable), and runs ``train.steps`` steps.

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

from shardfn import models
from shardfn.core.pytree import PyTree, count
from shardfn.partition.mesh import local_device
from shardfn.runtime import checkpoint, data, launch, run_identity
from shardfn.runtime.build import build_step
from shardfn.runtime.checkpoint import save_checkpoint
from shardfn.runtime.errors import NonFiniteError
from shardfn.runtime.param_source import abstract

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

    With ``train.checkpoint.every`` it saves sharded checkpoints to ``train.checkpoint.dir`` (when
    null, the run's own directory: :func:`shardfn.runtime.run_identity.run_directory`) and resumes
    from the newest complete one there, as ``train.checkpoint.resume`` says (see
    :func:`shardfn.runtime.run_identity.resume_path`), on any mesh whatever mesh saved it. A resume
    logs the config keys changed since the checkpoint and refuses another model
    (:func:`shardfn.runtime.run_identity.check_resume`).

    Args:
        cfg: a run config (``shardfn.config.RunConfig``).
        metrics_path: if given, one JSON object per step is written there
            (``step``, ``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``time_s``), strict JSON
            (a non-finite value is ``null``).
        log: where progress lines go (every ``train.log_every`` steps, and the first and last).
        trace_dir: pipeline runs (``mesh.pp > 1``) write the last step's Chrome trace there.

    ``runtime.threads`` sets torch's CPU thread count for the run (restored afterwards).

    Returns:
        A :class:`TrainResult` with the final parameters and optimizer state and the per-step metrics.

    Raises:
        NonFiniteError: a step's loss or grad_norm is NaN or Inf under ``train.nonfinite=raise``
            (a :class:`~shardfn.runtime.errors.RunError`, as is a checkpoint of another model).

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

    cfg = run_identity.with_run_directory(cfg)  # train.checkpoint.dir null: the run's own directory
    t = cfg.train
    if not is_main_rank():
        log, metrics_path = (lambda line: None), None  # one voice: rank 0 logs and writes metrics
    device = local_device(cfg.runtime.device)  # "cuda": this rank's cuda:LOCAL_RANK
    model = models.get(cfg.model_name)
    if t.init_from:  # Hugging Face safetensors (models/hf/); checkpoints still resume over them
        from shardfn.models import hf

        def source(regions):
            return hf.load(t.init_from, cfg.model_name, cfg.model, device=device, regions=regions)
    else:
        def source(regions):
            return model.init(cfg.model, t.seed, device=device, regions=regions)
    tokens = data.from_config(cfg.data)  # a missing data file fails before anything is built
    start = 0
    ckpt = t.checkpoint
    found = run_identity.resume_path(ckpt)  # by train.checkpoint.resume; None: step 0
    changes = run_identity.check_resume(found, cfg.to_dict()) if found is not None else []  # another model: an error
    shapes = model.init(cfg.model, t.seed, device="meta")
    # the loop keeps only each step's new state: the step may write it over the old (donate)
    step_fn = build_step(cfg, model, abstract(shapes, device), record=trace_dir is not None, donate=True)
    n_params = count(shapes)
    params, opt_state = step_fn.place(source)  # each rank builds only what it holds
    if found is not None:  # in the step's layout: DTensors of its specs on a mesh, whatever mesh saved it
        start, params, opt_state, *_ = checkpoint.restore(found, step_fn, params, opt_state, config=cfg.to_dict())
        changed = f"; changed since the checkpoint: {', '.join(changes)}" if changes else ""
        log(f"resuming from {found} (step {start}){changed}")

    where = f"{device} ({torch.get_num_threads()} threads)" if device.type == "cpu" else str(device)
    saves = f", checkpoints every {ckpt.every} steps in {ckpt.dir}" if ckpt.every else ""
    log(f"{cfg.model_name}: {n_params:,} params on {where}, mesh world size {cfg.mesh.world_size}, "
        f"batch {t.batch_size}x{t.seq_len}, steps {start}->{t.steps}{', compiled' if t.compile else ''}{saves}")
    setup = first_step_work(cfg)
    history: list[dict] = []
    sink = open(metrics_path, "a" if start else "w") if metrics_path else None
    loop_start = time.perf_counter()
    try:
        for step in range(start, t.steps):
            launch.progress(step)  # under `spawn`: the launcher's view of this rank (and test faults)
            batch = data.get_batch(tokens, step, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed, device=device)
            if step == start and setup:
                log(f"{setup} ...")
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
                sink.write(metrics_line(record) + "\n")
                sink.flush()
            if bad and t.nonfinite == "raise":
                raise nonfinite_error(cfg, step + 1, bad, first=step == 0)
            if bad:
                log(f"step {step + 1}: {bad}; skipped the update (train.nonfinite=skip)")
            done = step + 1
            if done == start + 1 or done % t.log_every == 0 or done == t.steps:
                log(progress_line(t, values, done, history, setup))
            if ckpt.every and (done % ckpt.every == 0 or done == t.steps):
                save_checkpoint(ckpt.dir, done, *step_fn.to_checkpoint(params, opt_state), keep=ckpt.keep,
                                config=cfg.to_dict())
    finally:
        if sink:
            sink.close()
    seconds = time.perf_counter() - loop_start
    if trace_dir is not None:
        if step_fn.write_trace is None:
            raise ValueError("--trace records pipeline schedules: set mesh.pp > 1")
        path = step_fn.write_trace(Path(trace_dir) / "pipeline_trace.json")
        if path is not None:
            log(f"wrote the last step's schedule timings to {path} (chrome://tracing)")
    if history:
        log(f"done: {len(history)} steps in {seconds:.1f}s, loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
    return TrainResult(params, opt_state, history, seconds)


# ----------------------------------------------------------------------------- what the loop prints


def first_step_work(cfg) -> str | None:
    """What the first call of the step does besides the step, as the line announcing it; None
    when it does nothing worth announcing (one device, eager).

    Example:
        first_step_work(load_config(None, ["mesh.dp=2", "mesh.tp=2"]))  # 'lowering and compiling the step on dp2 x tp2'
    """
    axes = [f"{name}{size}" for name, size in cfg.mesh.axes().items() if size > 1]
    if axes:
        return f"lowering and compiling the step on {' x '.join(axes)}"
    if not cfg.train.compile:
        return None
    if cfg.train.compile == "whole" or cfg.train.remat != "none":
        return "compiling the whole step (train.compile)"
    model = models.get(cfg.model_name)
    if not model.compiled_layer_fns():
        from shardfn.core.layer_search import unmarked_layers_line

        return unmarked_layers_line(model, cfg.model)
    return "compiling one layer, which every layer then runs (train.compile)"


def progress_line(t, values: dict, done: int, history: list, setup: str | None = None) -> str:
    """The log line after step ``done``: loss, lr, grad_norm, and the tokens per second of the
    last ``train.log_every`` steps of ``history`` (this run's records) with its first step left
    out -- that one also lowers and compiles the step, so its own line gives its time instead.
    ``setup`` is :func:`first_step_work`'s line (None: nothing to build).

    Example:
        progress_line(cfg.train, values, 40, history)
        # 'step  40/200  loss 2.1674  lr 2.93e-03  grad_norm 0.718  tok/s 39,185'
    """
    head = (f"step {done:>{len(str(t.steps))}}/{t.steps}  loss {values['loss']:.4f}  lr {values['lr']:.2e}  "
            f"grad_norm {values['grad_norm']:.3f}")
    if len(history) == 1:
        return f"{head}  first step{' (build + compile)' if setup else ''} {history[0]['time_s']:.1f} s"
    window = history[1:][-t.log_every:]
    return f"{head}  tok/s {t.tokens_per_step * len(window) / sum(r['time_s'] for r in window):,.0f}"


def metrics_line(record: dict) -> str:
    """One line of the ``--metrics`` file: strict JSON, a non-finite number written as ``null``.

    Example:
        metrics_line({"step": 7, "loss": float("nan")})  # '{"step": 7, "loss": null}'
    """
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


def nonfinite_error(cfg, step: int, bad: str, *, first: bool) -> NonFiniteError:
    """The error of a step whose loss or gradient norm is not finite, with the advice that holds
    for ``cfg`` (``first``: no update had been applied yet, so no hyperparameter caused it).

    Example:
        raise nonfinite_error(cfg, 7, "loss is nan, grad_norm is nan", first=False)
    """
    t = cfg.train
    if first:
        advice = ("no update had been applied, so the initial parameters"
                  f"{f' (train.init_from={t.init_from})' if t.init_from else ''} or the data"
                  f"{f' (data.path={cfg.data.path})' if cfg.data.path else ''} hold NaN or Inf, or the model "
                  f"overflows on them; train.nonfinite=skip skips such updates")
    else:
        fixes = [f"lower train.lr (now {t.lr:g})"]
        if t.grad_clip is None:
            fixes.append("set train.grad_clip (e.g. 1.0; it is null)")
        advice = f"{', '.join(fixes)}, or set train.nonfinite=skip to skip such updates"
    ckpt = t.checkpoint
    last = checkpoint.latest_checkpoint(ckpt.dir) if ckpt.every and ckpt.dir else None
    kept = f"the newest checkpoint, {last}, is from before it" if last else "no checkpoint after it"
    return NonFiniteError(f"step {step}: {bad}; the run stopped there ({kept}). To go on: {advice}")
