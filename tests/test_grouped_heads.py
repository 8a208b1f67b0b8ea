"""The per-rank program's fused attentions read grouped key/value heads without repeating them
(partition/passes/grouped_heads.py): the same forward to the bit, gradients to float rounding. The CUDA
kernels' graphs are built on meta tensors here; ``cuda``-marked tests run them on a GPU."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core import layers as L
from shardfn.partition.passes.grouped_heads import BACKWARD, FORWARD, KERNELS, read_grouped_heads

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


def _meta_inputs(dtype=torch.bfloat16):
    return [torch.empty(*s, device="meta", dtype=dtype) for s in ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8),
                                                                   (2, 4, 16, 8))]


def _cuda_attention(kernel):
    """The joint graph SDPA's CUDA kernel ``kernel`` traces to, on repeated key/value heads."""
    def attention_and_grads(q, k, v, dy):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # as core.layers.attention traces
        if kernel is aten._scaled_dot_product_flash_attention.default:
            out = kernel(q, kr, vr, 0.0, True, scale=0.25)[0]
        else:  # cudnn, efficient: (q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal)
            out = kernel(q, kr, vr, None, True, 0.0, True, scale=0.25)[0]
        return (out, *torch.autograd.grad(out, (q, k, v), dy))
    return attention_and_grads


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k.forward is not FORWARD], ids=lambda k: k.forward.name())
def test_the_cuda_kernels_that_read_groups_get_them_unrepeated(kernel):
    # Traced on meta tensors, so the CUDA ops' own shape functions run on a CPU-only machine.
    gm = make_fx(_cuda_attention(kernel.forward))(*_meta_inputs())
    assert [n.target for n in gm.graph.nodes if n.target in (kernel.forward, kernel.backward)] == \
        [kernel.forward, kernel.backward]
    read_grouped_heads(gm)
    forward, backward = [n for n in gm.graph.nodes if n.target in (kernel.forward, kernel.backward)]
    targets = [n.target for n in gm.graph.nodes]
    heads = 2 if kernel.grouped else 4
    assert forward.args[1].meta["val"].shape[1] == heads and backward.args[2].meta["val"].shape[1] == heads
    assert (aten.clone.default in targets) is not kernel.grouped        # repeats gone where the kernel reads groups
    assert (aten.sum.dim_IntList in targets) is not kernel.grouped
    outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert [tuple(o.meta["val"].shape) for o in outs] == [(2, 4, 16, 8), (2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8)]
    if kernel.grouped:  # the kernel's own key/value gradients are the program's outputs now
        assert [o.args[0] for o in outs[2:]] == [backward, backward]
        assert [tuple(u.meta["val"].shape) for u in backward.users] == [(2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8)]


def test_a_cudnn_attention_with_a_bias_keeps_its_repeats():
    def biased(q, k, v, bias):
        kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return aten._scaled_dot_product_cudnn_attention(q, kr, vr, bias, False, 0.0, False)[0]

    q, k, v, _ = _meta_inputs()
    gm = make_fx(biased)(q, k, v, torch.empty(2, 4, 16, 16, device="meta", dtype=torch.bfloat16))
    read_grouped_heads(gm)
    (forward,) = [n for n in gm.graph.nodes if n.target is aten._scaled_dot_product_cudnn_attention.default]
    assert forward.args[1].meta["val"].shape[1] == 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_traced_attention_reads_the_groups_and_matches(dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    args = [torch.randn(*s, generator=g, device="cuda", dtype=dtype)
            for s in ((2, 8, 256, 128), (2, 2, 256, 128), (2, 2, 256, 128), (2, 8, 256, 128))]
    traced = make_fx(_attention_and_grads)(*args)
    want = traced(*args)
    gm = read_grouped_heads(traced)
    kernel = next(k for k in KERNELS if any(n.target is k.forward for n in gm.graph.nodes))
    targets = [n.target for n in gm.graph.nodes]
    if dtype == torch.bfloat16:  # SDPA picks flash (or cuDNN): both read grouped heads
        assert kernel.grouped and aten.clone.default not in targets
    got = gm(*args)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):  # the kernels' own tiling may differ with the head count: not bitwise here
        torch.testing.assert_close(a, b, **tol)
