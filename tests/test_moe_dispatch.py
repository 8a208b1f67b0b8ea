"""Expert-parallel dispatch/combine on gloo ranks against a naive per-token loop."""

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P
from shardfn.core import expert_ffn
from shardfn.core.expert_ffn import SWIGLU, ClampedSwiGLU, ffn_from
from shardfn.runtime import moe_dispatch
from shardfn.runtime.launch import spawn

E, D, H, K, T = 8, 16, 32, 2, 24  # experts, hidden, expert FFN, top-k, tokens (global)


def naive_moe(x, idx, weights, w1, w2, w3):
    """Per token, per chosen expert: SwiGLU, weighted, summed."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = F.silu(x[t] @ w1[e]) * (x[t] @ w3[e])
            out[t] = out[t] + weights[t, j] * (h @ w2[e])
    return out


def make_inputs(routing: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    w_router = torch.randn(D, E, generator=g)
    experts = [
        torch.randn(E, D, H, generator=g) * 0.2,
        torch.randn(E, H, D, generator=g) * 0.2,
        torch.randn(E, D, H, generator=g) * 0.2,
    ]
    return x, w_router, experts


def route(x, w_router, routing):
    scores = torch.softmax(x @ w_router, dim=-1)
    if routing == "one_expert":      # every token picks experts 0 and 1
        scores = scores + torch.tensor([10.0, 5.0] + [0.0] * (E - 2))
    elif routing == "skip_expert":   # expert 7 never chosen
        scores = scores - torch.tensor([0.0] * (E - 1) + [10.0])
    weights, idx = torch.topk(scores, K, dim=-1)
    return idx, weights


ROUTING = ["random"]  # the routing case of this process (workers set it before tracing)


def route_static(x, w_router):
    return route(x, w_router, ROUTING[0])


def _worker(routing, ep, dp):
    ROUTING[0] = routing
    axes = {"dp": dp, "ep": ep}
    mesh = sf.Mesh(axes)
    x, w_router, experts = make_inputs(routing)
    data_axes = tuple(a for a in ("dp", "ep") if axes[a] > 1)
    routed = moe_dispatch.ExpertRegion(mesh, data_axes, "ep", E)

    def loss(params, x):
        idx, weights = route_static(x, params["router"])
        return routed(x, idx, weights, params["w1"], params["w2"], params["w3"]).pow(2).mean()

    def step(params, x):
        value, g = torch.func.grad_and_value(loss)(params, x)[::-1]
        return value, g

    params = {"router": w_router, "w1": experts[0], "w2": experts[1], "w3": experts[2]}
    tok = P(data_axes) if len(data_axes) > 1 else P(data_axes[0])
    specs = {"router": P(), "w1": P("ep"), "w2": P("ep"), "w3": P("ep")}
    jitted = sf.jit(step, mesh, in_specs=(specs, tok), out_specs=(P(), specs), backend=None)
    value, g = jitted(params, x)
    stats = list(routed.exchange.stats)
    jitted(params, x)  # each call records its own exchanges: none pile up, layers keep their numbers
    return {"loss": value.full_tensor(), "grads": {k: v.full_tensor() for k, v in g.items()},
            "stats": stats, "again": list(routed.exchange.stats), "comm": jitted.lower(params, x).comm_report()}


def reference(routing):
    ROUTING[0] = routing
    x, w_router, experts = make_inputs(routing)
    params = {"router": w_router, "w1": experts[0], "w2": experts[1], "w3": experts[2]}

    def loss(params, x):
        idx, weights = route_static(x, params["router"])
        return naive_moe(x, idx, weights, params["w1"], params["w2"], params["w3"]).pow(2).mean()

    grads, value = torch.func.grad_and_value(loss)(params, x)
    idx, _ = route_static(x, w_router)
    return value, grads, idx


def expected_bytes(idx, ep, dp, rank):
    """Bytes rank `rank` sends in the dispatch (its assignments to experts held by the other
    ranks of its EP group) and in the combine (results for the assignments they sent it)."""
    n_tok = T // (ep * dp)
    group = [rank - rank % ep + r for r in range(ep)]
    owner = lambda r: idx[r * n_tok:(r + 1) * n_tok].reshape(-1) // (E // ep)  # noqa: E731
    me = rank % ep
    sent = int((owner(rank) != me).sum())
    received = sum(int((owner(r) == me).sum()) for r in group if r != rank)
    return sent * D * 4, received * D * 4


@pytest.mark.parametrize("routing,ep,dp",
                         [("random", 2, 1), ("one_expert", 2, 1), ("skip_expert", 4, 1), ("random", 2, 2)])
def test_expert_parallel_matches_naive_loop(routing, ep, dp):
    ref_loss, ref_grads, idx = reference(routing)
    outs = spawn(_worker, ep * dp, args=(routing, ep, dp), timeout_s=600)
    for rank, out in enumerate(outs):
        assert out["again"] == out["stats"]
        torch.testing.assert_close(out["loss"], ref_loss, rtol=1e-5, atol=1e-6)
        for k in ref_grads:
            torch.testing.assert_close(out["grads"][k], ref_grads[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
        sent, returned = expected_bytes(idx, ep, dp, rank)
        phases = {s["phase"]: s["bytes"] for s in out["stats"]}
        assert phases["dispatch"] == sent and phases["dispatch_grad"] == sent
        assert phases["combine"] == returned and phases["combine_grad"] == returned
        assert len(out["stats"]) == 4  # dispatch + combine forward, and both again backward
        a2a = [r for r in out["comm"] if r["op"] == "all_to_all"]
        assert a2a == [{"op": "all_to_all", "axis": "ep", "layer": 0, "bytes": 2 * (sent + returned), "count": 4}]


def _shared_capacity_worker(capacity_factor, chunks=1):
    ROUTING[0] = "random"
    mesh = sf.Mesh({"ep": 2})
    x, w_router, experts = make_inputs("random")
    g = torch.Generator().manual_seed(5)
    shared = [
        torch.randn(D, H, generator=g) * 0.2,
        torch.randn(H, D, generator=g) * 0.2,
        torch.randn(D, H, generator=g) * 0.2,
    ]
    routed = moe_dispatch.ExpertRegion(mesh, ("ep",), "ep", E, capacity_factor=capacity_factor, shared=True,
                                       chunks=chunks)

    def loss(params, x):
        idx, weights = route_static(x, params["router"])
        y = routed(x, idx, weights, params["w1"], params["w2"], params["w3"], params["s1"], params["s2"], params["s3"])
        return y.pow(2).mean()

    params = {"router": w_router, "w1": experts[0], "w2": experts[1], "w3": experts[2],
              "s1": shared[0], "s2": shared[1], "s3": shared[2]}
    specs = {"router": P(), "w1": P("ep"), "w2": P("ep"), "w3": P("ep"), "s1": P(), "s2": P(), "s3": P()}
    step = sf.jit(lambda p, x: torch.func.grad_and_value(loss)(p, x)[::-1], mesh,
                  in_specs=(specs, P("ep")), out_specs=(P(), specs), backend=None)
    value, grads = step(params, x)
    return {"loss": value.full_tensor(), "grads": {k: v.full_tensor() for k, v in grads.items()},
            "stats": list(routed.exchange.stats), "params": params}


def _shared_reference(params, x, keep=None):
    def loss(p, x):
        idx, weights = route_static(x, p["router"])
        if keep is not None:
            weights = weights * keep
        y = naive_moe(x, idx, weights, p["w1"], p["w2"], p["w3"])
        y = y + (F.silu(x @ p["s1"]) * (x @ p["s3"])) @ p["s2"]
        return y.pow(2).mean()

    grads, value = torch.func.grad_and_value(loss)(params, x)
    return value, grads


def test_shared_experts_overlap_and_large_capacity_equal_dropless():
    x, _, _ = make_inputs("random")
    dropless, roomy = spawn(_shared_capacity_worker, 2, args=(0.0,), timeout_s=600)[0], \
        spawn(_shared_capacity_worker, 2, args=(float(E),), timeout_s=600)[0]
    ref_loss, ref_grads = _shared_reference(dropless["params"], x)
    for out in (dropless, roomy):
        torch.testing.assert_close(out["loss"], ref_loss, rtol=1e-5, atol=1e-6)
        for k in ref_grads:
            torch.testing.assert_close(out["grads"][k], ref_grads[k], rtol=1e-5, atol=1e-6)
    assert roomy["stats"][0]["dropped"] == 0


def _direct_drop_count(idx_local, capacity):
    seen = {}
    dropped = 0
    for e in idx_local.reshape(-1).tolist():  # assignments in (token, slot) order
        seen[e] = seen.get(e, 0) + 1
        dropped += seen[e] > capacity
    return dropped


def test_capacity_drop_rate_equals_direct_count():
    cf = 0.5
    x, w_router, _ = make_inputs("random")
    idx, _ = route_static(x, w_router)
    outs = spawn(_shared_capacity_worker, 2, args=(cf,), timeout_s=600)
    n_tok = T // 2
    cap = max(1, int(cf * n_tok * K / E + 0.999999))
    for rank, out in enumerate(outs):
        expected = _direct_drop_count(idx[rank * n_tok:(rank + 1) * n_tok], cap)
        assert expected > 0
        row = out["stats"][0]
        assert row["dropped"] == expected and row["assignments"] == n_tok * K


def test_chunked_exchange_matches_the_reference_and_moves_the_same_bytes():
    """``chunks=3`` (12 tokens per rank: 4 each): every chunk's dispatch is issued before any
    expert runs, each combine after its chunk's experts; the loss and gradients are the
    reference's, and each phase moves the unchunked exchange's bytes in three parts."""
    x, _, _ = make_inputs("random")
    whole = spawn(_shared_capacity_worker, 2, args=(0.0, 1), timeout_s=600)
    chunked = spawn(_shared_capacity_worker, 2, args=(0.0, 3), timeout_s=600)
    ref_loss, ref_grads = _shared_reference(chunked[0]["params"], x)
    torch.testing.assert_close(chunked[0]["loss"], ref_loss, rtol=1e-5, atol=1e-6)
    for k in ref_grads:
        torch.testing.assert_close(chunked[0]["grads"][k], ref_grads[k], rtol=1e-5, atol=1e-6)
    for one, three in zip(whole, chunked):
        phases = [r["phase"] for r in three["stats"]]
        assert phases == ["dispatch"] * 3 + ["combine"] * 3 + ["dispatch_grad"] * 3 + ["combine_grad"] * 3
        for phase in ("dispatch", "combine", "dispatch_grad", "combine_grad"):
            assert sum(r["bytes"] for r in three["stats"] if r["phase"] == phase) == \
                sum(r["bytes"] for r in one["stats"] if r["phase"] == phase)
        assert [r["assignments"] for r in three["stats"][:3]] == [4 * K] * 3


@torch.library.custom_op("shardfn_test::swiglu_backward", mutates_args=())
def _swiglu_backward_in_custom_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                                  dy: torch.Tensor) -> list[torch.Tensor]:
    _, a1, a3 = moe_dispatch._swiglu(x, w1, w2, w3)
    return [g.clone() for g in moe_dispatch._swiglu_backward(dy, x, a1, a3, w1, w2, w3)]


def _shared_swiglu(x, w1, w2, w3):
    return moe_dispatch._swiglu(x, w1, w2, w3)[0]


def test_exchange_backward_is_autograds_own_from_what_the_forward_kept():
    # the exchange's custom op computes the shared experts' backward from the pre-activations its
    # forward kept: bit for bit what plain autograd gives (the step's traced backward, when the
    # shared experts follow the exchange), with no matmul of the forward again
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    w1, w3, w2 = torch.randn(D, H, generator=g), torch.randn(D, H, generator=g), torch.randn(H, D, generator=g)
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, w3)]
    want = torch.autograd.grad(_shared_swiglu(*leaves), leaves, dy)
    got = _swiglu_backward_in_custom_op(x, w1, w2, w3, dy)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _, a1, a3 = moe_dispatch._swiglu(x, w1, w2, w3)
        moe_dispatch._swiglu_backward(dy, x, a1, a3, w1, w2, w3)
    assert counter.get_flop_counts()["Global"][torch.ops.aten.mm] == 3 * 2 * T * D * H * 3  # 3 forward, 6 backward


def test_routed_experts_backward_is_autograds_from_what_the_forward_kept():
    # the local experts' backward (grouped GEMMs) from xs and the two pre-activations: autograd's
    # gradients through core.grouped_mm, bit for bit, with none of the forward's grouped GEMMs again
    from shardfn.core.grouped_mm import grouped_mm

    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 9, 10])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs, d_out = torch.randn(24, D, generator=g), torch.randn(24, D, generator=g)
    w1, w3, w2 = (torch.randn(4, D, H, generator=g), torch.randn(4, D, H, generator=g),
                  torch.randn(4, H, D, generator=g))
    leaves = [t.detach().requires_grad_() for t in (xs, w1, w2, w3)]
    a, b, c = leaves[1:]
    out = grouped_mm(F.silu(grouped_mm(leaves[0], a, offs)) * grouped_mm(leaves[0], c, offs), b, offs)
    want = torch.autograd.grad(out, leaves, d_out)
    y, kept = SWIGLU.forward(xs, offs, w1, w2, w3)
    assert torch.equal(y, out.detach())
    calls = []
    real = expert_ffn.grouped_mm_now
    expert_ffn.grouped_mm_now = lambda *args: calls.append(1) or real(*args)
    try:
        got = SWIGLU.backward(d_out, xs, kept, offs, w1, w2, w3)
    finally:
        expert_ffn.grouped_mm_now = real
    assert len(calls) == 6  # two per forward GEMM, as autograd's; the forward's three not again
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_gpt_oss_experts_backward_is_autograds_from_what_the_forward_kept():
    # gpt-oss's experts (biases, clamped SwiGLU of interleaved gate/up): the eager pair the exchange
    # runs gives the one-device form's output and autograd's gradients, from the kept h alone
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 9, 10])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs, d_out = torch.randn(24, D, generator=g), torch.randn(24, D, generator=g)
    ws = (torch.randn(4, D, 2 * H, generator=g), torch.randn(4, 2 * H, generator=g), torch.randn(4, H, D, generator=g),
          torch.randn(4, D, generator=g))
    ffn = ClampedSwiGLU(limit=1.5, alpha=1.702)  # a small limit, so both clamps bite on these values
    leaves = [t.detach().requires_grad_() for t in (xs, *ws)]
    out = ffn(*leaves[:1], offs, *leaves[1:])
    want = torch.autograd.grad(out, leaves, d_out)
    y, kept = ffn.forward(xs, offs, *ws)
    assert torch.equal(y, out.detach())
    calls = []
    real = expert_ffn.grouped_mm_now
    expert_ffn.grouped_mm_now = lambda *args: calls.append(1) or real(*args)
    try:
        got = ffn.backward(d_out, xs, kept, offs, *ws)
    finally:
        expert_ffn.grouped_mm_now = real
    assert len(calls) == 4  # two per forward GEMM; the forward's two not again
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in (xs, *ws)]
    assert ffn_from(ffn.name, ffn.args()) == ffn


def test_what_the_exchange_keeps_for_its_backward_is_in_memory_report(clean_process_group, monkeypatch):
    # the ep2 program's forward hands each MoE layer's handle to its backward as a stand-in of
    # the bytes the exchange keeps (expert inputs, pre-activations, outputs, shared experts')
    from shardfn.config import load_config
    from shardfn.plan.profile import lower_step

    def lowered():
        return lower_step(load_config("moe_tiny", ["train.batch_size=8", "train.seq_len=32", "mesh.ep=2"]))

    low = lowered()
    forward = [n for n in low.graph_module.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.shardfn.ep_experts.default]
    assert len(forward) == 2  # moe_tiny's two MoE layers
    x, idx, _, (w1, *_), (s1, *_) = (torch.fx.node.map_arg(a, lambda n: n.meta["val"]) for a in forward[0].args[:5])
    assert tuple(x.shape) == (128, 64) and tuple(w1.shape) == (4, 64, 32) and tuple(s1.shape) == (64, 32)
    kept = moe_dispatch.kept_bytes(x, idx, w1, s1)
    assert kept == 128 * 2 * (2 * 64 + 2 * 32) * 4 + 128 * 2 * 3 * 8 + 128 * (64 + 2 * 32) * 4
    handle = next(u for u in forward[0].users if u.args[1] == 1).meta["val"]
    assert handle.numel() * 8 == kept and handle.stride() == (0,)
    with_kept = low.memory_report()["activations"]
    monkeypatch.setattr(moe_dispatch, "kept_bytes", lambda *a: 8)
    assert with_kept - lowered().memory_report()["activations"] >= 2 * (kept - 8)
