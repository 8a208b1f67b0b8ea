"""Shared by the layout tests: a config's train step run for a few steps on one device and under
a mesh (in spawned gloo ranks), returning losses, first-step gradients, final parameters and the
step's memory and communication reports."""

from typing import NamedTuple

import torch

import shardfn as sf
from shardfn import P, models
from shardfn.config import load_config
from shardfn.core.pytree import tree_leaves
from shardfn.core.transforms import value_and_grad
from shardfn.runtime import data
from shardfn.runtime.partitioned import expert_region, full, mesh_from_config, mesh_step
from shardfn.runtime.train_step import make_optimizer, make_train_step

STEPS = 3
BASE = ["train.batch_size=8", "train.seq_len=32", "train.warmup_steps=1"]


def setup(overrides, config=None):
    cfg = load_config(config, BASE + list(overrides))
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, cfg.train.seed)
    opt = make_optimizer(cfg.train, model)
    tokens = data.from_config(cfg.data)
    batches = [data.get_batch(tokens, s, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len,
                              seed=cfg.train.seed) for s in range(STEPS)]
    return cfg, model, params, opt, batches


def _grad_fn(model, cfg, experts=None):
    return value_and_grad(lambda p, b: model.loss(p, b, cfg.model, experts=experts))


def layout_worker(overrides, config=None):
    cfg, model, params, opt, batches = setup(overrides, config)
    state = opt.init(params)
    mesh = mesh_from_config(cfg)
    step = mesh_step(cfg, model, opt, params, mesh, backend=None)
    specs = step.specs
    grad_of = _grad_fn(model, cfg, expert_region(model, cfg.model, mesh, specs))
    grad_step = lambda p, b: (lambda lg: (lg[0], sf.constrain(lg[1], specs["params"])))(grad_of(p, b))  # noqa: E731
    grad_fn = sf.jit(grad_step,
                     mesh, in_specs=(specs["params"], specs["batch"]), out_specs=(P(), specs["params"]),
                     fsdp_argnums=(0,) if cfg.mesh.fsdp > 1 else (), backend=None)
    loss0, grads0 = grad_fn(params, batches[0])
    losses = []
    for b in batches:
        params, state, metrics = step(params, state, b)
        losses.append(metrics["loss"])
    lowered = step.jitted.lower(params, state, batches[-1])  # cached: the program that just ran
    return {"losses": torch.stack(losses), "grads": full(grads0), "params": full(params),
            "local": {k: tuple(v.to_local().shape) for k, v in _flat(params).items()},
            "memory": lowered.memory_report(), "comm": lowered.comm_report()}


_RUNS: dict = {}


def run_layout(overrides, nproc, config=None):
    """``layout_worker`` on ``nproc`` gloo ranks, run once per session for each layout: the
    parity tests and the plan-vs-real-run tests read the same run."""
    from shardfn.runtime.launch import spawn

    key = (tuple(overrides), nproc, config)
    if key not in _RUNS:
        _RUNS[key] = spawn(layout_worker, nproc, args=(list(overrides), config), timeout_s=600)
    return _RUNS[key]


def _flat(tree):
    from shardfn.core.pytree import flatten_with_paths

    return dict(flatten_with_paths(tree))


class Reference(NamedTuple):
    """One device's run: losses and gradient norms per step, first-step gradients, final params."""

    losses: torch.Tensor
    grads: dict
    params: dict
    norms: torch.Tensor


def assert_matches(out, ref, *, rtol=1e-5):
    """Every rank's losses (and gradient norms, when it reports them), first-step gradients and
    final parameters against one device's."""
    from shardfn.core.pytree import flatten_with_paths

    ref_losses, ref_grads, ref_params = ref.losses, ref.grads, ref.params
    for rank_out in out:
        torch.testing.assert_close(rank_out["losses"], ref_losses, rtol=rtol, atol=1e-6)
        if "norms" in rank_out:
            torch.testing.assert_close(rank_out["norms"], ref.norms, rtol=rtol, atol=1e-6)
        got_g, got_p = _flat(rank_out["grads"]), _flat(rank_out["params"])
        for path, g in flatten_with_paths(ref_grads):
            torch.testing.assert_close(got_g[path], g, rtol=rtol, atol=1e-6, msg=lambda m: f"grad {path}: {m}")
        # Adam divides by sqrt(v): where a gradient is near zero (~eps), its last-bit differences
        # (sums run in another order) move that element's update by up to ~1% of the lr (3e-3);
        # measured: 1-2 of 32768 elements differ, by at most 1.05e-5.
        for path, p in flatten_with_paths(ref_params):
            torch.testing.assert_close(got_p[path], p, rtol=rtol, atol=3e-5, msg=lambda m: f"param {path}: {m}")


def reference(config=None, overrides=()):
    cfg, model, params, opt, batches = setup(list(overrides), config)
    state = opt.init(params)
    step = make_train_step(model, cfg.model, opt)
    _, grads0 = _grad_fn(model, cfg)(params, batches[0])
    losses, norms = [], []
    for b in batches:
        params, state, metrics = step(params, state, b)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    return Reference(torch.stack(losses), grads0, params, torch.stack(norms))




def pipeline_worker(runs):
    """Each ``(config, overrides)`` of ``runs`` as a pipeline step (``mesh.pp > 1``) on these ranks:
    losses and gradient norms per step, the first step's gradients and the final parameters as
    full trees, and the step's reports."""
    from shardfn.runtime.pipeline_step import build_pipeline_step

    out = []
    for config, overrides in runs:
        cfg, model, params, _, batches = setup(overrides, config)
        step = build_pipeline_step(cfg, model, params)
        asked = []  # elements this rank's blocks asked the initialiser for

        def source(regions, cfg=cfg, model=model):
            asked.append(sum(_numel(box) for box in regions.values()))
            return model.init(cfg.model, cfg.train.seed, regions=regions)

        local = step.layout.from_source(source)
        state = step.optimizer.init(local)
        losses, norms, grads = [], [], None
        for b in batches:
            local, state, metrics = step(local, state, b)
            grads = step.gather(step.last_grads) if grads is None else grads
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
        out.append({"losses": torch.stack(losses), "norms": torch.stack(norms), "grads": grads,
                    "params": step.gather(local), "comm": step.comm_report(), "memory": step.memory_report(),
                    "pp_rank": step.pp_rank, "stages": step.stages, "built": sum(asked),
                    "held": sum(t.numel() for t in tree_leaves(local)), "total": sum(t.numel() for t in
                                                                                    tree_leaves(params)),
                    "handoffs": sum(event == "handoff" for _, _, log in step.last_run.turns for _, event, _ in log)})
    return out


def _numel(box) -> int:
    n = 1
    for sl in box:
        n *= sl.stop - sl.start
    return n


def run_pipelines(runs, nproc):
    """:func:`pipeline_worker` on ``nproc`` gloo ranks, once per session for each list of runs:
    ``[per run: [per rank: result]]``."""
    from shardfn.runtime.launch import spawn

    key = ("pipeline", tuple((c, tuple(o)) for c, o in runs), nproc)
    if key not in _RUNS:
        per_rank = spawn(pipeline_worker, nproc, args=([(c, list(o)) for c, o in runs],), timeout_s=900)
        _RUNS[key] = [[rank[i] for rank in per_rank] for i in range(len(runs))]
    return _RUNS[key]
