"""Pipeline stages from one traced loss: cut points, the layer split, and per-stage programs.

The loss of ONE microbatch is traced once with fake tensors. Every node that depends on the
token ids (the batch leaf whose path ends in ``inputs``) is an *activation*; every other node
is *free* (parameter slices ``select(w, 0, i)``, views of parameters, rope tables, reshaped
targets) and is duplicated into each stage that uses it. A cut between two positions of the
activations' topological order is valid when exactly one floating-point activation crosses it.
When the parameters are stacked layers, the cuts between layers make the loss a sequence of
*layers* (:func:`layer_units`: the embedding joins the first, the head the last), and
``n_stages - 1`` of those boundaries are chosen to minimise the most expensive stage
(matmul FLOPs + elementwise outputs + parameter bytes, :func:`choose_cuts`) -- the planner asks
the same functions, so a plan describes the split that runs. ``sf.pipeline_split`` markers fix
the cuts instead. docs/pipeline.md has the whole design.

Each stage is its own program ``(x, *data, *params) -> y``, where a stacked parameter is the
stage's own slice ``w[l0:l1]`` with its ``select`` indices rebased, so a rank only ever holds
its stages' layers. Its backward is split into F / I / W programs by ``partition.pipeline.fiw``.

    pipe = build_pipeline(loss_fn, params, microbatch, n_stages=4)
    print(pipe.describe())
    env = pipe.stages[1].inputs_env(stage_params, x=h, data=mb)     # then F, I, W run on env
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import optree
import torch
import torch.fx as fx

from shardfn.core.pytree import flatten_with_paths
from shardfn.partition.cost.flops import node_flops
from shardfn.partition.pipeline.fiw import Part, TensorSpec, differentiable_ops, split_fiw
from shardfn.partition.spmd.fx import (
    ancestors,
    descendants,
    extract_subgraph,
    identifier,
    nbytes,
    node_val,
    output_nodes,
)
from shardfn.partition.spmd.trace import trace

STREAM_SUFFIX = "inputs"
"""The batch leaf whose path ends with this is the pipeline's stream source (token ids)."""

_SELECT = torch.ops.aten.select.int
_SPLIT = torch.ops.shardfn.pipeline_split.default


class PipelineError(ValueError):
    """The model cannot be split as asked; the message names the value and the config key."""


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
        flops, param_bytes: the forward's cost (``partition.cost.flops.node_flops`` summed) and the bytes of the
            parameters it holds.
        F, I, W: the split joint (``partition.pipeline.fiw.split_fiw``); ``y_name``, ``dx_name`` and
            ``grad_names`` (aligned with ``param_paths``) name their results in the value env.
        sides: the forward's 0-d results after ``y`` (:func:`stage_sums`): ``"loss"``, this
            stage's part of the loss (its gradient seeded like the loss's: ``dloss``), and
            ``"aux:<key>"``, its part of an aux value; ``side_names`` name them in F's env.
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
    sides: tuple[str, ...] = ()
    side_names: tuple[str, ...] = ()

    @property
    def input_names(self) -> tuple[str, ...]:
        """Env names of the forward's inputs, in order: ``x``, ``data:*``, ``param:*``."""
        head = () if self.in_spec is None else ("x",)
        return head + tuple(f"data:{p}" for p in self.data_paths) + tuple(f"param:{p}" for p in self.param_paths)

    def inputs_env(self, params: dict[str, torch.Tensor], x: torch.Tensor | None,
                   data: dict[str, torch.Tensor]) -> dict:
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
    regions: tuple = field(default=(), repr=False)   # the sf.local_map regions the programs call
    aux_keys: tuple[str, ...] = ()   # the loss's 0-d aux values, which the stages compute in parts

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def tied(self) -> dict[str, list[int]]:
        """``path -> stages`` of the leaves several stages hold whole (tied embedding and head):
        each holds a copy, their gradients are summed, and the first holder's copy is the one
        saved and counted.

            pipe.tied   # {"embed": [0, 1]} for a two-stage model with tie_embeddings
        """
        return {p: list(o) for p, o in self.owner.items()
                if len(o) > 1 and not any(p in self.stages[s].layer_ranges for s in o)}

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
    regions: tuple = ()              # the sf.local_map regions the graph calls (kept alive with it)
    aux: dict = field(default_factory=dict)  # name -> node of each 0-d floating-point aux value

    @property
    def roots(self) -> list[fx.Node]:
        """What the stages compute: the additive terms of the loss and of each aux value
        (:func:`additive_terms`), so a per-layer term summed at the end is no value that crosses
        a cut."""
        out = list(additive_terms(self.loss)[0])
        for node in self.aux.values():
            out += additive_terms(node)[0]
        return list(dict.fromkeys(out))


def trace_loss(loss_fn: Callable, params: Any, batch: Any) -> TracedLoss:
    """Trace ``loss_fn(params, batch)`` (one microbatch) with fake tensors (``partition.spmd.trace``).

    Example:
        traced = trace_loss(lambda p, b: model.loss(p, b, cfg), params, microbatch)
        traced.stream.name, traced.loss.name
    """
    b_items = flatten_with_paths(batch)
    streams = [p for p, _ in b_items if p == STREAM_SUFFIX or p.endswith("." + STREAM_SUFFIX)]
    if len(streams) != 1:
        raise PipelineError(f"the batch needs exactly one leaf named {STREAM_SUFFIX!r} (the token ids that enter "
                            f"stage 0); its leaves are {[p for p, _ in b_items]}")

    aux_names: list[str] = []

    def checked(p, b):
        out = loss_fn(p, b)
        aux = {}
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out, aux = out
        if not isinstance(out, torch.Tensor) or out.ndim != 0:
            raise PipelineError(f"the pipelined loss must return one 0-d tensor, got {type(out).__name__}"
                                f"{'' if not isinstance(out, torch.Tensor) else ' of shape ' + str(tuple(out.shape))}")
        scalars = {k: v for k, v in aux.items() if isinstance(v, torch.Tensor) and v.ndim == 0
                   and v.is_floating_point()}
        aux_names[:] = list(scalars)
        return [out, *scalars.values()]

    traced = trace(checked, (params, batch))
    placeholders = [n for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
    param_nodes, data_nodes = {}, {}
    for path, node, meta in zip(traced.in_paths, placeholders, traced.in_meta):
        arg, _, leaf = path.partition(".")
        (param_nodes if arg == "0" else data_nodes)[leaf] = node
    loss, *aux = output_nodes(traced.graph_module)
    specs = {p: TensorSpec.of(m) for p, m in zip(traced.in_paths, traced.in_meta)}
    return TracedLoss(
        traced.graph_module, param_nodes, data_nodes, data_nodes[streams[0]], loss,
        optree.tree_structure(params, none_is_leaf=False),
        {p: specs[f"0.{p}"] for p in param_nodes}, {p: specs[f"1.{p}"] for p in data_nodes}, traced.regions,
        dict(zip(aux_names, aux)),
    )


_ADD = torch.ops.aten.add.Tensor
_SUM = torch.ops.aten.sum.default
_STACK = torch.ops.aten.stack.default


def _scalar(node) -> bool:
    value = node_val(node) if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point()


def additive_terms(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """``(terms, sums)``: the 0-d values whose sum is ``node`` -- through ``a + b`` of 0-d values and
    ``stack([...]).sum()`` of them, as a loss adds per-layer auxiliary losses -- and the nodes that
    add them up. A node that is no such sum is its own only term.

    Example:
        additive_terms(loss)   # ([ce, balance_0, balance_1], [stack, sum, add]) for ce + stack(b).sum()
    """
    terms: list[fx.Node] = []
    sums: list[fx.Node] = []

    def walk(n):
        if n.op == "call_function" and _scalar(n):
            if n.target is _ADD and len(n.args) == 2 and not n.kwargs and all(_scalar(a) for a in n.args):
                sums.append(n)
                for a in n.args:
                    walk(a)
                return
            src = n.args[0] if n.target is _SUM and len(n.args) == 1 and not n.kwargs else None
            if isinstance(src, fx.Node) and src.target is _STACK and len(src.args) == 1 \
                    and all(_scalar(a) for a in src.args[0]):
                sums.extend([n, src])
                for a in src.args[0]:
                    walk(a)
                return
        terms.append(n)

    walk(node)
    return list(dict.fromkeys(terms)), sums


# ----------------------------------------------------------------------------- cut points


@dataclass(frozen=True)
class CutPoint:
    """A valid cut: after ``position`` activations of the order, only ``value`` crosses."""

    position: int
    value: fx.Node


def activation_order(traced: TracedLoss) -> list[fx.Node]:
    """The activations (non-placeholder nodes depending on the token ids that the loss needs), in graph order."""
    live = ancestors(traced.roots)
    deps = descendants([traced.stream])
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
        # users outside the order (the output, the sums of additive terms, dead code) end nothing:
        # the loss is the order's last node, and each stage adds up the terms it computes
        last = max((index[u] if u in index else i for u in node.users), default=i)
        if last > i:  # live on positions i+1 .. last
            delta[i + 1] += 1
            delta[last + 1] -= 1
            delta_sum[i + 1] += i
            delta_sum[last + 1] -= i
    cuts, live, live_sum = [], 0, 0
    for k in range(1, n):
        live += delta[k]
        live_sum += delta_sum[k]
        value = node_val(order[live_sum]) if live == 1 else None
        if isinstance(value, torch.Tensor) and value.is_floating_point():
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
        for src in ancestors(node.all_input_nodes, stop=stop):
            if src not in acts and src not in charged and (_param_slice(src) or _is_param_ph(src)):
                charged.add(src)
                held += nbytes(node_val(src))
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
    # best[j][i]: cheapest max cost of j+1 non-empty stages covering [0, q[i]) (so i >= j+1)
    best = [[inf] + [prefix[p] for p in q[1:]]]
    arg: list[list[int]] = [[-1] * len(q)]
    for j in range(1, n_stages):
        prev, row, back = best[-1], [inf] * len(q), [-1] * len(q)
        for i in range(j + 1, len(q)):
            # the last stage is [q[u], q[i]) with u >= j (j stages before it); prev[u] grows with u
            # while that stage's cost shrinks, so the best u is where they cross: binary search,
            # then look at both neighbours.
            lo, hi = j, i
            while lo < hi:
                m = (lo + hi) // 2
                if prev[m] >= prefix[q[i]] - prefix[q[m]]:
                    hi = m
                else:
                    lo = m + 1
            for u in (lo - 1, lo):
                if j <= u < i:
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


def _too_many_stages(n_stages: int, n_units: int, layered: bool) -> PipelineError:
    where = ("layers (a stage holds whole layers)" if layered else
             "pieces between its valid cut points (places where exactly one activation crosses)")
    return PipelineError(
        f"cannot split the model into {n_stages} pipeline stages: its loss has only {n_units} {where}, so at "
        f"most {n_units} stages; lower pipeline.stages (or mesh.pp) to {n_units} or fewer, or use a model with "
        f"more layers"
    )


@dataclass(frozen=True)
class LayerUnits:
    """A traced loss as the sequence a pipeline splits: its layers (stacked parameters' ``select``
    slices tell which nodes belong to which layer), the embedding joined to the first and the head
    to the last. Without stacked layers every piece between two valid cuts is a unit.

    Attributes:
        bounds: the cut after each unit but the last (``len(units) - 1`` of them).
        costs: each unit's cost (:func:`activation_costs` summed over its nodes).
        layers: each unit's ``(stack, index)`` (the leaf path's first key and the layer), or
            None for units of a loss without stacked layers.
    """

    bounds: tuple[CutPoint, ...]
    costs: tuple[float, ...]
    layers: tuple | None

    def split(self, n_stages: int) -> list[CutPoint]:
        """The ``n_stages - 1`` boundaries minimising the costliest stage (:func:`split_costs`)."""
        if not 1 <= n_stages <= len(self.costs):
            raise _too_many_stages(n_stages, len(self.costs), self.layers is not None)
        return [self.bounds[k - 1] for k in split_costs(self.costs, n_stages)]


def split_costs(costs: Sequence[float], n_stages: int) -> list[int]:
    """Where to cut a sequence of unit costs into ``n_stages`` contiguous stages so that the
    costliest stage is as cheap as possible: the index of each stage's first unit but the first's.
    The runtime splits a traced loss with it and the planner a model's per-layer costs, so both
    get the same stages.

    Example:
        split_costs([4, 1, 1, 1, 1], 2)   # [1]: stages of cost 4 and 4
    """
    cuts = [CutPoint(k, None) for k in range(1, len(costs))]
    return [c.position for c in choose_cuts(costs, cuts, n_stages)]


def layer_units(traced: TracedLoss, order: list[fx.Node] | None = None, cuts: list[CutPoint] | None = None, *,
                bytes_weight: float = 1.0) -> LayerUnits:
    """The :class:`LayerUnits` of ``traced``.

    Example:
        units = layer_units(trace_loss(loss_fn, params, mb)); units.layers[:2], units.costs[:2]
    """
    order = activation_order(traced) if order is None else order
    cuts = valid_cuts(order) if cuts is None else cuts
    costs = activation_costs(order, bytes_weight)
    layer_of = _layer_tags(order, traced)
    sequence = list(dict.fromkeys(tag for tag in layer_of if tag is not None))
    bounds = None
    if len(sequence) > 1:
        last = {tag: i for i, tag in enumerate(layer_of) if tag is not None}
        first: dict = {}
        for i, tag in enumerate(layer_of):
            if tag is not None:
                first.setdefault(tag, i)
        bounds = []
        for a, b in zip(sequence[:-1], sequence[1:]):
            between = [c for c in cuts if last[a] < c.position <= first[b]]
            if not between:  # layers that overlap in the order: no whole-layer split
                bounds = None
                break
            bounds.append(between[0])
    if bounds is None:
        bounds, sequence = list(cuts), None
    edges = [0] + [c.position for c in bounds] + [len(order)]
    unit_costs = tuple(sum(costs[a:b]) for a, b in zip(edges[:-1], edges[1:]))
    return LayerUnits(tuple(bounds), unit_costs, tuple(sequence) if sequence is not None else None)


def _layer_tags(order: list[fx.Node], traced: TracedLoss) -> list:
    """Per activation, the ``(stack, layer)`` of the stacked-parameter slices it reads, or None."""
    acts = set(order)
    path_of = _path_of(traced)
    stop = lambda m: m in acts or _param_slice(m) or m.op == "placeholder"  # noqa: E731
    tags = []
    for node in order:
        found = [(path_of[m.args[0]].partition(".")[0], m.args[2] % node_val(m.args[0]).shape[0])
                 for m in ancestors(node.all_input_nodes, stop=stop) if _param_slice(m) and m.args[0] in path_of]
        tags.append(max(found) if found else None)
    return tags


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

IMBALANCE_TOLERANCE = 0.10
"""A split whose costliest stage is more than this above the even share is reported (:func:`imbalance`)."""


def imbalance(traced: TracedLoss, order: list[fx.Node], cuts: list[CutPoint], chosen: Sequence[CutPoint], *,
              bytes_weight: float = 1.0) -> str | None:
    """Why the stages ``chosen`` cannot share the cost within :data:`IMBALANCE_TOLERANCE` of
    even, when the reason is layer boundaries that are no valid cut: each stage's share and the
    values that cross such a boundary (a per-layer value kept to the end and combined other than
    by a sum keeps a second value alive at every boundary; per-layer terms of a sum do not,
    :func:`stage_sums`). None when
    the split is even enough, or when whole layers cannot share the cost more evenly.

    Example:
        imbalance(traced, order, valid_cuts(order), chosen)   # "pipeline stages hold 25% / 75% of ..."
    """
    costs = activation_costs(order, bytes_weight)
    bounds = [0] + [c.position for c in chosen] + [len(order)]
    stage = [sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    total = sum(stage)
    if len(stage) < 2 or total <= 0 or max(stage) <= (1 + IMBALANCE_TOLERANCE) * total / len(stage):
        return None
    tags = _layer_tags(order, traced)
    first: dict = {}
    end: dict = {}
    for i, tag in enumerate(tags):
        if tag is not None:
            first.setdefault(tag, i)
            end[tag] = i
    sequence = list(first)
    positions = [c.position for c in cuts]
    blocked = [(b, first[b]) for a, b in zip(sequence[:-1], sequence[1:])
               if not any(end[a] < p <= first[b] for p in positions)]
    if not blocked:  # whole layers cannot share it more evenly: nothing to explain
        return None
    index = {n: i for i, n in enumerate(order)}
    last = [max((index.get(u, i) for u in n.users), default=i)
            for i, n in enumerate(order)]
    layer, k = blocked[len(blocked) // 2]
    crossing = [order[i] for i in range(k) if last[i] >= k]
    names = ", ".join(f"{n.name} ({getattr(n.target, '__name__', n.target)}, shape "
                      f"{list(getattr(node_val(n), 'shape', []))})" for n in crossing[:4])
    shares = " / ".join(f"{100 * c / total:.0f}%" for c in stage)
    why = (f"{len(blocked)} of {len(sequence) - 1} layer boundaries are no valid cut (one activation crossing): "
           f"before layer {layer[0]}.{layer[1]}, {len(crossing)} values cross: {names}. A value each layer makes "
           f"that the loss reads only at the end does this, unless the loss adds it up (a per-layer auxiliary "
           f"loss summed after the last layer: each stage adds up its own)")
    return f"pipeline stages hold {shares} of the cost, more than {IMBALANCE_TOLERANCE:.0%} off even: {why}"


# ----------------------------------------------------------------------------- stages


def split_stages(traced: TracedLoss, n_stages: int | None, *,
                 bytes_weight: float = 1.0) -> tuple[list[Stage], list[CutPoint], int]:
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
        chosen = layer_units(traced, order, cuts, bytes_weight=bytes_weight).split(n_stages)
        reason = imbalance(traced, order, cuts, chosen, bytes_weight=bytes_weight)
        if reason is not None:
            warnings.warn(reason, stacklevel=2)
    bounds = [0] + [c.position for c in chosen] + [len(order)]
    acts = set(order)
    segments = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    outs, sides, extra = stage_sums(traced, segments, [c.value for c in chosen])
    plans = [_plan_stage(s, seg + extra[s], outs[s], outs[s - 1] if s else None, acts, traced, sides[s])
             for s, seg in enumerate(segments)]
    ranges = _layer_ranges(plans, traced)
    stages = [_build_stage(plan, ranges, traced, is_last=(s == len(plans) - 1)) for s, plan in enumerate(plans)]
    return stages, chosen, len(cuts)


def stage_sums(traced: TracedLoss, segments: list[list[fx.Node]], cut_values: list[fx.Node]):
    """What each stage returns: ``(outs, sides, extra)``. ``outs[s]`` is the value stage ``s``
    sends on (the last stage's: its part of the loss); ``sides[s]`` its 0-d side results
    ``(name, node)``: ``"loss"``, its part of the loss on a stage before the last (per-layer
    auxiliary losses), and ``"aux:<key>"``, its part of each aux value; ``extra[s]`` the nodes
    that add those parts up, which the stage computes besides its segment. Each part is the sum of
    the :func:`additive_terms` the stage computes (a term that reads no activation goes to the
    last stage); a value whose terms are all one stage's is that stage's as traced.

    Example:
        outs, sides, extra = stage_sums(traced, segments, [c.value for c in chosen])
        sides[0]   # [("loss", add_3), ("aux:balance_loss", add_3)]
    """
    last = len(segments) - 1
    stage_of = {n: s for s, seg in enumerate(segments) for n in seg}
    outs: list = list(cut_values) + [None]
    sides: list[list] = [[] for _ in segments]
    extra: list[list] = [[] for _ in segments]
    graph = traced.graph_module.graph
    output = next(n for n in graph.nodes if n.op == "output")
    for name, node in [("loss", traced.loss)] + [(f"aux:{k}", v) for k, v in traced.aux.items()]:
        terms, sums = additive_terms(node)
        by_stage: dict[int, list] = {}
        for t in terms:
            by_stage.setdefault(stage_of.get(t, last), []).append(t)
        if name == "loss" and last not in by_stage:
            by_stage[last] = []
        if len(by_stage) == 1:
            (s,) = by_stage
            parts = {s: node}
            extra[s] += [n for n in sums if n not in extra[s]]
        else:
            parts = {}
            for s, ts in sorted(by_stage.items()):
                parts[s], made = _add_up(graph, ts, output, like=node)
                extra[s] += made
        for s, part in parts.items():
            if name == "loss" and s == last:
                outs[s] = part
            else:
                sides[s].append((name, part))
    return outs, sides, extra


def _add_up(graph: fx.Graph, terms: list[fx.Node], before: fx.Node, like: fx.Node) -> tuple[fx.Node, list]:
    """The sum of ``terms`` (0-d) as new nodes placed before ``before``; a stage with no term gets
    a zero like ``like``."""
    val = node_val(like)
    made = []
    if not terms:
        with graph.inserting_before(before):
            zero = graph.call_function(torch.ops.aten.zeros.default, ([],),
                                       {"dtype": val.dtype, "device": val.device})
        zero.meta["val"] = val
        return zero, [zero]
    acc = terms[0]
    for t in terms[1:]:
        with graph.inserting_before(before):
            acc = graph.call_function(_ADD, (acc, t))
        acc.meta["val"] = val
        made.append(acc)
    return acc, made


@dataclass
class _Plan:
    index: int
    nodes: set            # activations + free nodes the stage computes
    x: fx.Node | None     # the incoming activation
    out: fx.Node
    params: list          # param placeholders used
    data: list            # data placeholders used
    uses: dict            # param placeholder -> set of select indices, or None when used whole
    sides: list = field(default_factory=list)  # (name, node) of its 0-d side results (stage_sums)


def _plan_stage(index, segment, out, x, acts, traced, sides=()) -> _Plan:
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
            size = node_val(p).shape[0]
            uses[p] = {u.args[2] % size for u in users}
        else:
            uses[p] = None
    return _Plan(index, nodes, x, out, params, data, uses, list(sides))


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
        if len(whole) == len(hs):
            continue  # tied (the embedding and the output head): every stage using it holds a copy
        sets = sorted(((min(h.uses[p]), max(h.uses[p]), h) for h in hs if h.uses[p] is not None), key=lambda t: t[0])
        overlap = any(a[1] >= b[0] for a, b in zip(sets[:-1], sets[1:]))
        if whole or overlap:
            raise PipelineError(
                f"parameter {path_of[p]!r} is used by stages {[h.index for h in hs]}, some of them whole and "
                f"some by layer (or by overlapping layers); a stage holds either whole leaves or its own layers: "
                f"place its uses in one stage with sf.pipeline_split / a different pipeline.stages"
            )
        n_layers = node_val(p).shape[0]
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
    names = (
        (["x"] if plan.x is not None else []) + [f"data:{p}" for p in data_paths] + [f"param:{p}" for p in param_paths]
    )
    gm = extract_subgraph(traced.graph_module, plan.nodes, inputs, [plan.out] + [n for _, n in plan.sides],
                          input_names=names)
    layer_ranges = {path: ranges[(plan.index, path)] for path in param_paths if (plan.index, path) in ranges}
    specs = {}
    placeholders = {n.target: n for n in gm.graph.nodes if n.op == "placeholder"}
    for path in param_paths:
        full = traced.param_specs[path]
        if path in layer_ranges:
            l0, l1 = layer_ranges[path]
            specs[path] = TensorSpec((l1 - l0,) + full.shape[1:], full.dtype)
            ph = placeholders[identifier(f"param:{path}")]
            for u in list(ph.users):
                u.args = (ph, 0, u.args[2] % full.shape[0] - l0)
        else:
            specs[path] = full
    for node in [n for n in gm.graph.nodes if n.target is _SPLIT]:  # the cut is made: markers are identities
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    differentiable = differentiable_ops()
    for node in gm.graph.nodes:  # custom ops -> their torch.func-differentiable form (trace_joint)
        if node.op == "call_function" and node.target in differentiable:
            node.target = differentiable[node.target]
    gm.recompile()
    stage = Stage(
        index=plan.index, forward=gm, param_paths=param_paths, layer_ranges=layer_ranges, param_specs=specs,
        data_paths=data_paths, in_spec=None if plan.x is None else TensorSpec.of(node_val(plan.x)),
        out_spec=TensorSpec.of(node_val(plan.out)), is_last=is_last,
        flops=sum(node_flops(n) for n in plan.nodes),
        param_bytes=sum(s.nbytes for s in specs.values()),
        sides=tuple(name for name, _ in plan.sides),
    )
    return stage

# ----------------------------------------------------------------------------- the whole thing


def build_pipeline(loss_fn: Callable, params: Any, microbatch: Any, n_stages: int | None = None, *,
                   split: Iterable[int] | None = None, bytes_weight: float = 1.0,
                   device: torch.device | str | None = None) -> Pipeline:
    """Split ``loss_fn(params, batch)`` into ``n_stages`` pipeline stages with F / I / W programs.

    Args:
        loss_fn: ``(params, batch) -> 0-d loss``, a mean over the microbatch's tokens, or
            ``-> (loss, aux)``: each 0-d floating-point value of ``aux`` is computed by the stages
            that compute its terms (``Stage.sides``, :attr:`Pipeline.aux_keys`).
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
                    [c.value.name for c in cuts], n_valid, traced.graph_module, traced.regions, tuple(traced.aux))


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
        ranged = any(path in pipe.stages[s].layer_ranges for s in holders)
        leaves.append(torch.cat(parts, 0) if ranged else parts[0])  # a tied leaf: every holder has it whole
    return optree.tree_unflatten(pipe.param_treedef, leaves)
