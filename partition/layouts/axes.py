"""Layout facts, each in one place: mesh axes, logical-axis rules, the specs they give, and the
checks that a layout fits a model and a batch.

Mesh axes are ``pp dp fsdp cp ep tp``, major to minor (``tp`` varies fastest, so it stays within a
node). The default rules give the textbook layouts: ``dp`` replicates parameters and splits the
batch; ``fsdp`` also splits every weight's ``embed`` dim (ZeRO-3: stored sharded, gathered on
use); ``tp`` splits ``heads``/``kv_heads``/``mlp``/``expert_mlp``/``vocab`` column-then-row
(Megatron); ``ep`` splits ``expert`` and acts as one more data axis elsewhere; ``pp`` splits the
``layers`` into pipeline stages (``partition.pipeline.split``); ``cp`` splits the ``seq`` dim of every
activation (context parallelism, ``partition.spmd.context_rules``: the batch's tokens load-balanced, K/V
gathered per attention layer). ``cp`` is listed in a mesh only when it is > 1
(:data:`AXIS_ORDER`), so meshes and plans without it are as before.

    rules = resolve_rules(cfg.rules, mesh.axes)
    specs = param_specs(model.param_axes(model_cfg), rules, mesh.axes)
    check_model(model, model_cfg, mesh.axes, rules)     # LayoutError naming mesh.tp, mesh.ep, ...
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

import optree
import torch

from shardfn import models
from shardfn.core.pytree import flatten_with_paths
from shardfn.models.contract import PARAM_AXES
from shardfn.partition.errors import LayoutError
from shardfn.partition.spec import P, entry_axes, specs_from_rules

AXIS_ORDER = ("pp", "dp", "fsdp", "cp", "ep", "tp")
"""Every mesh axis name, major to minor."""

MESH_AXES = tuple(a for a in AXIS_ORDER if a != "cp")
"""The mesh axes every mesh lists (size 1 when unused), major to minor; ``cp`` joins them where
it is > 1 (:func:`mesh_axes`). The planner models these."""

SEQUENCE_AXIS = "cp"
"""The mesh axis that splits the sequence (the default ``rules.seq``)."""

DATA_AXES = ("dp", "fsdp", "ep")
"""The axes the global batch is split over by default (``rules.batch``)."""

LOGICAL_AXES = ("batch", "seq", *PARAM_AXES)
"""Logical axis names that rules may map: the activations' ``batch`` and ``seq``, and every name a
parameter dim may carry (``models.contract.PARAM_AXES``; docs/models.md)."""

DEFAULT_RULES: dict[str, Any] = {
    "batch": list(DATA_AXES),  # the global batch is split over every data-parallel axis
    "seq": SEQUENCE_AXIS,  # context parallelism: activations split over the sequence
    "vocab": "tp",
    "embed": "fsdp",  # ZeRO-3: parameters sharded along their embed dim
    "heads": "tp",  # Megatron tensor parallelism: column-parallel q/k/v, row-parallel o
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "expert": "ep",
    "expert_mlp": "tp",
    "q_lora": None,
    "kv_lora": None,
    "layers": None,  # pipeline stages split the layers (partition.pipeline.split)
    "norm": None,
}
"""Rules for any logical axis a config does not mention (MaxText/TorchTitan-like layout)."""


def mesh_axes(sizes: Mapping[str, int], *, include_pp: bool = True) -> dict[str, int]:
    """``sizes`` as ordered mesh axes (missing ones are 1; ``cp`` only when > 1); ``pp`` left out
    unless asked.

    Example:
        mesh_axes({"tp": 2, "dp": 2}, include_pp=False)   # {'dp': 2, 'fsdp': 1, 'ep': 1, 'tp': 2}
        mesh_axes({"cp": 2}, include_pp=False)            # {'dp': 1, 'fsdp': 1, 'cp': 2, 'ep': 1, 'tp': 1}
    """
    return {a: int(sizes.get(a, 1)) for a in AXIS_ORDER
            if (include_pp or a != "pp") and (a in MESH_AXES or int(sizes.get(a, 1)) > 1)}


def resolve_rules(user_rules: Mapping | None, axes: Mapping[str, int]) -> dict[str, Any]:
    """:data:`DEFAULT_RULES` updated by ``user_rules``, each target narrowed to the axes in ``axes``.

    Raises:
        ValueError: a rule names an axis that is neither in ``axes`` nor a mesh axis.

    Example:
        resolve_rules({"embed": None}, {"dp": 2, "tp": 2})["heads"]   # 'tp'
    """
    rules = dict(DEFAULT_RULES)
    rules.update(user_rules or {})
    out = {}
    for logical, target in rules.items():
        names = entry_axes(target)
        for name in names:
            if name not in axes and name not in AXIS_ORDER:
                raise ValueError(f"rules.{logical}: unknown mesh axis {name!r}; the mesh has axes {tuple(axes)}")
        kept = [n for n in names if n in axes]
        out[logical] = kept[0] if len(kept) == 1 else (kept or None)
    return out


def param_specs(axes_tree: Any, rules: dict, axes: Mapping[str, int]) -> Any:
    """A ``P`` per parameter from its logical axes (the ``batch`` rule is for activations)."""
    return specs_from_rules(axes_tree, {k: v for k, v in rules.items() if k != "batch"}, dict(axes))


def batch_axes(rules: Mapping, axes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that split the batch (``rules.batch``), major to minor."""
    return tuple(n for n in entry_axes(rules.get("batch")) if axes.get(n, 1) > 1)


def seq_axes(rules: Mapping, axes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that split the sequence (``rules.seq``: ``cp`` by default)."""
    return tuple(n for n in entry_axes(rules.get("seq")) if axes.get(n, 1) > 1)


def seq_split(rules: Mapping, axes: Mapping[str, int]) -> int:
    """How many ways the sequence is split: the product of the sequence axes' sizes."""
    return math.prod(axes[n] for n in seq_axes(rules, axes))


def batch_spec(rules: Mapping, axes: Mapping[str, int]) -> P:
    """The spec of a ``[batch, seq, ...]`` array: its first dim over the batch axes, its second
    over the sequence axes (when ``rules.seq`` names one of size > 1).

        batch_spec(resolve_rules(None, {"dp": 2, "cp": 2}), {"dp": 2, "cp": 2})   # P('dp', 'cp')
    """
    names, seq = batch_axes(rules, axes), seq_axes(rules, axes)
    first = names if len(names) > 1 else (names[0] if names else None)
    if not seq:
        return P(first)
    return P(first, seq if len(seq) > 1 else seq[0])


def data_size(rules: Mapping, axes: Mapping[str, int]) -> int:
    """How many ways the global batch is split: the product of the batch axes' sizes."""
    return math.prod(axes.get(n, 1) for n in entry_axes(rules.get("batch")))


def state_specs(state: Any, params: Any, specs: Any) -> Any:
    """Specs for an optimizer state: every subtree shaped like ``params`` takes the params'
    specs; every other leaf (step counts, scalars) is replicated.

        state_specs(opt.init(params), params, specs)
    """
    params_def = optree.tree_structure(params, none_is_leaf=False)

    def like_params(x) -> bool:
        return optree.tree_structure(x, none_is_leaf=False) == params_def

    return optree.tree_map(
        lambda sub: specs if like_params(sub) else P(),
        state,
        is_leaf=like_params,
        none_is_leaf=False,
    )


# ----------------------------------------------------------------------------- checks


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_seq(seq_len: int, split: int) -> None:
    """Raise :class:`LayoutError` unless ``seq_len`` splits into ``2 * split`` equal chunks (each
    context-parallel rank holds two, for causal load balance; ``partition.spmd.context_rules``).

    Example:
        check_seq(100, 8)   # LayoutError: train.seq_len: 100 is not divisible by 2 * mesh.cp = 16; ...
    """
    if split > 1 and seq_len % (2 * split):
        raise LayoutError("train.seq_len", f"{seq_len} is not divisible by 2 * mesh.cp = {2 * split} (each "
                                           f"context-parallel rank holds two equal chunks of the sequence); use a "
                                           f"multiple of {2 * split}")


def check_batch(batch_size: int, data: int, microbatches: int = 1, *, data_axes=DATA_AXES) -> None:
    """Raise :class:`LayoutError` unless the global batch splits over ``data`` ranks and then
    into ``microbatches`` equal microbatches per rank.

    Example:
        check_batch(16, data=3)   # LayoutError: train.batch_size: 16 is not divisible by ...
    """
    axes = "*".join(data_axes)
    if batch_size % data:
        raise LayoutError("train.batch_size", f"{batch_size} is not divisible by the data-parallel size {axes} = "
                                              f"{data}; use a multiple of {data}")
    per_rank = batch_size // data
    if per_rank % microbatches:
        raise LayoutError("pipeline.microbatches", f"{microbatches} does not divide the per-rank batch "
                                                   f"train.batch_size / ({axes}) = {per_rank}; use one of "
                                                   f"{divisors(per_rank)}")


def check_divides(names, axes: Mapping[str, int], key: str, count: int) -> None:
    """Raise :class:`LayoutError` unless the mesh axes ``names`` together divide ``count`` (the
    model config's ``key``: heads, experts), which they split in whole units.

    Example:
        check_divides(["ep"], {"ep": 3}, "n_experts", 8)   # mesh.ep: 3 does not divide model.n_experts = 8; ...
    """
    n = math.prod(axes[a] for a in names)
    if n > 1 and count % n:
        axis = names[-1]
        over = f" (split over {tuple(names)})" if len(names) > 1 else ""
        raise LayoutError(f"mesh.{axis}", f"{axes[axis]} does not divide model.{key} = {count}{over}: every rank "
                                          f"holds the same number; use one of {divisors(count)}")


def check_stages(n_layers: int, pp: int, n_stages: int | None = None) -> None:
    """Raise :class:`LayoutError` unless ``pp`` ranks holding ``n_stages`` stages (default one
    each) fit ``n_layers`` layers: a stage holds at least one layer.

    Example:
        check_stages(2, pp=4)   # LayoutError: mesh.pp: 4 pipeline stages for model.n_layers = 2 layers; ...
    """
    stages = pp if n_stages is None else n_stages
    if pp > n_layers:
        raise LayoutError("mesh.pp", f"{pp} pipeline stages for model.n_layers = {n_layers} layers; "
                                     f"use at most {n_layers}")
    if stages > n_layers:
        per_rank = stages // max(pp, 1)
        raise LayoutError("mesh.pp", f"{pp} ranks x {per_rank} stages each = {stages} stages for "
                                     f"{n_layers} layers; use mesh.pp <= {n_layers // per_rank}")


def check_model(model, model_cfg, axes: Mapping[str, int], rules: Mapping | None = None, *,
                n_stages: int | None = None) -> None:
    """Raise :class:`LayoutError` naming the mesh axis when a layout cannot split ``model``.

    Checks, in order: ``pp`` (or ``n_stages``) against the layers; every logical axis the model
    counts in whole units (``model.layout_units``: heads, kv heads, experts) against the mesh
    axes its rule splits it over; and every parameter dim against the axes it is split over.

    Example:
        check_model(moe, cfg, {"ep": 3})   # LayoutError: mesh.ep: 3 does not divide model.n_experts = 8; ...
    """
    model = models.get(model)
    rules = resolve_rules(rules, axes)
    check_stages(sum(n for _, n in model.stacks(model_cfg)), axes.get("pp", 1), n_stages)
    units = model.layout_units(model_cfg)
    expert_axes = [n for n in entry_axes(rules.get("expert")) if axes.get(n, 1) > 1]
    if expert_axes and "expert" not in units:
        name = expert_axes[-1]
        raise LayoutError(f"mesh.{name}", f"{axes[name]}, but model {model.name!r} has no parameter dim on the "
                                          f"logical axis 'expert', so there are no experts to split; give the "
                                          f"experts' dim the axis 'expert' in its param_table, or set mesh.{name}=1")
    if expert_axes and not model.takes_experts():
        name = expert_axes[-1]
        warnings.warn(f"mesh.{name}={axes[name]}: model {model.name!r}'s loss takes no experts=, so its experts run "
                      f"where they are called: stored split over {name} and all-gathered on use, with no all-to-all "
                      f"exchange of tokens (correct, but not expert parallelism; docs/models.md)", stacklevel=2)
    for logical, (key, count) in units.items():
        names = [n for n in entry_axes(rules.get(logical)) if axes.get(n, 1) > 1]
        check_divides(names, axes, key, count)
    specs = param_specs(model.param_axes(model_cfg), rules, axes)
    params = model.init(model_cfg, 0, device="meta", dtype=torch.float32)
    spec_leaves = optree.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P), none_is_leaf=False)
    for (path, x), spec in zip(flatten_with_paths(params), spec_leaves):
        for dim, entry in enumerate(spec):
            names = entry_axes(entry)
            n = math.prod(axes.get(a, 1) for a in names)
            if n > 1 and x.shape[dim] % n:
                raise LayoutError(f"mesh.{names[-1]}", f"{n} does not divide dim {dim} (size {x.shape[dim]}) of "
                                                       f"parameter {path} {list(x.shape)}, split over {tuple(names)}; "
                                                       f"pick a size that divides it, or change its rule")


def check_run(model, cfg) -> None:
    """Raise :class:`LayoutError` naming the config key when the run config ``cfg`` cannot run
    ``model`` on its mesh: :func:`check_model` (with the pipeline's stage count), the schedule
    (``pipeline.schedule``, ``pipeline.microbatches``), the batch against the data axes and the
    microbatches, and no ``layers`` rule (pipeline stages split the layers). The launcher calls
    it before spawning any rank, and every step builder again.

    Example:
        check_run(moe, load_config("moe_tiny", ["mesh.pp=4"]))   # LayoutError: mesh.pp: 4 pipeline stages ...
    """
    model = models.get(model)
    from shardfn.partition.pipeline.schedules import get_schedule, stages_per_rank

    axes = cfg.mesh.axes()
    rules = resolve_rules(cfg.rules, axes)
    pp, p = axes.get("pp", 1), cfg.pipeline
    if pp > 1 and entry_axes(rules.get("layers")):
        raise LayoutError("rules.layers", f"{rules['layers']!r}: pipeline stages split the layers over mesh.pp; "
                                          f"set rules.layers=null")
    n_stages = None
    refusal = model.pipeline_refusal(cfg.model) if pp > 1 else None
    if refusal is not None:
        key, why = refusal
        raise LayoutError(key, f"{why}, or mesh.pp=1 (mesh.pp = {pp} splits the model into pipeline stages)")
    if pp > 1:
        try:
            n_stages = get_schedule(p.schedule, pp, p.microbatches, stages_per_rank(p.schedule, pp, p.stages)).n_stages
        except ValueError as e:
            key = "pipeline.microbatches" if "microbatch" in str(e) else "pipeline.schedule"
            raise LayoutError(key, str(e)) from None
    check_model(model, cfg.model, axes, cfg.rules, n_stages=n_stages)
    check_batch(cfg.train.batch_size, data_size(rules, axes), p.microbatches if pp > 1 else 1,
                data_axes=tuple(n for n in entry_axes(rules.get("batch"))))
    check_context(model, cfg, axes, rules)
    check_sequence_parallel(cfg.partition.sequence_parallel, cfg.train.seq_len, axes, seq_split(rules, axes))


def check_sequence_parallel(enabled: bool, seq_len: int, axes: Mapping[str, int], seq_split: int = 1) -> None:
    """Raise :class:`LayoutError` naming ``partition.sequence_parallel`` when it cannot split the
    sequence over ``tp``: no ``tp`` axis, a sequence already split over ``cp``, or a length ``tp``
    does not divide.

    Example:
        check_sequence_parallel(True, 64, {"dp": 2})   # LayoutError: partition.sequence_parallel: ... mesh.tp > 1
    """
    if not enabled:
        return
    tp = axes.get("tp", 1)
    if tp == 1:
        raise LayoutError("partition.sequence_parallel", "true splits the sequence over the tensor-parallel axis "
                                                         "and needs mesh.tp > 1; set mesh.tp or drop it")
    if seq_split > 1:
        raise LayoutError("partition.sequence_parallel", f"the sequence is already split over mesh.cp "
                                                         f"({seq_split} ways); splitting it over tp as well is not "
                                                         f"built: use mesh.cp or sequence parallelism, not both")
    if seq_len % tp:
        raise LayoutError("train.seq_len", f"{seq_len} is not divisible by mesh.tp = {tp} (sequence parallelism "
                                           f"splits the sequence over tp); use a multiple of {tp}")


def check_context(model, cfg, axes: Mapping[str, int], rules: Mapping) -> None:
    """Raise :class:`LayoutError` when the sequence split (``mesh.cp``) cannot run ``cfg``: the
    sequence length against ``2 * cp`` and a model that reads
    its tokens in order beyond attention (multi-token prediction).

    Example:
        check_context(llama, load_config("llama_tiny", ["mesh.cp=2", "train.seq_len=6"]), ...)   # train.seq_len ...
    """
    model = models.get(model)
    split = seq_split(rules, axes)
    if split == 1:
        return
    check_seq(cfg.train.seq_len, split)
    refusal = model.context_refusal(cfg.model)
    if refusal is not None:
        key, why = refusal
        raise LayoutError("mesh.cp", f"{split} with {key} = {why}, or use mesh.cp=1")
    if not model.reads_positions():
        raise LayoutError("mesh.cp", f"{split} reorders each sequence's tokens and passes their positions as "
                                     f"batch['positions'], which model {model.name!r} does not read; take "
                                     f"batch.get('positions') into its attention (core.layers.rope_at), or use "
                                     f"mesh.cp=1")


def reshard_after_forward(cfg) -> bool:
    """``partition.reshard_after_forward``, with null resolved: False under pp (gather a stage's
    parameters once per step and keep them over its microbatches: a stage holds 1/pp of the model,
    and per-microbatch gathers would move ``microbatches`` times the bytes), True otherwise (an
    SPMD step gathers for the forward and again for the backward, holding nothing gathered
    between them), as TorchTitan's default.

        reshard_after_forward(load_config("moe_tiny", ["mesh.pp=2", "mesh.fsdp=2"]))   # False
    """
    value = cfg.partition.reshard_after_forward
    return (cfg.mesh.pp == 1) if value is None else bool(value)
