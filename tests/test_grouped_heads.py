"""The per-rank program's flash attentions read grouped key/value heads without repeating them
(partition/grouped_heads.py): the same forward to the bit, gradients to float rounding."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core import layers as L
from shardfn.partition.grouped_heads import BACKWARD, FORWARD, read_grouped_heads

aten = torch.ops.aten


def _inputs():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(*s, generator=g) for s in ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8), (2, 4, 16, 8))]


def _kernels(gm):
    return [n for n in gm.graph.nodes if n.target in (FORWARD, BACKWARD)]


def _attention_and_grads(q, k, v, dy):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = L.attention(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dy))


def test_the_kernels_read_the_groups_and_the_repeats_and_group_sums_are_gone():
    args = _inputs()
    traced = make_fx(_attention_and_grads)(*args)  # traced: heads repeated, as the partitioner shards them
    assert [n.args[1 if n.target is FORWARD else 2].meta["val"].shape[1] for n in _kernels(traced)] == [4, 4]
    want = traced(*args)
    gm = read_grouped_heads(traced)
    forward, backward = _kernels(gm)
    assert forward.args[1].meta["val"].shape[1] == 2 and backward.args[2].meta["val"].shape[1] == 2
    targets = [n.target for n in gm.graph.nodes]
    assert aten.clone.default not in targets and aten.expand.default not in targets  # no repeated copy
    assert aten.sum.dim_IntList not in targets  # the kernel sums each group's key/value gradients itself
    assert [tuple(u.meta["val"].shape) for u in backward.users] == [(2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8)]
    got = gm(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # forward, query gradient: to the bit
    for a, b in zip(got[2:], want[2:]):  # key/value gradients: each group's sum in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_backward_whose_gradients_are_not_summed_per_group_keeps_its_repeats():
    q, k, v, dy = _inputs()

    def grads_of_the_repeated(q, k, v, dy):  # gradients of the repeated key/value themselves
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        return torch.autograd.grad(out, (kr, vr), dy)

    gm = make_fx(grads_of_the_repeated)(q, k, v, dy)
    want = gm(q, k, v, dy)
    read_grouped_heads(gm)
    forward, backward = _kernels(gm)
    assert forward.args[1].meta["val"].shape[1] == 2        # the forward reads the groups
    assert backward.args[2].meta["val"].shape[1] == 4       # the backward still gets its repeats
    for a, b in zip(gm(q, k, v, dy), want):
        assert torch.equal(a, b)
