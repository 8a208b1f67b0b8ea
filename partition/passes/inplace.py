"""Elementwise ops written in place where the value they would copy dies with them.

A traced per-rank program is functional: every ``add``, ``mul``, ``div`` makes a new tensor, so
an optimizer update, one chain of such ops per parameter (``v + eps``, ``u + wd * p``,
``p + u``), allocates and writes a parameter-sized tensor at each link where
``torch.optim.AdamW(foreach=True)`` writes into the one it has. This pass, run on the program
an eager step executes, rewrites ``op(a, ...)`` into ``op_(a, ...)`` (the same kernel, writing
into ``a``; so the values are the same to the bit) where:

- the op is elementwise with an in-place form (:data:`INPLACE_OPS`), and its result has ``a``'s
  shape, dtype and strides (no broadcast onto a larger result, no type promotion);
- nothing reads ``a``'s memory after the op: not ``a``, not a view of it, not a tensor it is
  a view of (the pieces of a ``split`` are apart from each other), not the program's outputs;
- that memory is the program's own: not an input (the caller's parameters and state stay as
  they were), unless the caller donated that input (``donated``, from ``sf.jit``'s
  ``donate_argnums``: the new parameters and moments are then written over the old, as
  ``torch.optim`` writes them), and not read by an op outside ATen that could keep it past its
  last use in the graph (a collective until its ``wait_tensor``, an opaque op such as the MoE
  exchange for good).

``mul(s, a)`` and ``add(s, a)`` (no ``alpha``) are taken as ``mul(a, s)`` and ``add(a, s)``
where ``a`` is the one that dies: IEEE addition and multiplication commute exactly.

    gm = in_place(copy_of_program)          # rewritten in place and recompiled; gm returned
    count_targets(gm)["aten.add_.Tensor"]   # the adds that now write into a dying input
"""

from __future__ import annotations

import copy
import operator
from collections import Counter
from collections.abc import Sequence

import torch
import torch.fx as fx

from shardfn.partition.spmd.fx import memory_order

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

INPLACE_OPS = ("add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv", "sqrt", "rsqrt", "neg",
               "reciprocal", "exp", "sigmoid", "tanh", "silu", "relu")
"""The elementwise ATen ops (by name) this pass writes in place; each has an ``op_`` form."""

_COMMUTATIVE = ("add", "mul")
_PIECES = (_aten.split.Tensor, _aten.split_with_sizes.default, _aten.unbind.int, _aten.chunk.default)
"""Ops whose outputs are disjoint pieces of their input: writing one leaves the others as they are."""
_NO_ALIAS_ANNOTATION_VIEWS = (_aten._unsafe_view.default,)
_END = 1 << 62


def in_place_copy(gm: fx.GraphModule, donated: Sequence[bool] = ()) -> fx.GraphModule:
    """A copy of ``gm`` (the nodes copied, their values shared) with :func:`in_place` applied;
    ``gm`` itself is left as it was (the reports read it).

        program = in_place_copy(lowered.graph_module)
    """
    return in_place(fx.GraphModule(gm, copy.deepcopy(gm.graph)), donated)


def in_place(gm: fx.GraphModule, donated: Sequence[bool] = ()) -> fx.GraphModule:
    """Rewrite ``gm``'s elementwise ops into their in-place forms where their first input dies
    with them (see the module docstring); returns ``gm``, recompiled. ``donated[i]``: the
    program may write over its ``i``-th input where that value dies (default: no input).

        in_place(gm)
        in_place(gm, donated=[True, True, False])   # the first two inputs are the caller's to lose
    """
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    own = {n for n, d in zip(inputs, donated) if d}   # inputs whose memory the program may reuse
    position = {n: i for i, n in enumerate(nodes)}
    base: dict[fx.Node, fx.Node] = {}                 # a node -> the node whose memory it views
    children: dict[fx.Node, list[fx.Node]] = {}
    last_read: dict[fx.Node, int] = {}                # the last position that reads a node's value
    for n in nodes:
        src = _aliased_input(n)
        if src is not None:
            base[n] = src
            children.setdefault(src, []).append(n)
        for a in n.all_input_nodes:
            last_read[a] = max(last_read.get(a, -1), _read_until(n, position))
    changed = False
    for i, n in enumerate(nodes):
        form = next((f for f in _in_place_forms(n)
                     if _dies_here(f[1][0], i, base, children, last_read, position, own)), None)
        if form is None:
            continue
        target, args = form
        a = args[0]
        n.target, n.args = target, args
        base[n] = a
        children.setdefault(a, []).append(n)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def count_targets(gm: fx.GraphModule) -> Counter:
    """How many ``call_function`` nodes call each target, by its name (``"aten.add_.Tensor"``).

        count_targets(gm)["aten.div.Tensor"]
    """
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _aliased_input(n: fx.Node) -> fx.Node | None:
    """The input node whose memory ``n``'s value lies in (a view, an in-place result, a
    ``wait_tensor``, a piece of a view op's outputs), or None for a value of its own."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    src = n.args[0]
    if n.target is operator.getitem:
        return src if src.op == "call_function" and _aliases(src.target) else None
    if _aliases(n.target) or n.target is _c10d.wait_tensor.default:
        return src
    return None


def _aliases(target) -> bool:
    """The op's result lies in its first input's memory (a view, or that input written in place)."""
    schema = getattr(target, "_schema", None)
    return target in _NO_ALIAS_ANNOTATION_VIEWS or (
        schema is not None and any(r.alias_info is not None for r in schema.returns))


def _read_until(n: fx.Node, position: dict) -> int:
    """Until where ``n`` may read its inputs: its own position for an ATen op; a collective's
    ``wait_tensor`` for a collective (it reads its input in the background until then); the
    end of the program for any other op (it may keep its inputs)."""
    if n.op == "output":
        return _END
    if n.op != "call_function" or n.target in (operator.getitem, _c10d.wait_tensor.default):
        return position[n]
    namespace = getattr(n.target, "namespace", None)
    if namespace == "aten":
        return position[n]
    if namespace == "_c10d_functional":
        waits = [position[u] for u in n.users if u.target is _c10d.wait_tensor.default]
        return max(waits) if waits else _END
    return _END


def _in_place_forms(n: fx.Node) -> list:
    """The ``(in-place target, args)`` an elementwise op with an in-place form could become: its
    result written into its first input, or for a commutative op into its second (the two
    swapped); empty for any other op or where no input has the result's layout."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return []
    name = n.target._schema.name
    if not name.startswith("aten::") or name[6:] not in INPLACE_OPS:
        return []
    packet = getattr(_aten, name[6:] + "_", None)
    overload = n.target._overloadname
    if packet is None or overload not in packet.overloads():
        return []
    target = getattr(packet, overload)
    out = n.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return []
    args = tuple(n.args)
    forms = [(target, args)] if _fits(args[0], out) else []
    if (name[6:] in _COMMUTATIVE and len(args) == 2 and not n.kwargs and isinstance(args[1], fx.Node)
            and _fits(args[1], out)):
        forms.append((target, (args[1], args[0])))
    return forms


def _fits(a, out: torch.Tensor) -> bool:
    """``a`` (a node) holds a tensor ``out`` can be written into: same shape, dtype, device and
    strides, each element its own (no stride-0 broadcast)."""
    val = a.meta.get("val") if isinstance(a, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.shape != out.shape or val.dtype != out.dtype:
        return False
    if val.device != out.device or val.stride() != out.stride():
        return False
    return val.numel() > 0 and memory_order(val) is not None


def _dies_here(a: fx.Node, i: int, base: dict, children: dict, last_read: dict, position: dict,
               own: set = frozenset()) -> bool:
    """Nothing reads ``a``'s memory after position ``i``, and that memory is the program's own
    (made by it, or an input in ``own``, the donated ones)."""
    if (a.op != "call_function" and a not in own) or position.get(a, _END) >= i:
        return False
    up = [a]
    while up[-1] in base:
        up.append(base[up[-1]])
    if up[-1].op != "call_function" and up[-1] not in own:  # an input's (or a constant's) memory
        return False
    on_path = set(up)
    stack, seen = [up[-1]], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if last_read.get(node, -1) > i:
            return False
        for child in children.get(node, ()):
            if child in on_path or not (child.target is operator.getitem and node.target in _PIECES):
                stack.append(child)  # (another piece of a split lies apart from a's)
    return True
