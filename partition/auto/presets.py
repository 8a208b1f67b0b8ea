"""Auto-sharding, part 5: the textbook layouts to compare a plan against, and plans as YAML.

    table = result.comparison_table(presets(mesh, (params, opt_state, batch), model.param_axes(cfg)))
    fixed = load_specs_yaml("plan.yaml"); result = solve(traced, mesh, fixed_specs=fixed)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

from shardfn.partition.auto.result import _fmt_mesh
from shardfn.partition.spec import P, entry_axes


def preset_rules(kind: str, mesh) -> dict:
    """Logical-axis rules of a textbook layout over every axis of ``mesh``.

    ``dp``: batch split, weights replicated. ``fsdp``: also every weight's ``embed`` dim split
    (ZeRO-3). ``tp``: Megatron column-then-row (``heads``, ``kv_heads``, ``mlp``, ``expert_mlp``),
    batch replicated. ``fsdp_tp``: the last mesh axis does tp, the others fsdp.

        preset_rules("fsdp_tp", sf.Mesh({"dp": 4, "tp": 2}, fake=True))
    """
    axes = [a for a, s in mesh.axes.items() if s > 1] or list(mesh.axes)
    every = axes[0] if len(axes) == 1 else list(axes)
    tp_dims = ("heads", "kv_heads", "mlp", "expert_mlp")
    if kind == "dp":
        return {"batch": every}
    if kind == "fsdp":
        return {"batch": every, "embed": every}
    if kind == "tp":
        return {d: every for d in tp_dims}
    if kind == "fsdp_tp":
        if len(axes) < 2:
            raise ValueError(f"preset fsdp_tp needs a mesh with two axes of size > 1; got {_fmt_mesh(mesh.axes)}")
        data = axes[0] if len(axes) == 2 else list(axes[:-1])
        return {"batch": data, "embed": data, **{d: axes[-1] for d in tp_dims}}
    raise ValueError(f"unknown preset {kind!r}; valid presets are dp, fsdp, tp, fsdp_tp")

def presets(mesh, args: tuple, param_axes: Any, *, params_argnum: int = 0, batch_argnums: Sequence[int] = (-1,),
            kinds: Sequence[str] = ("dp", "fsdp", "tp", "fsdp_tp")) -> dict:
    """``{name: in_specs}`` of textbook layouts for a train step's arguments.

    ``args[params_argnum]`` gets specs from ``param_axes`` (a tree of logical-axis tuples); any
    subtree of another argument shaped like the params (optimizer moments) takes the same specs;
    batch arguments split dim 0 as the rules' ``batch`` says; everything else is replicated.
    A dim keeps only the leading axes whose sizes divide it (a batch of 8 on a 64-device mesh
    splits over the first axis of 8). Presets that need more mesh axes than there are are left out.

        table = result.comparison_table(presets(mesh, (params, opt_state, batch), model.param_axes(cfg)))
    """
    from shardfn.core.pytree import tree_map
    from shardfn.partition.layouts.axes import state_specs
    from shardfn.partition.spec import specs_from_rules

    out = {}
    n = len(args)
    batch = {b % n for b in batch_argnums}
    for kind in kinds:
        try:
            rules = preset_rules(kind, mesh)
        except ValueError:
            continue
        pspecs = specs_from_rules(param_axes, {k: v for k, v in rules.items() if k != "batch"}, mesh.axes)
        pspecs = tree_map(lambda spec, x: _fit(spec, x.shape, mesh.axes), pspecs, args[params_argnum],
                          is_leaf=lambda v: isinstance(v, P))
        target = rules.get("batch")
        names = entry_axes(target)
        specs = []
        for i, a in enumerate(args):
            if i == params_argnum % n:
                specs.append(pspecs)
            elif i in batch:
                specs.append(tree_map(lambda x: _fit(P(tuple(names)) if names else P(), x.shape, mesh.axes), a))
            else:
                specs.append(state_specs(a, args[params_argnum], pspecs))
        out[kind] = tuple(specs)
    return out

def _fit(spec: P, shape, axis_sizes: dict) -> P:
    """``spec`` keeping, per dim, the leading axes whose product divides that dim."""
    entries = []
    for dim, entry in enumerate(spec):
        kept, size = [], 1
        for name in entry_axes(entry):
            if dim < len(shape) and shape[dim] % (size * axis_sizes[name]) == 0:
                kept.append(name)
                size *= axis_sizes[name]
        entries.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)

def load_specs_yaml(path_or_text: "str | Path") -> dict:
    """``{path: P}`` from a file written by :meth:`AutoResult.to_rules_yaml` (or its text).

        fixed = load_specs_yaml("plan.yaml"); result = solve(traced, mesh, fixed_specs=fixed)
    """
    text = str(path_or_text)
    if "\n" not in text and Path(text).is_file():
        text = Path(text).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"a specs file maps input paths to lists of axes; got {type(data).__name__}")
    out = {}
    for path, entries in data.items():
        if not isinstance(entries, list):
            raise ValueError(f"specs file: {path}: expected a list with one entry per dim (null, an axis or a list of "
                             f"axes), got {entries!r}")
        out[str(path)] = P(*[tuple(e) if isinstance(e, list) else e for e in entries])
    return out
