"""Expert-parallel dispatch/combine on gloo ranks against a naive per-token loop."""

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P
from shardfn.core.transforms import autograd_vjp
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
    outs = spawn(_worker, ep * dp, args=(routing, ep, dp), timeout_s=180)
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
    dropless, roomy = spawn(_shared_capacity_worker, 2, args=(0.0,), timeout_s=120)[0], \
        spawn(_shared_capacity_worker, 2, args=(float(E),), timeout_s=120)[0]
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
    outs = spawn(_shared_capacity_worker, 2, args=(cf,), timeout_s=120)
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
    whole = spawn(_shared_capacity_worker, 2, args=(0.0, 1), timeout_s=120)
    chunked = spawn(_shared_capacity_worker, 2, args=(0.0, 3), timeout_s=120)
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


@torch.library.custom_op("shardfn_test::swiglu_vjp", mutates_args=())
def _swiglu_vjp_in_custom_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                             dy: torch.Tensor) -> list[torch.Tensor]:
    return [g.clone() for g in autograd_vjp(moe_dispatch._swiglu, (x, w1, w2, w3), dy)]


def test_exchange_backward_takes_autograds_own_kernels():
    # the exchange's custom op computes the shared experts' backward (core.transforms.autograd_vjp):
    # bit for bit what plain autograd gives (the step's traced backward, when the shared experts
    # follow the exchange); torch.func.vjp's silu backward rounds differently
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    w1, w3, w2 = torch.randn(D, H, generator=g), torch.randn(D, H, generator=g), torch.randn(H, D, generator=g)
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, w3)]
    want = torch.autograd.grad(moe_dispatch._swiglu(*leaves), leaves, dy)
    got = _swiglu_vjp_in_custom_op(x, w1, w2, w3, dy)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # outputs: a sequence, one cotangent each; an integer output and an unused primal are skipped
    dx, dw = autograd_vjp(lambda x, w: [x.argmax(-1), x @ w1, x.sum()], (x, w2),
                          [None, torch.ones(T, H), torch.tensor(2.0)])
    assert torch.equal(dx, torch.ones(T, H) @ w1.t() + 2) and torch.equal(dw, torch.zeros_like(w2))
