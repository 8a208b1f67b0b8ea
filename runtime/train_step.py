"""The training step as one pure function, and the optimizer every layout uses.

:func:`make_train_step` builds ``train_step(params, opt_state, batch) -> (params, opt_state,
metrics)``: forward, backward, gradient clipping and AdamW in one traceable function with no
host syncs. It is what runs on one device and what the partitioner traces and shards over a mesh;
a pipeline rank runs the same optimizer (:func:`make_optimizer`) on its stages' gradients. Run
eagerly it takes the eager forms of ``core`` (plain autograd, foreach optimizer kernels, GQA
without repeated heads: ``core.transforms.eager``); traced, it records autograd's backward
kernels too, and the optimizer's ops leaf by leaf. The two agree to float rounding.

    opt = make_optimizer(cfg.train, llama)
    step = make_train_step(llama, cfg.model, opt)
    params, opt_state, metrics = step(params, opt_state, batch)
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

from shardfn import models
from shardfn.core import optim
from shardfn.core.precision import Policy, get_policy, with_policy
from shardfn.core.pytree import PyTree, map_with_path, tree_map
from shardfn.core.regional import region
from shardfn.core.transforms import value_and_grad

StepFn = Callable[[PyTree, Any, dict], tuple[PyTree, Any, dict]]
"""``train_step(params, opt_state, batch) -> (params, opt_state, metrics)``."""


def trainable_mask(frozen: tuple[str, ...] = ()) -> Callable[[PyTree], PyTree]:
    """``params -> tree of bools``: False at the ``frozen`` paths (a model's ``FROZEN``), also when
    they sit under a prefix (a pipeline stage's ``stage1.moe_layers.router_bias``).

    Example:
        trainable_mask(("moe_layers.router_bias",))({"w": w, "moe_layers": {"router_bias": b}})
        # {"w": True, "moe_layers": {"router_bias": False}}
    """
    def frozen_path(path: str) -> bool:
        return any(path == f or path.endswith("." + f) for f in frozen)

    return lambda params: map_with_path(lambda path, _: not frozen_path(path), params)


def make_optimizer(train_cfg, model, *,
                   norm: Callable[[PyTree], torch.Tensor] = optim.global_norm) -> optim.GradientTransformation:
    """Clipping (if ``grad_clip``) then AdamW on a warmup-cosine schedule, from the ``train`` section.

    The model's ``FROZEN`` leaves are masked off (no update, no decay). ``norm`` is the clipping
    norm: the default for a whole tree (one device, or a partitioned step, whose DTensors sum
    over the mesh); a pipeline rank passes the norm over every stage.

    Example:
        opt = make_optimizer(load_config().train, llama)
        opt_state = opt.init(params)
    """
    model = models.get(model)
    t = train_cfg
    schedule = optim.warmup_cosine(t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
    adamw = optim.adamw(schedule, t.b1, t.b2, t.eps, t.weight_decay, mask=trainable_mask(model.FROZEN))
    return optim.chain(optim.clip_by_global_norm(t.grad_clip, norm=norm), adamw) if t.grad_clip else adamw


def step_metrics(loss: torch.Tensor, grads: PyTree, opt_state: Any, *,
                 norm: Callable[[PyTree], torch.Tensor] = optim.global_norm) -> dict[str, torch.Tensor]:
    """``loss``, ``grad_norm`` (before clipping: the clip state's, else ``norm(grads)``) and
    ``lr`` (what this step used), as 0-d tensors: the metrics every layout reports.

    Example:
        metrics = step_metrics(loss, grads, opt_state)
    """
    clip = optim.find_state(opt_state, optim.ClipByGlobalNormState)
    lr = optim.find_state(opt_state, optim.ScaleByLearningRateState)
    return {
        "loss": loss.detach(),
        "grad_norm": clip.global_norm if clip is not None else norm(grads),
        "lr": lr.lr if lr is not None else torch.zeros(()),
    }


def make_train_step(model, model_cfg, optimizer: optim.GradientTransformation, *,
                    skip_nonfinite: bool = False, experts: Callable | None = None,
                    precision: Policy | None = None, donate: bool = False) -> StepFn:
    """The pure training step: ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

    One call does the loss and its gradient (``model.loss_and_aux``), the optimizer update,
    :func:`~shardfn.core.optim.apply_updates`, and the model's non-gradient update
    (``model.aux_update``: an MoE router's selection bias moves by auxiliary-loss-free
    balancing). It reads no tensor on the host, so ``make_fx``, ``torch.compile`` and the
    partitioner can trace it whole.

    Args:
        model: a model module (``shardfn.models.llama``).
        model_cfg: that model's ``Config``.
        optimizer: e.g. :func:`make_optimizer`'s.
        skip_nonfinite: when this step's loss or gradient norm is NaN/Inf, return the incoming
            ``params`` and ``opt_state`` unchanged (:func:`keep_finite`; ``train.nonfinite=skip``).
        experts: how an MoE model's routed experts run (``model.loss_and_aux``'s ``experts``;
            a mesh step passes its per-rank region, ``runtime.partitioned.expert_region``).
        precision: a ``core.precision.Policy``: the loss computes in its ``compute_dtype`` (the
            parameters cast on the way in), the state and the gradients stay in the parameters'
            dtype (None: as the parameters are).
        donate: the caller gives ``params`` and ``opt_state`` to the step, as JAX's
            ``donate_argnums``: run eagerly, the optimizer writes the new values into their memory
            (``optim.update_and_apply(..., donate=True)``), as ``torch.optim`` does; the old values
            are gone after the call. A training loop that keeps only the new state passes it
            (``shardfn train`` does); it cannot go with ``skip_nonfinite``, which returns the old.

    Returns:
        ``train_step``; its ``metrics`` are 0-d tensors: :func:`step_metrics`, the aux values that
        are 0-d floats (``ce_loss``, ``balance_loss``) and ``model.aux_metrics`` (expert loads).

    Example:
        step = make_train_step(llama, cfg.model, make_optimizer(cfg.train, llama))
        params, opt_state, metrics = step(params, opt_state, batch)
    """
    if donate and skip_nonfinite:
        raise ValueError("make_train_step: donate=True writes the new state over the old, and skip_nonfinite "
                         "returns the old state on a NaN/Inf step; pass one of them (train.nonfinite=skip "
                         "runs without donation)")
    model = models.get(model)
    retain_freed_memory()
    loss_fn = lambda params, batch: model.loss_and_aux(params, batch, model_cfg, experts=experts)  # noqa: E731
    grad_fn = value_and_grad(with_policy(loss_fn, precision) if precision is not None else loss_fn, has_aux=True)

    @region
    def update(grads, opt_state, params):  # one compiled region under train.compile=true
        return optim.update_and_apply(optimizer, grads, opt_state, params, donate=donate)  # fused eagerly

    def train_step(params, opt_state, batch):
        before = (params, opt_state)
        (loss, aux), grads = grad_fn(params, batch)
        params, opt_state = update(grads, opt_state, params)
        params = model.aux_update(params, aux, model_cfg)
        metrics = step_metrics(loss, grads, opt_state)
        for key, x in aux.items():
            if x.ndim == 0 and x.is_floating_point() and key not in metrics:
                metrics[key] = x.detach()
        metrics.update(model.aux_metrics(aux))
        if skip_nonfinite:
            params, opt_state = keep_finite((params, opt_state), before, metrics)
        return params, opt_state, metrics

    return train_step


@functools.cache
def retain_freed_memory() -> None:
    """Let glibc keep, for the next step, the memory a training step frees (once per process).

    glibc serves blocks under its mmap threshold from the heap and hands the heap's free top back
    to the system once it exceeds twice that threshold. The threshold starts at 128 KiB and grows
    only when a block that was mapped on its own, and is larger, is freed. A step of pure
    functions makes new parameter-sized tensors and frees the old ones every step; under the
    first thresholds those pages go back to the system and the next step faults them in again
    (dim 256, 4 layers: thousands of page faults a step, ~3% of its time; more on a loaded
    machine).
    One block just under glibc's 32 MiB cap, never touched and freed at once, raises the
    threshold to the cap, as ``MALLOC_MMAP_THRESHOLD_`` would without fixing it. With another C
    library, or with the thresholds set in the environment, it changes nothing.

    Example:
        retain_freed_memory()  # make_train_step calls it
    """
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        glibc = False
    if glibc:
        torch.empty((31 << 20) // 4, dtype=torch.float32)  # mapped, never touched, unmapped at once


def keep_finite(new: Any, old: Any, metrics: dict) -> Any:
    """``new`` where ``metrics["loss"]`` and ``metrics["grad_norm"]`` are finite, else ``old``.

    A ``torch.where`` per leaf on a 0-d flag: no host sync, so it traces into (partitioned,
    compiled) steps, and the loop learns of a skip from the metrics it reads anyway.

    Example:
        params, opt_state = keep_finite((new_params, new_state), (params, opt_state), metrics)
    """
    ok = torch.isfinite(metrics["loss"]) & torch.isfinite(metrics["grad_norm"])
    return tree_map(lambda n, o: torch.where(ok, n, o), new, old)


def precision_policy(train_cfg) -> Policy:
    """The :class:`~shardfn.core.precision.Policy` of the ``train`` section (``precision``,
    ``reduce_dtype``).

        precision_policy(load_config(None, ["train.precision=bf16"]).train).compute_dtype  # bfloat16
    """
    return get_policy(train_cfg.precision, train_cfg.reduce_dtype)
