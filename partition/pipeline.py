"""Pipeline stages from one traced loss: cut points, per-stage programs, and the F / I / W split.

The loss of ONE microbatch is traced once with fake tensors. Every node that depends on the
token ids (the batch leaf whose path ends in ``inputs``) is an *activation*; every other node
is *free* (parameter slices ``select(w, 0, i)``, views of parameters, rope tables, reshaped
targets) and is duplicated into each stage that uses it. A cut between two positions of the
activations' topological order is valid when exactly one floating-point activation crosses it;
``n_stages - 1`` cuts are chosen among the valid ones to minimise the most expensive stage
(matmul FLOPs + elementwise outputs + parameter bytes), or taken from ``sf.pipeline_split``
markers when the model has any. docs/pipeline.md has the whole design.

Each stage is its own program ``(x, *data, *params) -> y``, where a stacked parameter is the
stage's own slice ``w[l0:l1]`` with its ``select`` indices rebased, so a rank only ever holds
its stages' layers. Its joint ``(params, x, data, dy) -> (y, dx, dparams)`` is traced over
``torch.func.vjp`` and cut by dependency into three programs: F (forward), I (input gradient,
what the previous stage waits for) and W (weight gradients, which a zero-bubble schedule may
run later). Values flow between them by name.

    pipe = build_pipeline(loss_fn, params, microbatch, n_stages=4)
    print(pipe.describe())
    env = pipe.stages[1].inputs_env(stage_params, x=h, data=mb)     # then F, I, W run on env
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import optree
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core.pytree import flatten_with_paths
from shardfn.partition.constrain import tracing_scope

STREAM_SUFFIX = "inputs"
"""The batch leaf whose path ends with this is the pipeline's stream source (token ids)."""

_SELECT = torch.ops.aten.select.int
_SPLIT = torch.ops.shardfn.pipeline_split.default


class PipelineError(ValueError):
    """The model cannot be split as asked; the message names the value and the config key."""


_DIFFERENTIABLE: dict[Any, Callable] = {}


def register_differentiable(op: Any, fn: Callable) -> None:
    """Make stage programs call ``fn`` where the traced loss called the custom op ``op``.

    A custom op's own autograd (``register_autograd``) does not run under ``torch.func``
    transforms, and :func:`trace_joint` differentiates each stage with ``torch.func.vjp``. ``fn``
    takes the op's arguments and returns its result through a ``torch.autograd.Function`` with
    ``setup_context``, so the joint records the op forward and its backward op as opaque calls.

        register_differentiable(torch.ops.shardfn.grouped_mm.default, grouped_mm)
    """
    _DIFFERENTIABLE[op] = fn


def _differentiable_ops() -> dict[Any, Callable]:
    from shardfn.core.grouped_mm import grouped_mm

    return {torch.ops.shardfn.grouped_mm.default: grouped_mm, **_DIFFERENTIABLE}


# ----------------------------------------------------------------------------- small types


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


@dataclass
class Stage:
    """One pipeline stage: its forward program, its parameters and its F / I / W programs.

    Attributes:
        index: position in the pipeline (0 = takes the token ids, last = returns the loss).
        forward: ``(x, *data, *params) -> (y,)`` (no ``x`` on stage 0), in ``input_names`` order.
        param_paths: dotted paths (in the parameter tree) of the leaves this stage holds.
        layer_ranges: ``path -> (l0, l1)`` for stacked leaves held as the slice ``w[l0:l1]``.
        param_specs: ``path -> TensorSpec`` of what the stage holds (the slice for stacked leaves).
        data_paths: batch leaves the stage reads (``inputs``, ``targets``).
        in_spec: the incoming activation (None on stage 0); out_spec: the output (the loss on
            the last stage).
        flops, param_bytes: the forward's cost (:func:`node_flops` summed) and the bytes of the
            parameters it holds.
        F, I, W: the split joint (see :func:`split_fiw`); ``y_name``, ``dx_name`` and
            ``grad_names`` (aligned with ``param_paths``) name their results in the value env.
    """

    index: int
    forward: fx.GraphModule
    param_paths: tuple[str, ...]
    layer_ranges: dict[str, tuple[int, int]]
    param_specs: dict[str, TensorSpec]
    data_paths: tuple[str, ...]
    in_spec: TensorSpec | None
    out_spec: TensorSpec
    is_last: bool
    flops: float = 0.0
    param_bytes: int = 0
    F: Part | None = None
    I: Part | None = None  # noqa: E741 (the schedule's name for it)
    W: Part | None = None
    y_name: str = "y"
    dx_name: str | None = None
    grad_names: tuple[str, ...] = ()

    @property
    def input_names(self) -> tuple[str, ...]:
        """Env names of the forward's inputs, in order: ``x``, ``data:*``, ``param:*``."""
        head = () if self.in_spec is None else ("x",)
        return head + tuple(f"data:{p}" for p in self.data_paths) + tuple(f"param:{p}" for p in self.param_paths)

    def inputs_env(self, params: dict[str, torch.Tensor], x: torch.Tensor | None, data: dict[str, torch.Tensor]) -> dict:
        """The value env F starts from: ``params`` (path -> held tensor), ``x``, ``data`` (path -> tensor)."""
        env = {f"param:{p}": params[p] for p in self.param_paths}
        env.update({f"data:{p}": data[p] for p in self.data_paths})
        if self.in_spec is not None:
            if x is None:
                raise ValueError(f"stage {self.index} takes an activation {self.in_spec}; pass x")
            env["x"] = x
        return env

    def run_forward(self, params: dict[str, torch.Tensor], x: torch.Tensor | None, data: dict) -> torch.Tensor:
        """The stage's forward program on concrete values (for tests and reference runs)."""
        env = self.inputs_env(params, x, data)
        return self.forward(*[env[n] for n in self.input_names])[0]


@dataclass
class Pipeline:
    """A loss split into stages: what :func:`build_pipeline` returns.

    Attributes:
        stages: the stages, in pipeline order.
        param_specs: ``path -> TensorSpec`` of every leaf of the full parameter tree.
        param_treedef: the full tree's structure (leaves in ``param_specs`` order).
        owner: ``path -> [stage, ...]`` stages that hold (a slice of) each leaf.
        microbatch: ``path -> TensorSpec`` of one microbatch's batch leaves.
        cuts: the activation node after which each cut was made (names in the traced graph).
        valid_cuts: how many valid cut points the traced loss has.
    """

    stages: list[Stage]
    param_specs: dict[str, TensorSpec]
    param_treedef: Any
    owner: dict[str, list[int]]
    microbatch: dict[str, TensorSpec]
    cuts: list[str]
    valid_cuts: int
    graph_module: fx.GraphModule | None = field(default=None, repr=False)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def describe(self) -> str:
        """One line per stage: FLOPs, parameter bytes, layer ranges, boundary shape."""
        total = sum(s.flops for s in self.stages) or 1.0
        lines = [f"{self.n_stages} stages, cuts after {self.cuts} ({self.valid_cuts} valid cut points)"]
        for s in self.stages:
            ranges = ", ".join(f"{p}[{a}:{b}]" for p, (a, b) in sorted(s.layer_ranges.items()))
            out = "loss" if s.is_last else f"{list(s.out_spec.shape)}"
            lines.append(f"  stage {s.index}: {s.flops / total:6.1%} flops, {s.param_bytes:,} param bytes, "
                         f"-> {out}; {ranges or 'no stacked leaves'}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- graph helpers


def extract_subgraph(gm: fx.GraphModule, nodes: Iterable[fx.Node], inputs: Sequence[fx.Node],
                     outputs: Sequence[fx.Node], *, input_names: Sequence[str] | None = None) -> fx.GraphModule:
    """A GraphModule computing ``outputs`` from ``inputs`` with the ops in ``nodes`` (copied in graph order).

    Every argument of a copied node must be an input or another copied node. ``outputs`` may
    name inputs (passed through). The result returns a tuple, in ``outputs`` order.

    Example:
        sub = extract_subgraph(gm, {mm, relu}, inputs=[x, w], outputs=[relu])
        (y,) = sub(x_value, w_value)
    """
    keep = set(nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names = list(input_names) if input_names is not None else [n.name for n in inputs]
    for node, name in zip(inputs, names):
        ph = g.placeholder(_identifier(name))
        ph.meta.update(node.meta)
        env[node] = ph

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:
            raise AssertionError(f"node {a.name!r} is neither an input nor in the subgraph")
        return env[a]

    for node in gm.graph.nodes:
        if node in keep and node not in env:
            assert node.op not in ("placeholder", "output"), f"{node.op} {node.name} cannot be copied"
            env[node] = g.node_copy(node, lookup)
    g.output(tuple(lookup(o) for o in outputs))
    g.lint()
    return fx.GraphModule(gm, g)


def _identifier(name: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else f"v_{out}"


def _ancestors(roots: Iterable[fx.Node], stop: Callable[[fx.Node], bool] = lambda n: False) -> set[fx.Node]:
    """``roots`` and everything they depend on (not walking past nodes where ``stop`` is true)."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if not stop(n):
            stack.extend(n.all_input_nodes)
    return seen


def _descendants(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(u for u in n.users if u.op != "output")
    return seen


def _val(node: fx.Node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_float_tensor(node: fx.Node) -> bool:
    v = _val(node)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _output_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]


# ----------------------------------------------------------------------------- cost


def node_flops(node: fx.Node) -> float:
    """Forward FLOPs of one graph node: ``2*M*N*K`` for matmuls (torch's flop counter formulas,
    attention included), plus one per output element for other non-view ops.

        node_flops(mm_node)  # 2 * 16 * 64 * 32 for x [16, 32] @ w [32, 64]
    """
    if node.op != "call_function":
        return 0.0
    val = _val(node)
    expert = _expert_flops(node)
    if expert is not None:
        return expert
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        from torch.utils.flop_counter import flop_registry

        if packet in flop_registry:
            args, kwargs = fx.node.map_arg((node.args, dict(node.kwargs)), _val)
            try:
                return float(flop_registry[packet](*args, out_val=val, **kwargs))
            except Exception:  # a formula this version cannot evaluate on these args: fall through
                pass
        if "scaled_dot_product" in packet.__name__:
            q, k = _val(node.args[0]), _val(node.args[1])
            return 4.0 * q.numel() * k.shape[-2]
    if isinstance(val, torch.Tensor) and not _is_view(node):
        return float(val.numel())
    return 0.0


def _expert_flops(node: fx.Node) -> float | None:
    """``2*T*K*N`` for ``shardfn::grouped_mm``; for ``shardfn::ep_experts`` (the expert-parallel
    exchange, whose experts run inside it) its three grouped GEMMs over ``T * top_k`` rows, as
    if this rank's experts received an even share of the tokens. None for other ops."""
    schema = getattr(node.target, "_schema", None)
    name = schema.name if schema is not None else None
    if name == "shardfn::grouped_mm":
        x, w = _val(node.args[0]), _val(node.args[1])
        return 2.0 * x.shape[0] * x.shape[1] * (w.shape[2] if w.dim() == 3 else w.shape[1])
    if name == "shardfn::ep_experts":
        x, idx, w1 = _val(node.args[0]), _val(node.args[1]), _val(node.args[3])
        return 3 * 2.0 * idx.numel() * x.shape[1] * w1.shape[2]
    return None


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.target is operator.getitem
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


# ----------------------------------------------------------------------------- tracing


@dataclass
class TracedLoss:
    """``loss(params, batch)`` traced for one microbatch, with each input leaf's role."""

    graph_module: fx.GraphModule
    param_nodes: dict[str, fx.Node]  # path in the params tree -> placeholder
    data_nodes: dict[str, fx.Node]   # path in the batch tree -> placeholder
    stream: fx.Node                  # the token-ids placeholder
    loss: fx.Node
    param_treedef: Any
    param_specs: dict[str, TensorSpec]
    microbatch: dict[str, TensorSpec]


def trace_loss(loss_fn: Callable, params: Any, batch: Any) -> TracedLoss:
    """Trace ``loss_fn(params, batch)`` (one microbatch) with fake tensors over its flat leaves.

    Example:
        traced = trace_loss(lambda p, b: model.loss(p, b, cfg), params, microbatch)
        traced.stream.name, traced.loss.name
    """
    p_items = flatten_with_paths(params)
    b_items = flatten_with_paths(batch)
    p_leaves, p_def = optree.tree_flatten(params, none_is_leaf=False)
    b_leaves, b_def = optree.tree_flatten(batch, none_is_leaf=False)
    for path, leaf in p_items + b_items:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"leaf {path!r} is a {type(leaf).__name__}; the pipeline traces pytrees of tensors")
    streams = [p for p, _ in b_items if p == STREAM_SUFFIX or p.endswith("." + STREAM_SUFFIX)]
    if len(streams) != 1:
        raise PipelineError(f"the batch needs exactly one leaf named {STREAM_SUFFIX!r} (the token ids that enter "
                            f"stage 0); its leaves are {[p for p, _ in b_items]}")
    n_p = len(p_leaves)

    def flat_loss(*flat):
        p = optree.tree_unflatten(p_def, list(flat[:n_p]))
        b = optree.tree_unflatten(b_def, list(flat[n_p:]))
        with tracing_scope():
            out = loss_fn(p, b)
        if not isinstance(out, torch.Tensor) or out.ndim != 0:
            raise PipelineError(f"the pipelined loss must return one 0-d tensor, got {type(out).__name__}"
                                f"{'' if not isinstance(out, torch.Tensor) else ' of shape ' + str(tuple(out.shape))}")
        return [out]

    leaves, seen = [], set()
    for x in p_leaves + b_leaves:  # one tensor passed as two leaves would trace as one input
        leaves.append(x.clone() if id(x) in seen else x)
        seen.add(id(x))
    gm = make_fx(flat_loss, tracing_mode="fake", _allow_non_fake_inputs=True)(*leaves)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_nodes = {path: n for (path, _), n in zip(p_items, placeholders[:n_p])}
    data_nodes = {path: n for (path, _), n in zip(b_items, placeholders[n_p:])}
    (loss,) = _output_nodes(gm)
    return TracedLoss(
        gm, param_nodes, data_nodes, data_nodes[streams[0]], loss, p_def,
        {p: TensorSpec.of(x) for p, x in p_items}, {p: TensorSpec.of(x) for p, x in b_items},
    )


# ----------------------------------------------------------------------------- cut points


@dataclass(frozen=True)
class CutPoint:
    """A valid cut: after ``position`` activations of the order, only ``value`` crosses."""

    position: int
    value: fx.Node


def activation_order(traced: TracedLoss) -> list[fx.Node]:
    """The activations (non-placeholder nodes depending on the token ids that the loss needs), in graph order."""
    live = _ancestors([traced.loss])
    deps = _descendants([traced.stream])
    return [n for n in traced.graph_module.graph.nodes if n.op == "call_function" and n in deps and n in live]


def valid_cuts(order: list[fx.Node]) -> list[CutPoint]:
    """Positions ``k`` (1 <= k < len(order)) where exactly one activation made before ``k`` is
    used at or after ``k``, and it is a floating-point tensor (it will be sent, and its
    gradient sent back).

    Example:
        [c.value.name for c in valid_cuts(order)]  # ['index', 'add_1', ...]
    """
    index = {n: i for i, n in enumerate(order)}
    n = len(order)
    delta = [0] * (n + 2)
    delta_sum = [0] * (n + 2)
    for i, node in enumerate(order):
        # users outside the order are the output (position n) or dead code (ignored)
        last = max((index[u] if u in index else n if u.op == "output" else i for u in node.users), default=i)
        if last > i:  # live on positions i+1 .. last
            delta[i + 1] += 1
            delta[last + 1] -= 1
            delta_sum[i + 1] += i
            delta_sum[last + 1] -= i
    cuts, live, live_sum = [], 0, 0
    for k in range(1, n):
        live += delta[k]
        live_sum += delta_sum[k]
        if live == 1 and _is_float_tensor(order[live_sum]):
            cuts.append(CutPoint(k, order[live_sum]))
    return cuts


def activation_costs(order: list[fx.Node], bytes_weight: float) -> list[float]:
    """Cost of each activation: its FLOPs (:func:`node_flops`) plus ``bytes_weight`` per byte of
    the parameters (or stacked-parameter slices) it is the first to read, so that a stage's cost
    also counts the parameters it holds.

        activation_costs(order, bytes_weight=1.0)[0]  # the embedding lookup: its table's bytes
    """
    acts = set(order)
    charged: set[fx.Node] = set()
    costs = []
    for node in order:
        held = 0
        stop = lambda m: m in acts or _param_slice(m) or m.op == "placeholder"  # noqa: E731
        for src in _ancestors(node.all_input_nodes, stop=stop):
            if src not in acts and src not in charged and (_param_slice(src) or _is_param_ph(src)):
                charged.add(src)
                held += _nbytes(_val(src))
        costs.append(node_flops(node) + bytes_weight * held)
    return costs


def _param_slice(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _SELECT and node.args[0].op == "placeholder"


def _is_param_ph(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.meta.get("sf_role") == "param"


def choose_cuts(costs: Sequence[float], cuts: Sequence[CutPoint], n_stages: int) -> list[CutPoint]:
    """``n_stages - 1`` of ``cuts`` minimising the largest stage cost (exact, O(S * V log V)).

    Example:
        cuts = [CutPoint(1, a), CutPoint(2, b), CutPoint(3, c)]
        choose_cuts([1, 1, 1, 1], cuts, 2)  # [CutPoint(2, b)]: two stages of cost 2
    """
    if n_stages == 1:
        return []
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    q = [0] + [c.position for c in cuts] + [len(costs)]
    inf = float("inf")
    best = [[prefix[p] for p in q]]  # best[j][i]: cheapest max cost of j+1 stages covering [0, q[i])
    arg: list[list[int]] = [[-1] * len(q)]
    for j in range(1, n_stages):
        prev, row, back = best[-1], [inf] * len(q), [-1] * len(q)
        for i in range(j, len(q)):
            # the last stage is [q[u], q[i]); prev[u] grows with u while that stage's cost shrinks,
            # so the best u is where they cross: binary search, then look at both neighbours.
            lo, hi = j - 1, i
            while lo < hi:
                m = (lo + hi) // 2
                if prev[m] >= prefix[q[i]] - prefix[q[m]]:
                    hi = m
                else:
                    lo = m + 1
            for u in (lo - 1, lo):
                if j - 1 <= u < i:
                    v = max(prev[u], prefix[q[i]] - prefix[q[u]])
                    if v < row[i]:
                        row[i], back[i] = v, u
        best.append(row)
        arg.append(back)
    chosen, i = [], len(q) - 1
    for j in range(n_stages - 1, 0, -1):
        i = arg[j][i]
        chosen.append(cuts[i - 1])
    return chosen[::-1]


def _too_many_stages(n_stages: int, n_valid: int) -> PipelineError:
    return PipelineError(
        f"cannot split the model into {n_stages} pipeline stages: its loss has only {n_valid} valid cut "
        f"points (places where exactly one activation crosses, e.g. between layers), so at most "
        f"{n_valid + 1} stages; lower pipeline.stages (or mesh.pp) to {n_valid + 1} or fewer, or use a "
        f"model with more layers"
    )


def _marker_cuts(order: list[fx.Node], cuts: list[CutPoint], n_stages: int | None) -> list[CutPoint]:
    markers = [n for n in order if n.target is _SPLIT]
    if n_stages is not None and n_stages != len(markers) + 1:
        raise PipelineError(
            f"the model has {len(markers)} sf.pipeline_split markers ({len(markers) + 1} stages) but "
            f"{n_stages} stages were asked for; set pipeline.stages to {len(markers) + 1} (or null), "
            f"or remove the markers to let the split be chosen automatically"
        )
    by_position = {c.position: c for c in cuts}
    out = []
    for m in markers:
        cut = by_position.get(order.index(m) + 1)
        if cut is None or cut.value is not m:
            raise PipelineError(
                f"sf.pipeline_split at graph node {m.name!r} is not a valid stage boundary: other activations "
                f"made before it are used after it; move the marker to where only one tensor (the residual "
                f"stream) flows on, e.g. between layers"
            )
        out.append(cut)
    return out


# ----------------------------------------------------------------------------- stages


def split_stages(traced: TracedLoss, n_stages: int | None, *, bytes_weight: float = 1.0) -> tuple[list[Stage], list[CutPoint], int]:
    """Cut ``traced`` into stage programs; returns ``(stages, cuts, number of valid cut points)``.

    Example:
        stages, cuts, n_valid = split_stages(trace_loss(loss_fn, params, mb), 2)
    """
    for n in traced.param_nodes.values():
        n.meta["sf_role"] = "param"
    order = activation_order(traced)
    cuts = valid_cuts(order)
    has_markers = any(n.target is _SPLIT for n in order)
    if has_markers:
        chosen = _marker_cuts(order, cuts, n_stages)
    else:
        n_stages = 1 if n_stages is None else n_stages
        if n_stages < 1:
            raise PipelineError(f"n_stages must be >= 1, got {n_stages}")
        if len(cuts) < n_stages - 1:
            raise _too_many_stages(n_stages, len(cuts))
        chosen = choose_cuts(activation_costs(order, bytes_weight), cuts, n_stages)
    bounds = [0] + [c.position for c in chosen] + [len(order)]
    acts = set(order)
    segments = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    outs = [c.value for c in chosen] + [traced.loss]
    plans = [_plan_stage(s, seg, outs[s], outs[s - 1] if s else None, acts, traced) for s, seg in enumerate(segments)]
    ranges = _layer_ranges(plans, traced)
    stages = [_build_stage(plan, ranges, traced, is_last=(s == len(plans) - 1)) for s, plan in enumerate(plans)]
    return stages, chosen, len(cuts)


@dataclass
class _Plan:
    index: int
    nodes: set            # activations + free nodes the stage computes
    x: fx.Node | None     # the incoming activation
    out: fx.Node
    params: list          # param placeholders used
    data: list            # data placeholders used
    uses: dict            # param placeholder -> set of select indices, or None when used whole


def _plan_stage(index, segment, out, x, acts, traced) -> _Plan:
    seg = set(segment)
    free: set[fx.Node] = set()
    stack = [a for n in segment for a in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n in seg or n in free or n is x:
            continue
        if n in acts:
            raise AssertionError(f"stage {index} needs activation {n.name} from an earlier stage besides {x}")
        free.add(n)
        if n.op != "placeholder":
            stack.extend(n.all_input_nodes)
    nodes = seg | {n for n in free if n.op != "placeholder"}
    params = [p for p in traced.param_nodes.values() if p in free]
    data = [d for d in traced.data_nodes.values() if d in free]
    uses = {}
    for p in params:
        users = [u for u in p.users if u in nodes]
        if users and all(u.target is _SELECT and u.args[1] == 0 and isinstance(u.args[2], int) for u in users):
            size = _val(p).shape[0]
            uses[p] = {u.args[2] % size for u in users}
        else:
            uses[p] = None
    return _Plan(index, nodes, x, out, params, data, uses)


def _path_of(traced: TracedLoss) -> dict[fx.Node, str]:
    return {n: p for p, n in traced.param_nodes.items()}


def _layer_ranges(plans: list[_Plan], traced: TracedLoss) -> dict[tuple[int, str], tuple[int, int]]:
    """``(stage, path) -> (l0, l1)`` for every stacked leaf split over stages; the ranges of one
    leaf tile ``[0, n_layers)`` (unused layers join a neighbour). Raises on shared parameters."""
    path_of = _path_of(traced)
    holders: dict[fx.Node, list[_Plan]] = {}
    for plan in plans:
        for p in plan.params:
            holders.setdefault(p, []).append(plan)
    out = {}
    for p, hs in holders.items():
        if len(hs) == 1:
            continue  # one stage uses this leaf: it holds it whole
        whole = [h.index for h in hs if h.uses[p] is None]
        sets = sorted(((min(h.uses[p]), max(h.uses[p]), h) for h in hs if h.uses[p] is not None), key=lambda t: t[0])
        overlap = any(a[1] >= b[0] for a, b in zip(sets[:-1], sets[1:]))
        if whole or overlap:
            raise PipelineError(
                f"parameter {path_of[p]!r} is used by stages {[h.index for h in hs]} (tied or shared weights); "
                f"pipeline stages cannot share a parameter yet: untie it (e.g. a separate output head), or "
                f"place its uses in one stage with sf.pipeline_split / a different pipeline.stages"
            )
        n_layers = _val(p).shape[0]
        for k, (lo, hi, h) in enumerate(sets):
            l0 = 0 if k == 0 else sets[k][0]
            l1 = n_layers if k == len(sets) - 1 else sets[k + 1][0]
            out[(h.index, path_of[p])] = (l0, l1)
    return out


def _build_stage(plan: _Plan, ranges, traced: TracedLoss, *, is_last: bool) -> Stage:
    path_of = _path_of(traced)
    data_path = {n: p for p, n in traced.data_nodes.items()}
    param_paths = tuple(path_of[p] for p in plan.params)
    data_paths = tuple(data_path[d] for d in plan.data)
    inputs = ([plan.x] if plan.x is not None else []) + plan.data + plan.params
    names = (["x"] if plan.x is not None else []) + [f"data:{p}" for p in data_paths] + [f"param:{p}" for p in param_paths]
    gm = extract_subgraph(traced.graph_module, plan.nodes, inputs, [plan.out], input_names=names)
    layer_ranges = {path: ranges[(plan.index, path)] for path in param_paths if (plan.index, path) in ranges}
    specs = {}
    placeholders = {n.target: n for n in gm.graph.nodes if n.op == "placeholder"}
    for path in param_paths:
        full = traced.param_specs[path]
        if path in layer_ranges:
            l0, l1 = layer_ranges[path]
            specs[path] = TensorSpec((l1 - l0,) + full.shape[1:], full.dtype)
            ph = placeholders[_identifier(f"param:{path}")]
            for u in list(ph.users):
                u.args = (ph, 0, u.args[2] % full.shape[0] - l0)
        else:
            specs[path] = full
    for node in [n for n in gm.graph.nodes if n.target is _SPLIT]:  # the cut is made: markers are identities
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    differentiable = _differentiable_ops()
    for node in gm.graph.nodes:  # custom ops -> their torch.func-differentiable form (trace_joint)
        if node.op == "call_function" and node.target in differentiable:
            node.target = differentiable[node.target]
    gm.recompile()
    stage = Stage(
        index=plan.index, forward=gm, param_paths=param_paths, layer_ranges=layer_ranges, param_specs=specs,
        data_paths=data_paths, in_spec=None if plan.x is None else TensorSpec.of(_val(plan.x)),
        out_spec=TensorSpec.of(_val(plan.out)), is_last=is_last,
        flops=sum(node_flops(n) for n in plan.nodes),
        param_bytes=sum(s.nbytes for s in specs.values()),
    )
    return stage


# ----------------------------------------------------------------------------- F / I / W


def _fake_inputs(specs: Sequence[TensorSpec], device: torch.device) -> list[torch.Tensor]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]


def trace_joint(stage: Stage, device: torch.device | str = "cpu") -> tuple[fx.GraphModule, list[str]]:
    """The stage's joint ``(*params, x, *data, dy) -> (y, dx, *dparams)`` traced over ``torch.func.vjp``.

    Returns the graph (functionalized: no in-place ops, so it can be cut anywhere) and the env
    name of each placeholder. Stage 0 has no ``x`` and no ``dx``.

        joint, names = trace_joint(stage)   # names: ['param:layers.w1', ..., 'x', 'data:targets', 'dy']
    """
    n_p, has_x = len(stage.param_paths), stage.in_spec is not None
    n_d = len(stage.data_paths)
    fwd = stage.forward

    def joint(*flat):
        params = list(flat[:n_p])
        x = flat[n_p] if has_x else None
        data = list(flat[n_p + has_x: n_p + has_x + n_d])
        dy = flat[-1]

        def f(params, x):
            head = [x] if has_x else []
            return fwd(*head, *data, *params)[0]

        primals = (params, x) if has_x else (params,)
        y, vjp_fn = torch.func.vjp(f if has_x else (lambda p: f(p, None)), *primals)
        cot = vjp_fn(dy)
        dparams = list(cot[0])
        dx = [cot[1]] if has_x else []
        return [y, *dx, *dparams]

    specs = [stage.param_specs[p] for p in stage.param_paths]
    specs += [stage.in_spec] if has_x else []
    specs += [_data_spec(stage, p) for p in stage.data_paths]
    specs += [stage.out_spec]
    names = [f"param:{p}" for p in stage.param_paths] + (["x"] if has_x else [])
    names += [f"data:{p}" for p in stage.data_paths] + ["dy"]
    fakes = _fake_inputs(specs, torch.device(device))
    if not _calls_differentiable(fwd):
        return make_fx(torch.func.functionalize(joint), tracing_mode="fake")(*fakes), names
    # functionalize has no rule for autograd.Functions: trace the joint first (the Functions become
    # their forward and backward ops), then functionalize that graph.
    raw = make_fx(joint, tracing_mode="fake")(*fakes)
    return make_fx(torch.func.functionalize(raw), tracing_mode="fake")(*fakes), names


def _calls_differentiable(gm: fx.GraphModule) -> bool:
    wrapped = set(_differentiable_ops().values())
    return any(n.op == "call_function" and n.target in wrapped for n in gm.graph.nodes)


def _data_spec(stage: Stage, path: str) -> TensorSpec:
    ph = next(n for n in stage.forward.graph.nodes if n.op == "placeholder" and n.target == _identifier(f"data:{path}"))
    return TensorSpec.of(_val(ph))


def stack_layer_grads(gm: fx.GraphModule, outputs: Sequence[fx.Node]) -> list[fx.Node]:
    """Rewrite each output that sums ``select_backward(g_i, [k, ...], 0, i)`` over every layer
    ``i < k`` into one ``stack([g_0, ..., g_{k-1}])``: the gradient of a stacked slice no longer
    materialises a zero ``[k, ...]`` tensor per layer. Returns the (possibly new) outputs.

        dparams = stack_layer_grads(joint, dparams)   # add(select_backward(g1, .., 1), select_backward(g0, .., 0)) -> stack([g0, g1])
    """
    out = []
    for node in outputs:
        leaves = _add_tree(node)
        sb = torch.ops.aten.select_backward.default
        sizes = {tuple(leaf.args[1]) for leaf in leaves if leaf.target is sb and leaf.args[2] == 0} if leaves else set()
        if not leaves or len(sizes) != 1 or any(leaf.target is not sb or leaf.args[2] != 0 for leaf in leaves):
            out.append(node)
            continue
        k = sizes.pop()[0]
        by_layer: dict[int, list[fx.Node]] = {}
        for leaf in leaves:
            by_layer.setdefault(leaf.args[3] % k, []).append(leaf.args[0])
        if sorted(by_layer) != list(range(k)):
            out.append(node)
            continue
        with gm.graph.inserting_after(node):
            parts = []
            for i in range(k):
                g = by_layer[i][0]
                for extra in by_layer[i][1:]:
                    g = gm.graph.call_function(torch.ops.aten.add.Tensor, (g, extra))
                parts.append(g)
            stacked = gm.graph.call_function(torch.ops.aten.stack.default, (parts, 0))
        stacked.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(stacked)
        out.append(stacked)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return out


def _add_tree(node: fx.Node) -> list[fx.Node]:
    """The summands of a tree of ``aten.add.Tensor`` nodes rooted at ``node`` (``[node]`` if it is not an add)."""
    if node.target is not torch.ops.aten.add.Tensor or node.kwargs.get("alpha", 1) != 1:
        return [node]
    leaves = []
    for a in node.args:
        if not isinstance(a, fx.Node):
            return []
        leaves += _add_tree(a) if len(a.users) == 1 else [a]
    return leaves


def split_fiw(stage: Stage, device: torch.device | str = "cpu") -> Stage:
    """Fill ``stage.F``, ``stage.I``, ``stage.W`` from its joint, cut by dependency on ``dy``.

    F computes ``y`` and what the backward needs from the forward (the ancestors of ``y`` that
    do not depend on ``dy``); I computes ``dx`` (the remaining ancestors of ``dx``); W computes
    the parameter gradients (everything else they need). A backward-only value that does not
    depend on ``dy`` (a weight's transpose, ``sigmoid(x)``) is computed in the part that needs
    it, not saved from F. Stage 0 has no ``dx``: its I is empty.

    Example:
        stage = split_fiw(stage)
        env = stage.inputs_env(params, x, data); stage.F.run(env)
        env["dy"] = dy; stage.I.run(env); stage.W.run(env)   # env[stage.dx_name], grads by stage.grad_names
    """
    gm, names = trace_joint(stage, device)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    name_of = {n: nm for n, nm in zip(placeholders, names)}
    outs = _output_nodes(gm)
    has_x = stage.in_spec is not None
    y, dx, dparams = outs[0], (outs[1] if has_x else None), stack_layer_grads(gm, outs[1 + has_x:])
    dy = placeholders[-1]
    ph = set(placeholders)

    after_dy = _descendants([dy])
    f_set = _closure({n for n in _ancestors([y]) if n not in after_dy and n not in ph})
    i_set = {n for n in _ancestors([dx] if dx is not None else []) if n not in f_set and n not in ph}
    w_set = {n for n in _ancestors(dparams) if n not in f_set and n not in i_set and n not in ph}
    # Views of parameters are re-made where they are used rather than saved across parts.
    param_views = _param_views(gm, {n for n, nm in name_of.items() if nm.startswith("param:")})
    i_set = _closure(i_set | _views_needed(i_set, param_views))
    w_set = _closure(w_set | _views_needed(w_set, param_views))

    for n in gm.graph.nodes:
        if n not in ph and n.op != "output":
            name_of.setdefault(n, n.name)

    results = {"F": [y], "I": [dx] if dx is not None else [], "W": list(dparams)}
    sets = {"F": f_set, "I": i_set, "W": w_set}
    ins = {k: _inputs_of(gm, sets[k], results[k]) for k in sets}
    read_by = {"F": set(ins["I"]) | set(ins["W"]), "I": set(ins["W"]), "W": set()}

    def part(k: str) -> Part:
        exported = [n for n in gm.graph.nodes if n in sets[k] and n in read_by[k]]
        outputs = _dedupe(results[k] + exported)
        sub = extract_subgraph(gm, sets[k], ins[k], outputs, input_names=[name_of[n] for n in ins[k]])
        return Part(sub, tuple(name_of[n] for n in ins[k]), tuple(name_of[n] for n in outputs))

    stage.F, stage.I, stage.W = part("F"), part("I"), part("W")
    stage.y_name = name_of[y]
    stage.dx_name = name_of[dx] if dx is not None else None
    stage.grad_names = tuple(name_of[n] for n in dparams)
    return stage


def _param_views(gm: fx.GraphModule, params: set[fx.Node]) -> set[fx.Node]:
    """Nodes that are views of parameters only (``select(w, 0, i)``, ``w.t()``, chains of them)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and _is_view(n) and n.all_input_nodes and all(
                a in params or a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _views_needed(nodes: set[fx.Node], views: set[fx.Node]) -> set[fx.Node]:
    """The parameter views that ``nodes`` read, with the views those are made from."""
    return _ancestors([a for n in nodes for a in n.all_input_nodes if a in views],
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


# ----------------------------------------------------------------------------- the whole thing


def build_pipeline(loss_fn: Callable, params: Any, microbatch: Any, n_stages: int | None = None, *,
                   split: Iterable[int] | None = None, bytes_weight: float = 1.0,
                   device: torch.device | str | None = None) -> Pipeline:
    """Split ``loss_fn(params, batch)`` into ``n_stages`` pipeline stages with F / I / W programs.

    Args:
        loss_fn: ``(params, batch) -> 0-d loss``, a mean over the microbatch's tokens.
        params: the parameter tree (real or fake tensors: only shapes and dtypes are read).
        microbatch: ONE microbatch of the batch (``{"inputs": [b, S], "targets": [b, S]}``).
        n_stages: number of stages; None: one per ``sf.pipeline_split`` marker + 1 (1 without).
        split: the stages to build F / I / W programs for (None: all); a rank needs only its own.
        bytes_weight: cost per parameter byte a stage holds, added to its FLOPs when balancing.
        device: where the programs' constants live (default: the parameters' device).

    Example:
        pipe = build_pipeline(lambda p, b: llama.loss(p, b, cfg), params, microbatch, n_stages=2)
        print(pipe.describe())
    """
    traced = trace_loss(loss_fn, params, microbatch)
    stages, cuts, n_valid = split_stages(traced, n_stages, bytes_weight=bytes_weight)
    if device is None:
        leaves = optree.tree_leaves(params)
        device = leaves[0].device if leaves else torch.device("cpu")
    for s in stages:
        if split is None or s.index in set(split):
            split_fiw(s, device)
    owner: dict[str, list[int]] = {p: [] for p in traced.param_specs}
    for s in stages:
        for p in s.param_paths:
            owner[p].append(s.index)
    unused = [p for p, o in owner.items() if not o]
    if unused:
        raise PipelineError(f"parameters {unused} are not used by the loss; the pipeline holds each parameter in "
                            f"the stage that uses it, so drop them from the tree (or use them)")
    return Pipeline(stages, dict(traced.param_specs), traced.param_treedef, owner, dict(traced.microbatch),
                    [c.value.name for c in cuts], n_valid, traced.graph_module)


# ----------------------------------------------------------------------------- params per stage


def stage_params(params: Any, pipe: Pipeline, stage: int) -> dict[str, torch.Tensor]:
    """``path -> tensor`` of what ``stage`` holds (stacked leaves narrowed to its layers), from the full tree.

        held = stage_params(params, pipe, 1)   # {"layers.w1": w1[l0:l1], "norm": ..., ...}
    """
    flat = dict(flatten_with_paths(params))
    s = pipe.stages[stage]
    out = {}
    for path in s.param_paths:
        x = flat[path]
        if path in s.layer_ranges:
            l0, l1 = s.layer_ranges[path]
            x = x[l0:l1]
        out[path] = x
    return out


def merge_params(held: dict[int, dict[str, torch.Tensor]], pipe: Pipeline) -> Any:
    """The full parameter tree from every stage's ``path -> tensor`` (inverse of :func:`stage_params`).

        params = merge_params({s: stage_params(params, pipe, s) for s in range(pipe.n_stages)}, pipe)
    """
    leaves = []
    for path in pipe.param_specs:
        holders = pipe.owner[path]
        parts = []
        for s in sorted(holders, key=lambda s: pipe.stages[s].layer_ranges.get(path, (0, 0))[0]):
            if s not in held:
                raise ValueError(f"merge_params needs stage {s} (it holds {path!r}); got stages {sorted(held)}")
            parts.append(held[s][path])
        leaves.append(parts[0] if len(parts) == 1 else torch.cat(parts, 0))
    return optree.tree_unflatten(pipe.param_treedef, leaves)
