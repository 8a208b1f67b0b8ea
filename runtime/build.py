"""``build_step``: the one function that makes a run config's :class:`~shardfn.runtime.step.Step`,
whatever its layout.

- one device: the pure step of ``runtime.train_step`` (``torch.compile``'d with ``train.compile``);
- a mesh of more than one device: that step partitioned by ``sf.jit`` (``runtime.partitioned``);
- ``mesh.pp > 1``: this rank's pipeline stages run by a schedule (``runtime.pipeline_step``).

    step = build_step(cfg, model, abstract(shapes, device))
    params, opt_state = step.place(source)          # a full tree, or source(regions) -> {path: tensor}
    params, opt_state, metrics = step(params, opt_state, batch)
"""

from __future__ import annotations

import torch

from shardfn import models
from shardfn.core.pytree import PyTree
from shardfn.core.regional import with_compiled_layers
from shardfn.partition.passes.remat import rematerialized
from shardfn.runtime.param_source import full_tree
from shardfn.runtime.step import Step, identity_state
from shardfn.runtime.train_step import make_optimizer, make_train_step, precision_policy


def build_step(cfg, model, params: PyTree, *, record: bool = False, donate: bool = False) -> Step:
    """The step of the run config ``cfg`` for ``model`` on this rank.

    Args:
        cfg: a run config (``shardfn.config.RunConfig``).
        model: its model module (``models.get(cfg.model_name)``).
        params: a parameter tree (real or fake tensors, on the run's device) giving shapes and
            dtypes (``runtime.param_source.abstract``); ``step.place`` then builds the state from a
            full tree or a source of regions, each rank only its own blocks.
        record: pipelines: time every action, for ``step.write_trace``.
        donate: the caller hands each call's ``params`` and ``opt_state`` to the step, which may
            write the new state into them (the optimizer's update in place, as ``torch.optim``
            does; eager steps only: one device, or a mesh's uncompiled program). A loop that
            keeps only the returned state passes it; ``shardfn train`` does, unless
            ``train.nonfinite=skip`` needs the old state back.

    Example:
        step = build_step(cfg, llama, params)
    """
    model = models.get(model)
    if cfg.mesh.pp > 1:
        from shardfn.runtime.pipeline_step import pipeline_step

        return pipeline_step(cfg, model, params, record=record)
    optimizer = make_optimizer(cfg.train, model)
    if cfg.mesh.world_size > 1:
        from shardfn.runtime.partitioned import mesh_from_config, mesh_step

        return mesh_step(cfg, model, optimizer, params, mesh_from_config(cfg), donate=donate)
    return device_step(cfg, model, optimizer, params, donate=donate)


def device_step(cfg, model, optimizer, like: PyTree = None, *, donate: bool = False) -> Step:
    """The one-device :class:`~shardfn.runtime.step.Step`: plain tensors; with ``train.compile``
    its repeated layer compiled once (``whole``: the whole step as one graph); ``train.precision``
    its compute dtype, ``train.remat`` run as the traced step rewritten by ``partition.passes.remat``.
    ``like`` gives the tree's shapes for a ``place`` from a source; ``donate`` as :func:`build_step`.

    Example:
        step = device_step(cfg, llama, make_optimizer(cfg.train, llama))
    """
    model = models.get(model)
    skip = cfg.train.nonfinite == "skip"
    fn = make_train_step(model, cfg.model, optimizer, skip_nonfinite=skip, precision=precision_policy(cfg.train),
                         donate=donate and not skip)
    if cfg.train.remat != "none":  # the step's traced joint graph, rewritten by the remat pass
        fn = rematerialized(fn, cfg.train.remat, backend="inductor" if cfg.train.compile else None)
    elif cfg.train.compile == "whole":
        fn = torch.compile(fn)
    elif cfg.train.compile:  # one layer compiled once and run by every layer (core/regional.py)
        from shardfn.core.layer_search import mark_found_layers

        mark_found_layers(model, cfg.model)  # a model that marks none: the function its loss calls per layer
        fn = with_compiled_layers(fn)

    def place(params_or_source):
        params = full_tree(params_or_source, like)
        return params, optimizer.init(params)

    return Step("device", fn, optimizer, place, identity_state, identity_state, lambda params: params)
