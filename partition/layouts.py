"""Layouts from a config: logical-axis rules -> specs for params, optimizer state and batch.

Mesh axes in configs are ``pp dp fsdp ep tp``. The default rules give the textbook layouts:
``dp`` replicates params and splits the batch; ``fsdp`` also splits every weight's ``embed`` dim
(ZeRO-3: stored sharded, gathered on use); ``tp`` splits ``heads``/``kv_heads``/``mlp``/``expert_mlp``
column-then-row (Megatron); ``ep`` splits ``expert`` and acts as one more data axis elsewhere.

    rules = resolve_rules(cfg.rules, mesh)
    specs = param_specs(model.param_axes(model_cfg), rules, mesh)
"""

from __future__ import annotations

from typing import Any

import optree

from shardfn.partition.spec import P, specs_from_rules

DATA_AXES = ("dp", "fsdp", "ep")

DEFAULT_RULES: dict[str, Any] = {
    "batch": list(DATA_AXES),
    "embed": "fsdp",
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "expert_mlp": "tp",
    "expert": "ep",
    "vocab": None,
    "layers": None,
}


def resolve_rules(user_rules: dict | None, mesh) -> dict[str, Any]:
    """Default rules updated by the config's ``rules``, keeping only axes the mesh has."""
    rules = dict(DEFAULT_RULES)
    rules.update(user_rules or {})
    out = {}
    for logical, target in rules.items():
        names = [target] if isinstance(target, str) else list(target or [])
        for name in names:
            if name not in mesh.axes and name not in ("pp", *DATA_AXES, "tp"):
                raise ValueError(
                    f"rules.{logical}: unknown mesh axis {name!r}; the mesh has axes {mesh.names}"
                )
        kept = [n for n in names if n in mesh.axes]
        out[logical] = kept[0] if len(kept) == 1 else (kept or None)
    return out


def param_specs(axes_tree: Any, rules: dict, mesh) -> Any:
    """A ``P`` per parameter from its logical axes."""
    return specs_from_rules(axes_tree, {k: v for k, v in rules.items() if k != "batch"}, mesh.axes)


def batch_spec(rules: dict, mesh) -> P:
    """The spec of a ``[batch, seq]`` array: batch over the data axes the rules name."""
    target = rules.get("batch")
    names = [target] if isinstance(target, str) else list(target or [])
    names = [n for n in names if mesh.axes.get(n, 1) > 1]
    return P(tuple(names)) if len(names) > 1 else P(names[0] if names else None)


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
