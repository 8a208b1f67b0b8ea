"""Grouped GEMM and MoE routing/experts against naive per-expert and per-token loops."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core import moe
from shardfn.core.grouped_mm import alignment, grouped_mm

# ----------------------------------------------------------------------------- grouped_mm


def loop_grouped_mm(x, w, counts):
    """The reference: one matmul per expert over its slice of rows."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(x[start:start + n] @ w[e])
        start += n
    return torch.cat(outs)


def offsets(counts):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


COUNTS = [
    [3, 5, 2, 6],
    [0, 4, 0, 12],   # empty first and middle experts
    [7, 9, 0, 0],    # empty trailing experts
    [16, 0, 0, 0],   # everything on one expert
]


@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_mm_matches_loop_forward_and_backward(counts):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 8, generator=g, requires_grad=True)
    w = torch.randn(len(counts), 8, 12, generator=g, requires_grad=True)
    y, ref = grouped_mm(x, w, offsets(counts)), loop_grouped_mm(x, w, counts)
    torch.testing.assert_close(y, ref)
    dy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, (x, w), dy)
    want = torch.autograd.grad(ref, (x, w), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_grouped_mm_backward_with_expanded_cotangent_and_second_order():
    counts = [0, 4, 0, 6]
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(4, 8, 4, requires_grad=True)
    grouped_mm(x, w, offsets(counts)).sum().backward()  # .sum() sends an expanded (stride-0) cotangent
    torch.testing.assert_close(w.grad[1], x[:4].detach().sum(0)[:, None].expand(8, 4))

    def gradnorm(fn):
        gx, gw = torch.autograd.grad(fn(x, w).square().sum(), (x, w), create_graph=True)
        return torch.autograd.grad(gx.square().sum() + gw.square().sum(), (x, w))

    got = gradnorm(lambda x, w: grouped_mm(x, w, offsets(counts)))
    want = gradnorm(lambda x, w: loop_grouped_mm(x, w, counts))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_grouped_mm_traces_with_fake_tensors_under_torch_func_grad():
    counts = [2, 0, 6]
    x, w, offs = torch.randn(8, 8), torch.randn(3, 8, 16), offsets(counts)
    grad_fn = torch.func.grad(lambda x, w, o: grouped_mm(x, w, o).square().sum(), argnums=(0, 1))
    graph = make_fx(grad_fn, tracing_mode="fake")(x, w, offs)
    assert sum("shardfn.grouped_mm" in str(n.target) for n in graph.graph.nodes) == 3  # forward, dx, dw
    want = torch.func.grad(lambda x, w: loop_grouped_mm(x, w, counts).square().sum(), argnums=(0, 1))(x, w)
    for a, b in zip(graph(x, w, offs), want):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_grouped_mm_compiles():
    counts = [3, 0, 5]
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    fn = torch.compile(lambda x, w, o: grouped_mm(x, w, o).square().sum(), fullgraph=True)
    value = fn(x, w, offsets(counts))
    got = torch.autograd.grad(value, (x, w))
    ref = loop_grouped_mm(x, w, counts).square().sum()
    torch.testing.assert_close(value, ref)
    for a, b in zip(got, torch.autograd.grad(ref, (x, w))):
        torch.testing.assert_close(a, b)


def test_grouped_mm_bfloat16():
    x, w = torch.randn(8, 16).bfloat16(), torch.randn(2, 16, 8).bfloat16()
    y = grouped_mm(x, w, offsets([5, 3]))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), loop_grouped_mm(x.float(), w.float(), [5, 3]), rtol=2e-2, atol=2e-2)


def test_grouped_mm_errors_say_how_to_fix():
    assert alignment(torch.float32) == 4 and alignment(torch.bfloat16) == 8
    with pytest.raises(ValueError, match=r"K .* = 6 must be a multiple of 4 .* e\.g\. to 8"):
        grouped_mm(torch.randn(4, 6), torch.randn(2, 6, 4), offsets([2, 2]))
    with pytest.raises(ValueError, match=r"N \(w.shape\[2\]\) = 5"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 5), offsets([2, 2]))
    with pytest.raises(ValueError, match="int32"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 4), torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="2 experts"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 4), offsets([1, 1, 2]))


# ----------------------------------------------------------------------------- routing


def route_cfg(**kw):
    base = dict(n_experts=8, top_k=2, score_func="softmax", n_groups=1, topk_groups=1, route_scale=1.0,
                norm_topk_prob=False, aux_loss_alpha=0.0)
    return SimpleNamespace(**{**base, **kw})


def naive_route(x, w_router, bias, cfg):
    """Per token: scores, group limit and top-k chosen in plain Python; weights kept differentiable."""
    indices, weights = [], []
    for t in range(x.shape[0]):
        logits = x[t] @ w_router
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()  # [E]
        shift = bias.tolist() if bias is not None else [0.0] * cfg.n_experts
        select = [s + b for s, b in zip(scores.detach().tolist(), shift)]
        allowed = list(range(cfg.n_experts))
        if cfg.n_groups > 1:
            size = cfg.n_experts // cfg.n_groups
            group_score = [sum(sorted(select[g * size:(g + 1) * size])[-2:]) for g in range(cfg.n_groups)]
            best = sorted(range(cfg.n_groups), key=lambda g: -group_score[g])[:cfg.topk_groups]
            allowed = [e for e in allowed if e // size in best]
        chosen = sorted(allowed, key=lambda e: -select[e])[:cfg.top_k]
        w = torch.stack([scores[e] for e in chosen])
        if cfg.norm_topk_prob:
            w = w / w.sum()
        indices.append(chosen)
        weights.append(w * cfg.route_scale)
    return torch.tensor(indices), torch.stack(weights)


ROUTINGS = {
    "softmax": route_cfg(),
    "sigmoid_normed_scaled": route_cfg(score_func="sigmoid", norm_topk_prob=True, route_scale=2.5),
    "group_limited": route_cfg(score_func="sigmoid", n_groups=4, topk_groups=2, top_k=3, norm_topk_prob=True),
    "one_group_each": route_cfg(n_groups=4, topk_groups=1, top_k=2),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_route_matches_per_token_loop(name):
    cfg = ROUTINGS[name]
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(12, 16, generator=g), torch.randn(16, 8, generator=g), 0.1 * torch.randn(8, generator=g)
    r = moe.route(x, w, bias, cfg)
    want_idx, want_w = naive_route(x, w, bias, cfg)
    torch.testing.assert_close(r.indices, want_idx)  # top-k order: best first
    torch.testing.assert_close(r.weights, want_w)
    if cfg.n_groups > 1:  # every token stays within topk_groups groups
        groups = r.indices // (cfg.n_experts // cfg.n_groups)
        assert all(len(set(row.tolist())) <= cfg.topk_groups for row in groups)


def test_bias_changes_selection_only():
    cfg = route_cfg(score_func="sigmoid", norm_topk_prob=False)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(10, 16, generator=g), torch.randn(16, 8, generator=g)
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 is picked for every token ...
    r = moe.route(x, w, bias, cfg)
    assert (r.indices == 5).any(dim=1).all()
    scores = torch.sigmoid(x @ w)
    torch.testing.assert_close(r.weights, scores.gather(1, r.indices))  # ... at its unbiased weight

    def total(bias):
        r = moe.route(x, w, bias, cfg)
        return r.weights.sum()

    assert torch.count_nonzero(torch.func.grad(total)(bias)) == 0


def test_expert_counts_and_bias_update():
    idx = torch.tensor([[0, 3], [3, 1], [3, 0]])
    counts = moe.expert_counts(idx, 5)
    torch.testing.assert_close(counts, torch.bincount(idx.reshape(-1), minlength=5))
    torch.testing.assert_close(moe.tokens_per_expert(idx, 5), counts)
    new = moe.update_expert_bias(torch.zeros(5), counts, 0.01)  # mean 1.2
    torch.testing.assert_close(new, 0.01 * torch.tensor([-1.0, 1.0, 1.0, -1.0, 1.0]))  # over- vs under-loaded
    stacked = moe.update_expert_bias(torch.zeros(2, 2), torch.tensor([[3, 1], [2, 2]]), 1.0)
    torch.testing.assert_close(stacked, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]))


def test_sequence_balance_loss_matches_definition():
    g = torch.Generator().manual_seed(3)
    b, s, e, k = 2, 6, 8, 2
    scores = torch.rand(b * s, e, generator=g)
    idx = scores.topk(k, dim=-1).indices
    want = 0.0
    for seq in range(b):
        rows = range(seq * s, (seq + 1) * s)
        for i in range(e):
            f = e / (k * s) * sum(int(i in idx[t].tolist()) for t in rows)
            p = sum(float(scores[t, i] / scores[t].sum()) for t in rows) / s
            want += f * p / b
    torch.testing.assert_close(moe.sequence_balance_loss(scores, idx, b), torch.tensor(want))
    uniform = torch.ones(4, 4)
    round_robin = torch.tensor([[0], [1], [2], [3]])
    torch.testing.assert_close(moe.sequence_balance_loss(uniform, round_robin, 1), torch.tensor(1.0))


# ----------------------------------------------------------------------------- experts and the layer


def swiglu_ref(x, w1, w2, w3):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def naive_moe_layer(p, x, cfg):
    """Per token: the weighted sum of its experts' SwiGLUs, plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    idx, weights = naive_route(flat, p["router"], p["router_bias"], cfg)
    e = p["experts"]
    rows = []
    for t in range(flat.shape[0]):
        y = sum(weights[t, j] * swiglu_ref(flat[t], e["w1"][idx[t, j]], e["w2"][idx[t, j]], e["w3"][idx[t, j]])
                for j in range(cfg.top_k))
        if "shared" in p:
            y = y + swiglu_ref(flat[t], p["shared"]["w1"], p["shared"]["w2"], p["shared"]["w3"])
        rows.append(y)
    return torch.stack(rows).view(x.shape), torch.bincount(idx.reshape(-1), minlength=cfg.n_experts)


def layer_params(n_experts=8, dim=16, ffn=8, shared=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.3 * torch.randn(*s, generator=g)  # noqa: E731
    p = {"router": r(dim, n_experts), "router_bias": torch.zeros(n_experts),
         "experts": {"w1": r(n_experts, dim, ffn), "w2": r(n_experts, ffn, dim), "w3": r(n_experts, dim, ffn)}}
    if shared:
        p["shared"] = {"w1": r(dim, 2 * ffn), "w2": r(2 * ffn, dim), "w3": r(dim, 2 * ffn)}
    return p


@pytest.mark.parametrize("name", ["softmax", "group_limited"])
@pytest.mark.parametrize("shared", [True, False])
def test_moe_layer_matches_per_token_loop(name, shared):
    cfg = ROUTINGS[name]
    p = layer_params(shared=shared)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4))
    y, aux = moe.moe_layer(p, x, cfg)
    want, counts = naive_moe_layer(p, x, cfg)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux["expert_counts"], counts)
    assert aux["balance_loss"].item() == 0.0


def test_moe_layer_gradients_match_loop_with_empty_experts():
    cfg = route_cfg(score_func="sigmoid", norm_topk_prob=True, aux_loss_alpha=0.1)
    p = layer_params()
    p["router_bias"][[0, 1, 2]] = -10.0  # experts 0-2 receive no tokens
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(5))

    def ours(p, x):
        y, aux = moe.moe_layer(p, x, cfg)
        return y.square().sum() + aux["balance_loss"], aux

    def theirs(p, x):
        r = moe.route(x.reshape(-1, 16), p["router"], p["router_bias"], cfg)
        balance = cfg.aux_loss_alpha * moe.sequence_balance_loss(r.scores, r.indices, 2)
        return naive_moe_layer(p, x, cfg)[0].square().sum() + balance

    (g_p, g_x), aux = torch.func.grad(ours, argnums=(0, 1), has_aux=True)(p, x)
    assert aux["expert_counts"][:3].sum() == 0
    want_p, want_x = torch.func.grad(theirs, argnums=(0, 1))(p, x)
    torch.testing.assert_close(g_x, want_x, rtol=1e-4, atol=1e-5)
    for key in ("router", "router_bias"):
        torch.testing.assert_close(g_p[key], want_p[key], rtol=1e-4, atol=1e-5)
    for key in ("w1", "w2", "w3"):
        torch.testing.assert_close(g_p["experts"][key], want_p["experts"][key], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g_p["shared"][key], want_p["shared"][key], rtol=1e-4, atol=1e-5)
    assert torch.count_nonzero(g_p["router_bias"]) == 0


def test_dispatch_combine_roundtrip_and_expert_compute_seam():
    g = torch.Generator().manual_seed(6)
    x, idx = torch.randn(6, 8, generator=g), torch.tensor([[2, 0], [2, 1], [0, 2], [3, 2], [1, 0], [2, 3]])
    x_sorted, d = moe.dispatch(x, idx, 4)
    experts_of_rows = torch.repeat_interleave(torch.arange(4), d.counts)
    torch.testing.assert_close(idx.reshape(-1)[d.order], experts_of_rows)  # expert-major
    torch.testing.assert_close(x_sorted, x[d.token])
    ones = torch.ones(6, 2)
    torch.testing.assert_close(moe.combine(x_sorted, d, ones), 2 * x)  # identity experts, weight 1, k=2
    w1, w2, w3 = (
        torch.randn(4, 8, 4, generator=g),
        torch.randn(4, 4, 8, generator=g),
        torch.randn(4, 8, 4, generator=g),
    )
    y = moe.expert_compute(x_sorted, d.counts, w1, w2, w3)
    for row in range(12):
        e = int(experts_of_rows[row])
        torch.testing.assert_close(y[row], swiglu_ref(x_sorted[row], w1[e], w2[e], w3[e]), rtol=1e-5, atol=1e-5)


def test_moe_layer_traces_with_fake_tensors_and_no_host_sync():
    cfg = ROUTINGS["group_limited"]
    p, x = layer_params(), torch.randn(2, 4, 16)
    graph = make_fx(torch.func.grad(lambda p, x: moe.moe_layer(p, x, cfg)[0].sum()), tracing_mode="fake")(p, x)
    code = str(graph.graph)
    assert "_local_scalar_dense" not in code and "nonzero" not in code


def test_grouped_mm_copies_a_view_that_starts_off_the_16_byte_grid():
    from shardfn.core.grouped_mm import _aligned

    x = torch.randn(9, 8)
    assert _aligned(x[1:]).data_ptr() == x[1:].data_ptr()        # 8 floats (32 bytes) in: on the grid, as it is
    y = torch.randn(4 * 8 + 1)[1:].view(4, 8)                     # 4 bytes in: off the grid, copied
    assert _aligned(y).storage_offset() == 0 and torch.equal(_aligned(y), y)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_mm_on_cuda_in_bf16_matches_per_expert_matmuls_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([40, 0, 72, 16])                             # an empty expert, uneven groups
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    x = torch.randn(128, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(4, 64, 96, generator=g) * 0.1).to("cuda", torch.bfloat16).requires_grad_()
    dy = torch.randn(128, 96, generator=g).to("cuda", torch.bfloat16)
    y = grouped_mm(x, w, offs)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    want = torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip(starts, ends))])
    want_dx, want_dw = torch.autograd.grad(want, (x, w), dy)
    for a, b in ((y, want), (dx, want_dx), (dw, want_dw)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    odd = torch.randn(128 * 64 + 1, generator=g).to("cuda", torch.bfloat16)[1:].view(128, 64)  # 2 bytes off the grid
    torch.testing.assert_close(grouped_mm(odd, w, offs).float(), grouped_mm(odd.clone(), w, offs).float())
