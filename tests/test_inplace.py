"""partition.inplace: elementwise ops written into the input that dies with them, bit for bit the
functional program's values, the caller's tensors never written."""

import operator

import optree
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core import optim
from shardfn.core.transforms import value_and_grad
from shardfn.partition.passes.inplace import count_targets, in_place_copy
from shardfn.partition.spmd.trace import trace

aten = torch.ops.aten


def _adamw_step(params, state, x):
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1))
    loss, grads = value_and_grad(lambda p: (torch.tanh(x @ p["w1"]) @ p["w2"]).square().mean())(params)
    return (*optim.update_and_apply(opt, grads, state, params), loss)


def _adamw_args():
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(16, 32, generator=g), "w2": torch.randn(32, 4, generator=g)}
    state = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1)).init(params)
    state = optree.tree_map(lambda t: t + 0.5 if t.is_floating_point() else t + 3, state)  # moments not zero
    return params, state, torch.randn(8, 16, generator=g)


def _names(counts, *ops):
    return {op: counts[op] for op in ops}


def test_an_adamw_step_writes_its_dead_values_in_place_and_gives_the_same_bits():
    args = _adamw_args()
    gm = trace(_adamw_step, args).graph_module
    code = gm.code
    new = in_place_copy(gm)
    assert gm.code == code  # the traced program is left as it was
    ops = ("aten.add.Tensor", "aten.add_.Tensor", "aten.div.Tensor", "aten.div_.Tensor",
           "aten.mul.Tensor", "aten.mul_.Tensor")
    # per parameter: + eps, + wd * p and p + u (as u + p: p is an input) in place, so are two of
    # its three divisions (m / (1 - b1^t) stays: m is an output, the new moment); the adds left
    # count the steps (inputs, int32) and one of the forward's
    assert _names(count_targets(gm), *ops) == {"aten.add.Tensor": 9, "aten.add_.Tensor": 0, "aten.div.Tensor": 6,
                                               "aten.div_.Tensor": 0, "aten.mul.Tensor": 10, "aten.mul_.Tensor": 0}
    assert _names(count_targets(new), *ops) == {"aten.add.Tensor": 3, "aten.add_.Tensor": 6, "aten.div.Tensor": 2,
                                                "aten.div_.Tensor": 4, "aten.mul.Tensor": 2, "aten.mul_.Tensor": 8}
    leaves = optree.tree_leaves(args)
    before = [x.clone() for x in leaves]
    ref, out = gm(*leaves), new(*leaves)
    assert len(out) == len(ref) and all(torch.equal(a, b) for a, b in zip(out, ref))
    assert all(torch.equal(a, b) for a, b in zip(leaves, before))  # the inputs are not written


def test_a_donated_step_writes_the_new_state_over_the_old_with_the_same_bits():
    # sf.jit's donate_argnums: the params and state placeholders are the program's to write where
    # they die, so the update lands in their memory (as torch.optim's); the batch is never written
    args = _adamw_args()
    gm = trace(_adamw_step, args).graph_module
    n_params, n_state = len(optree.tree_leaves(args[0])), len(optree.tree_leaves(args[1]))
    donated = [True] * (n_params + n_state) + [False]
    new = in_place_copy(gm, donated)
    # beyond what dies inside: both moments' first links (lerp into m, v * b2 into v) and the
    # two step counts (count + 1) now write into the donated inputs
    ops = ("aten.add.Tensor", "aten.lerp.Scalar", "aten.lerp_.Scalar", "aten.mul.Tensor", "aten.mul_.Tensor")
    assert _names(count_targets(in_place_copy(gm)), *ops) == {
        "aten.add.Tensor": 3, "aten.lerp.Scalar": 2, "aten.lerp_.Scalar": 0, "aten.mul.Tensor": 2,
        "aten.mul_.Tensor": 8}
    assert _names(count_targets(new), *ops) == {
        "aten.add.Tensor": 1, "aten.lerp.Scalar": 0, "aten.lerp_.Scalar": 2, "aten.mul.Tensor": 0,
        "aten.mul_.Tensor": 10}
    leaves = optree.tree_leaves(args)
    ref = gm(*leaves)
    given = [x.clone() for x in leaves]
    batch = given[-1].clone()
    out = new(*given)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    # 8 of the 10 state leaves come back in their old memory: parameters, moments and the two
    # step counts (the clip's norm and the step's learning rate are new values, not updates)
    written = {x.data_ptr() for x in given[:-1]} & {y.data_ptr() for y in out}
    assert len(written) == n_params + n_state - 2 == 8
    assert torch.equal(given[-1], batch)


def _targets(fn, *args):
    return [n.target for n in in_place_copy(make_fx(fn)(*args)).graph.nodes if n.op == "call_function"]


def test_an_input_or_a_value_read_later_is_not_written():
    x = torch.randn(4, 4)
    assert _targets(lambda x: x + 1, x) == [aten.add.Tensor]  # the caller's tensor

    def read_later(x):
        y = x * 2
        return y + 1, y.t()  # a view of y is an output: y's memory is read after the add

    assert _targets(read_later, x) == [aten.mul.Tensor, aten.add.Tensor, aten.t.default]

    def dead(x):
        y = x * 2
        return (y + 1).sum()

    assert _targets(dead, x) == [aten.mul.Tensor, aten.add_.Tensor, aten.sum.default]


def test_a_piece_of_a_split_is_written_while_the_other_piece_lives():
    def pieces(x):
        a, b = (x * 2).split([1, 3])
        return a + 1, b * 3

    assert _targets(pieces, torch.randn(4, 4)) == [
        aten.mul.Tensor, aten.split_with_sizes.default, operator.getitem, operator.getitem,
        aten.add_.Tensor, aten.mul_.Tensor]


def test_a_broadcast_or_a_promotion_stays_out_of_place_and_a_scalar_first_product_turns_round():
    x, row = torch.randn(4, 4), torch.randn(4)
    assert _targets(lambda r, x: (r * 2) + x, row, x) == [aten.mul.Tensor, aten.add.Tensor]  # [4] -> [4, 4]
    half = torch.randn(4, 4, dtype=torch.float16)
    assert _targets(lambda h, x: (h * 2) + x, half, x) == [aten.mul.Tensor, aten.add.Tensor]  # -> float32
    s = torch.tensor(0.5)
    gm = in_place_copy(make_fx(lambda s, x: s * (x + 1))(s, x))
    (mul,) = [n for n in gm.graph.nodes if n.target is aten.mul_.Tensor]
    assert [a.name for a in mul.args] == ["add", "s_1"]  # (x + 1) * s, in place
    assert torch.equal(gm(s, x), s * (x + 1))
