"""A pipeline stage's backward as programs of their own: F (forward), I (input gradient) and W
(weight gradients), cut from the stage's joint graph by dependency.

The joint ``(params, x, data, dy) -> (y, dx, dparams)`` is traced over ``torch.func.vjp`` and
split: F computes ``y`` and what the backward needs from the forward; I computes ``dx`` (what the
previous stage waits for); W the parameter gradients, which a zero-bubble schedule may run later.
Values flow between the three by name (:class:`Part`).

    stage = split_fiw(stage)
    env = stage.inputs_env(params, x, data); stage.F.run(env)
    env["dy"] = dy; stage.I.run(env); stage.W.run(env)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core._torch_private import fake_mode
from shardfn.partition.spmd.fx import (
    ancestors,
    descendants,
    extract_subgraph,
    identifier,
    moves_no_bytes,
    node_val,
    output_nodes,
    stack_layer_grads,
)

_DIFFERENTIABLE: dict[Any, Callable] = {}



@dataclass(frozen=True)
class TensorSpec:
    """Static shape and dtype of a value that crosses a program boundary.

        TensorSpec((2, 8, 64), torch.float32).nbytes  # 4096
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSpec":
        return TensorSpec(tuple(int(d) for d in t.shape), t.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def register_differentiable(op: Any, fn: Callable) -> None:
    """Make stage programs call ``fn`` where the traced loss called the custom op ``op``.

    A custom op's own autograd (``op.register_autograd``) does not run under ``torch.func``
    transforms, and :func:`trace_joint` differentiates each stage with ``torch.func.vjp``. ``fn``
    takes the op's arguments and returns its result through a ``torch.autograd.Function`` with
    ``setup_context`` (what ``core.custom_ops.register_autograd`` returns), so the joint records
    the op forward and its backward op as opaque calls.

        register_differentiable(torch.ops.shardfn.grouped_mm.default, grouped_mm)
    """
    _DIFFERENTIABLE[op] = fn


def differentiable_ops() -> dict[Any, Callable]:
    """Custom op -> the ``torch.func``-differentiable function a stage program calls instead."""
    from shardfn.core.grouped_mm import grouped_mm
    from shardfn.core.positional_attention import positional_attention_op
    from shardfn.partition.local_map import call_region

    return {torch.ops.shardfn.grouped_mm.default: grouped_mm, torch.ops.shardfn.local_region.default: call_region,
            torch.ops.shardfn.positional_attention.default: positional_attention_op, **_DIFFERENTIABLE}


@dataclass
class Part:
    """One of a stage's F, I or W programs: a GraphModule over named values.

    ``run(env)`` reads ``inputs`` from the dict ``env`` and writes ``outputs`` back into it.

        stage.F.run(env); stage.I.run(env); stage.W.run(env)
        grads = [env[n] for n in stage.grad_names]
    """

    graph_module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn: Callable | None = None  # what run() calls: the graph module, or a compiled version of it

    def run(self, env: dict[str, torch.Tensor]) -> None:
        fn = self.graph_module if self.fn is None else self.fn
        outs = fn(*[env[name] for name in self.inputs])
        env.update(zip(self.outputs, outs))

    @property
    def num_nodes(self) -> int:
        return sum(1 for n in self.graph_module.graph.nodes if n.op == "call_function")

    def compile(self, backend: str = "inductor") -> None:
        """Run through ``torch.compile`` from now on (no-op for a program without ops)."""
        if self.num_nodes:
            self.fn = torch.compile(self.graph_module, backend=backend, dynamic=False)



def _fake_inputs(specs: Sequence, device: torch.device) -> list[torch.Tensor]:
    """Fake tensors of each spec's ``shape`` and ``dtype``."""
    with fake_mode():
        return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]


def trace_joint(stage, device: torch.device | str = "cpu") -> tuple[fx.GraphModule, list[str]]:
    """The stage's joint ``(*params, x, *data, dy) -> (y, dx, *dparams)`` traced over ``torch.func.vjp``.

    Returns the graph (functionalized: no in-place ops, so it can be cut anywhere) and the env
    name of each placeholder. Stage 0 has no ``x`` and no ``dx``. A stage with side results
    (``stage.sides``) returns them last, and one that computes part of the loss (side
    ``"loss"``) takes that part's gradient seed ``dloss`` before ``dy``.

        joint, names = trace_joint(stage)   # names: ['param:layers.w1', ..., 'x', 'data:targets', 'dy']
    """
    n_p, has_x = len(stage.param_paths), stage.in_spec is not None
    n_d = len(stage.data_paths)
    fwd = stage.forward
    sides = tuple(getattr(stage, "sides", ()))
    seeded = "loss" in sides

    def joint(*flat):
        params = list(flat[:n_p])
        x = flat[n_p] if has_x else None
        data = list(flat[n_p + has_x: n_p + has_x + n_d])
        dy = flat[-1]

        def f(params, x):
            head = [x] if has_x else []
            out = fwd(*head, *data, *params)
            side = dict(zip(sides, out[1:]))
            aux = [t.detach() for t in out[1:]]
            return ((out[0], side["loss"]) if seeded else out[0]), aux

        primals = (params, x) if has_x else (params,)
        y, vjp_fn, aux = torch.func.vjp(f if has_x else (lambda p: f(p, None)), *primals, has_aux=True)
        cot = vjp_fn((dy, flat[-2]) if seeded else dy)
        if seeded:
            y = y[0]
        dparams = list(cot[0])
        dx = [cot[1]] if has_x else []
        return [y, *dx, *dparams, *aux]

    specs = [stage.param_specs[p] for p in stage.param_paths]
    specs += [stage.in_spec] if has_x else []
    specs += [_data_spec(stage, p) for p in stage.data_paths]
    specs += [_side_spec(stage)] if seeded else []
    specs += [stage.out_spec]
    names = [f"param:{p}" for p in stage.param_paths] + (["x"] if has_x else [])
    names += [f"data:{p}" for p in stage.data_paths] + (["dloss"] if seeded else []) + ["dy"]
    fakes = _fake_inputs(specs, torch.device(device))
    if not _calls_differentiable(fwd):
        return make_fx(torch.func.functionalize(joint), tracing_mode="fake")(*fakes), names
    # functionalize has no rule for autograd.Functions: trace the joint first (the Functions become
    # their forward and backward ops), then functionalize that graph.
    raw = make_fx(joint, tracing_mode="fake")(*fakes)
    return make_fx(torch.func.functionalize(raw), tracing_mode="fake")(*fakes), names


def _side_spec(stage):
    """The spec of the stage's part of the loss (0-d, the dtype of its ``"loss"`` side result)."""
    outs = output_nodes(stage.forward)
    return TensorSpec.of(node_val(outs[1 + stage.sides.index("loss")]))


def _calls_differentiable(gm: fx.GraphModule) -> bool:
    wrapped = set(differentiable_ops().values())
    return any(n.op == "call_function" and n.target in wrapped for n in gm.graph.nodes)


def _data_spec(stage, path: str) -> torch.Tensor:
    """The traced value of the stage's batch input ``path`` (its shape and dtype)."""
    ph = next(n for n in stage.forward.graph.nodes if n.op == "placeholder" and n.target == identifier(f"data:{path}"))
    return node_val(ph)


def joint_graph(stage, device: torch.device | str = "cpu", remat: str = "none") -> tuple[fx.GraphModule, list[str]]:
    """:func:`trace_joint` with each stacked parameter's gradient built by one ``stack``
    (:func:`stack_layer_grads`): the global joint that :func:`split_joint` cuts, directly or after
    partitioning (``partition.pipeline.stage_programs``). ``remat``: a ``partition.passes.remat`` policy; what it
    does not save is recomputed in the backward (I and W), not kept from F.

        joint, names = joint_graph(stage, remat="selective")
    """
    gm, names = trace_joint(stage, device)
    outs = output_nodes(gm)
    head = 1 + (stage.in_spec is not None)
    stack_layer_grads(gm, outs[head:head + len(stage.param_paths)])
    if remat != "none":
        from shardfn.partition.passes.remat import remat as rematerialize

        for node, name in zip((n for n in gm.graph.nodes if n.op == "placeholder"), names):
            node.meta.setdefault("sf_path", name)  # "param:layers.attn.wq": its stack is "param:layers"
        rematerialize(gm, remat, forward_of=[output_nodes(gm)[0]])
    return gm, names


@dataclass
class Split:
    """A joint cut into F, I and W, and the env names of its results."""

    F: Part
    I: Part  # noqa: E741 (the schedule's name for it)
    W: Part
    y_name: str
    dx_name: str | None
    grad_names: tuple[str, ...]
    side_names: tuple[str, ...] = ()


def split_joint(gm: fx.GraphModule, names: Sequence[str], has_x: bool, n_sides: int = 0) -> Split:
    """Cut a joint ``(*params, x, *data, dy) -> (y, dx, *dparams)`` (global, or one rank's
    partitioned program: collectives are nodes like any other) by dependency on ``dy``.

    F computes ``y`` and what the backward needs from the forward (the ancestors of ``y`` that
    do not depend on ``dy``); I computes ``dx`` (the remaining ancestors of ``dx``); W computes
    the parameter gradients (everything else they need). A backward-only value that does not
    depend on ``dy`` (a weight's transpose, ``sigmoid(x)``, a parameter gathered for the
    backward) is computed in the part that needs it, not saved from F. Without ``x`` (stage 0)
    there is no ``dx``: I is empty. The last ``n_sides`` results are the forward's side results
    (``Stage.sides``), which F computes; a ``dloss`` input seeds the backward like ``dy``.

        split = split_joint(*joint_graph(stage), has_x=stage.in_spec is not None)
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    name_of = {n: nm for n, nm in zip(placeholders, names)}
    outs = output_nodes(gm)
    sides = outs[len(outs) - n_sides:] if n_sides else []
    outs = outs[:len(outs) - n_sides]
    y, dx, dparams = outs[0], (outs[1] if has_x else None), list(outs[1 + has_x:])
    seeds = [placeholders[-1]] + [n for n, nm in name_of.items() if nm == "dloss"]
    ph = set(placeholders)

    after_dy = descendants(seeds)
    f_set = _closure({n for n in ancestors([y, *sides]) if n not in after_dy and n not in ph})
    i_set = {n for n in ancestors([dx] if dx is not None else []) if n not in f_set and n not in ph}
    w_set = {n for n in ancestors(dparams) if n not in f_set and n not in i_set and n not in ph}
    # Views of parameters are re-made where they are used rather than saved across parts.
    param_views = _param_views(gm, {n for n, nm in name_of.items() if nm.startswith("param:")})
    i_set = _closure(i_set | _views_needed(i_set, param_views))
    w_set = _closure(w_set | _views_needed(w_set, param_views))

    for n in gm.graph.nodes:
        if n not in ph and n.op != "output":
            name_of.setdefault(n, n.name)

    results = {"F": [y, *sides], "I": [dx] if dx is not None else [], "W": list(dparams)}
    sets = {"F": f_set, "I": i_set, "W": w_set}
    ins = {k: _inputs_of(gm, sets[k], results[k]) for k in sets}
    read_by = {"F": set(ins["I"]) | set(ins["W"]), "I": set(ins["W"]), "W": set()}

    def part(k: str) -> Part:
        exported = [n for n in gm.graph.nodes if n in sets[k] and n in read_by[k]]
        outputs = _dedupe(results[k] + exported)
        sub = extract_subgraph(gm, sets[k], ins[k], outputs, input_names=[name_of[n] for n in ins[k]])
        return Part(sub, tuple(name_of[n] for n in ins[k]), tuple(name_of[n] for n in outputs))

    return Split(part("F"), part("I"), part("W"), name_of[y], name_of[dx] if dx is not None else None,
                 tuple(name_of[n] for n in dparams), tuple(name_of[n] for n in sides))


def set_programs(stage, split: Split):
    """Give ``stage`` the F / I / W of ``split`` (and the names of their results)."""
    stage.F, stage.I, stage.W = split.F, split.I, split.W
    stage.y_name, stage.dx_name, stage.grad_names = split.y_name, split.dx_name, split.grad_names
    stage.side_names = split.side_names
    return stage


def split_fiw(stage, device: torch.device | str = "cpu", remat: str = "none"):
    """Fill ``stage.F``, ``stage.I``, ``stage.W`` from its joint (:func:`joint_graph`), cut by
    dependency on ``dy`` (:func:`split_joint`): the programs of a stage on one device.

    Example:
        stage = split_fiw(stage)
        env = stage.inputs_env(params, x, data); stage.F.run(env)
        env["dy"] = dy; stage.I.run(env); stage.W.run(env)   # env[stage.dx_name], grads by stage.grad_names
    """
    gm, names = joint_graph(stage, device, remat)
    return set_programs(stage, split_joint(gm, names, stage.in_spec is not None, len(stage.sides)))


def _param_views(gm: fx.GraphModule, params: set[fx.Node]) -> set[fx.Node]:
    """Nodes that are views of parameters only (``select(w, 0, i)``, ``w.t()``, chains of them)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and moves_no_bytes(n) and n.all_input_nodes and all(
                a in params or a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _views_needed(nodes: set[fx.Node], views: set[fx.Node]) -> set[fx.Node]:
    """The parameter views that ``nodes`` read, with the views those are made from."""
    return ancestors([a for n in nodes for a in n.all_input_nodes if a in views],
                      stop=lambda m: m not in views) & views


def _closure(nodes: set[fx.Node]) -> set[fx.Node]:
    """``nodes`` plus the ``getitem`` users of any multi-output node in it, so that tuples never
    cross a part boundary (only their tensor elements do)."""
    extra = {u for n in nodes for u in n.users if u.target is operator.getitem}
    return nodes | extra


def _inputs_of(gm: fx.GraphModule, nodes: set, results: list[fx.Node]) -> list[fx.Node]:
    """Values a part reads from outside itself (in graph order): placeholders and other parts' results."""
    needed = {a for n in nodes for a in n.all_input_nodes if a not in nodes}
    needed |= {r for r in results if r not in nodes}
    return [n for n in gm.graph.nodes if n in needed]


def _dedupe(xs: list) -> list:
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
