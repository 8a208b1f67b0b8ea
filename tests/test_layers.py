"""Pure layers against hand-written formulas, and their traces under make_fx / torch.func.grad."""

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core import layers as L
from shardfn.core import rope
from shardfn.core.init import axes_of, count_params, init_params, normal, ones, shapes_of, stacked, zeros


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_linear_embedding_rms_norm_swiglu():
    g = gen()
    x, w, b = torch.randn(2, 3, 4, generator=g), torch.randn(4, 5, generator=g), torch.randn(5, generator=g)
    torch.testing.assert_close(L.linear(x, w, b), torch.einsum("bsi,io->bso", x, w) + b)
    table = torch.randn(10, 4, generator=g)
    torch.testing.assert_close(
        L.embedding(table, torch.tensor([[3, 0], [9, 3]])), torch.stack([table[[3, 0]], table[[9, 3]]])
    )
    scale = torch.randn(4, generator=g)
    rms = torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(L.rms_norm(x, scale, 1e-6), x / rms * scale)
    assert L.rms_norm(x.bfloat16(), scale.bfloat16()).dtype == torch.bfloat16
    p = {
        "w1": torch.randn(4, 6, generator=g),
        "w3": torch.randn(4, 6, generator=g),
        "w2": torch.randn(6, 4, generator=g),
    }
    h = (x @ p["w1"]) * torch.sigmoid(x @ p["w1"]) * (x @ p["w3"])
    torch.testing.assert_close(L.swiglu(p, x), h @ p["w2"])


def test_rope_rotates_half_pairs_by_position():
    seq, dim, theta = 5, 8, 100.0
    cos, sin = L.rope_tables(seq, dim, theta)
    x = torch.randn(1, 2, seq, dim, generator=gen(1))
    y = L.apply_rope(x, cos, sin)
    for pos in range(seq):
        for i in range(dim // 2):  # dims i and i + dim/2 rotate together by pos * theta^(-2i/dim)
            a = pos * theta ** (-2 * i / dim)
            x1, x2 = x[..., pos, i], x[..., pos, i + dim // 2]
            torch.testing.assert_close(y[..., pos, i], x1 * math.cos(a) - x2 * math.sin(a))
            torch.testing.assert_close(y[..., pos, i + dim // 2], x2 * math.cos(a) + x1 * math.sin(a))
    # dot products of rotated vectors depend only on the relative position
    q, k = torch.randn(dim, generator=gen(2)), torch.randn(dim, generator=gen(3))
    cos, sin = L.rope_tables(12, dim, theta)
    rq, rk = L.apply_rope(q.expand(12, dim), cos, sin), L.apply_rope(k.expand(12, dim), cos, sin)
    torch.testing.assert_close(rq[7] @ rk[4], rq[3] @ rk[0])
    with pytest.raises(ValueError, match="even"):
        L.rope_tables(4, 7, theta)


def naive_attention(q, k, v, causal, scale=None):
    h, hkv, s = q.shape[1], k.shape[1], q.shape[2]
    kv_head = torch.arange(h) // (h // hkv)
    scores = q @ k[:, kv_head].transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v[:, kv_head]


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_naive_softmax(n_kv_heads, causal):
    g = gen(4)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, n_kv_heads, 6, 8, generator=g), torch.randn(2, n_kv_heads, 6, 8, generator=g)
    torch.testing.assert_close(L.attention(q, k, v, causal=causal), naive_attention(q, k, v, causal),
                               rtol=1e-5, atol=1e-5)


def test_attention_with_distinct_value_dim_and_scale():
    g = gen(5)
    q, k, v = (
        torch.randn(1, 2, 5, 12, generator=g),
        torch.randn(1, 2, 5, 12, generator=g),
        torch.randn(1, 2, 5, 4, generator=g),
    )
    torch.testing.assert_close(
        L.attention(q, k, v, scale=0.3), naive_attention(q, k, v, True, 0.3), rtol=1e-5, atol=1e-5
    )


def test_gqa_attention_traces_to_fused_kernel_under_grad():
    g = gen(6)
    p = {"wq": torch.randn(16, 16, generator=g), "wk": torch.randn(16, 8, generator=g),
         "wv": torch.randn(16, 8, generator=g), "wo": torch.randn(16, 16, generator=g)}
    x = torch.randn(2, 6, 16, generator=g)

    def loss(p, x):
        cos, sin = L.rope_tables(6, 4, 10000.0)  # built inside, as the models do
        return L.gqa_attention(p, x, cos, sin, head_dim=4).square().sum()

    fn = torch.func.grad(loss)
    graph = make_fx(fn, tracing_mode="fake")(p, x)
    targets = {str(n.target) for n in graph.graph.nodes}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" in targets
    got, want = graph(p, x), fn(p, x)
    for key in p:
        torch.testing.assert_close(got[key], want[key])


def mla_params(q_lora, g, dim=16, heads=2, kv_lora=8, nope=4, rope=4, v=6):
    r = lambda *s: 0.3 * torch.randn(*s, generator=g)  # noqa: E731
    p = {"wkv_a": r(dim, kv_lora + rope), "kv_norm": 1 + r(kv_lora), "wkv_b": r(kv_lora, heads * (nope + v)),
         "wo": r(heads * v, dim)}
    if q_lora:
        p.update(wq_a=r(dim, q_lora), q_norm=1 + r(q_lora), wq_b=r(q_lora, heads * (nope + rope)))
    else:
        p["wq"] = r(dim, heads * (nope + rope))
    return p


def naive_mla(p, x, theta, heads=2, nope=4, rope=4, v=6, eps=1e-6):
    """MLA written head by head, position by position, from the DeepSeek-V2 paper's equations."""
    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w

    def rot(t, pos):  # rotate-half RoPE of one vector [rope]
        half = rope // 2
        a = pos * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rope)
        c, s = a.cos().float(), a.sin().float()
        return torch.cat([t[:half] * c - t[half:] * s, t[half:] * c + t[:half] * s])

    b, seq, _ = x.shape
    q = x @ p["wq"] if "wq" in p else norm(x @ p["wq_a"], p["q_norm"]) @ p["wq_b"]
    kv_a = x @ p["wkv_a"]
    c_kv, k_pe = kv_a[..., :-rope], kv_a[..., -rope:]
    kv = norm(c_kv, p["kv_norm"]) @ p["wkv_b"]
    out = torch.zeros(b, seq, heads * v)
    for bi in range(b):
        for h in range(heads):
            qh = q[bi, :, h * (nope + rope):(h + 1) * (nope + rope)]
            kh = kv[bi, :, h * (nope + v):h * (nope + v) + nope]
            vh = kv[bi, :, h * (nope + v) + nope:(h + 1) * (nope + v)]
            for i in range(seq):
                qi = torch.cat([qh[i, :nope], rot(qh[i, nope:], i)])
                ks = torch.stack([torch.cat([kh[j], rot(k_pe[bi, j], j)]) for j in range(i + 1)])
                att = (ks @ qi / math.sqrt(nope + rope)).softmax(0)
                out[bi, i, h * v:(h + 1) * v] = att @ vh[: i + 1]
    return out @ p["wo"]


@pytest.mark.parametrize("q_lora", [0, 8])
def test_mla_attention_matches_per_head_loop(q_lora):
    g = gen(7)
    p, x = mla_params(q_lora, g), torch.randn(2, 5, 16, generator=g)
    cos, sin = L.rope_tables(5, 4, 50.0)
    y = L.mla_attention(p, x, cos, sin, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
    torch.testing.assert_close(y, naive_mla(p, x, 50.0), rtol=1e-5, atol=1e-5)


def test_gqa_block_matches_reference():
    g = gen(8)
    p = {"wq": torch.randn(16, 16, generator=g), "wk": torch.randn(16, 8, generator=g),
         "wv": torch.randn(16, 8, generator=g), "wo": torch.randn(16, 16, generator=g)}
    x = torch.randn(2, 6, 16, generator=g)
    cos, sin = L.rope_tables(6, 4, 10000.0)
    def split(t, hd=4):
        return t.view(2, 6, -1, hd).transpose(1, 2)

    q, k = L.apply_rope(split(x @ p["wq"]), cos, sin), L.apply_rope(split(x @ p["wk"]), cos, sin)
    want = naive_attention(q, k, split(x @ p["wv"]), True).transpose(1, 2).reshape(2, 6, 16) @ p["wo"]
    torch.testing.assert_close(L.gqa_attention(p, x, cos, sin, head_dim=4), want, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- init


def table():
    layer = {"w": normal((4, 8), ("embed", "mlp"), std=0.5), "norm": ones((4,), ("norm",))}
    return {"embed": normal((16, 4), ("vocab", "embed")), "layers": stacked(3, layer), "bias": zeros((8,), (None,))}


def test_init_table_shapes_axes_counts():
    t = table()
    assert shapes_of(t) == {"embed": (16, 4), "layers": {"w": (3, 4, 8), "norm": (3, 4)}, "bias": (8,)}
    assert axes_of(t)["layers"]["w"] == ("layers", "embed", "mlp")
    assert count_params(t) == 16 * 4 + 3 * 32 + 3 * 4 + 8
    p = init_params(t, seed=0)
    assert torch.equal(p["layers"]["norm"], torch.ones(3, 4)) and torch.equal(p["bias"], torch.zeros(8))
    assert abs(p["layers"]["w"].std().item() - 0.5) < 0.15
    with pytest.raises(ValueError, match="one logical axis per dim"):
        normal((2, 3), ("embed",))


def test_init_is_deterministic_per_seed_and_path():
    a, b, c = init_params(table(), 0), init_params(table(), 0), init_params(table(), 1)
    assert torch.equal(a["embed"], b["embed"]) and not torch.equal(a["embed"], c["embed"])
    other = init_params({"embed": normal((16, 4), ("vocab", "embed"))}, 0)  # other leaves do not matter
    assert torch.equal(a["embed"], other["embed"])
    bf = init_params(table(), 0, dtype=torch.bfloat16)
    assert bf["embed"].dtype == torch.bfloat16 and torch.equal(bf["embed"], a["embed"].bfloat16())
    meta = init_params(table(), 0, device="meta")
    assert meta["embed"].is_meta and meta["embed"].shape == (16, 4)
    with pytest.raises(TypeError, match="seed"):
        init_params(table(), 0.5)


# ----------------------------------------------------------------------------- eager forms


def _grads(f, *xs, cotangent):
    leaves = [x.clone().requires_grad_() for x in xs]
    out = f(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, cotangent))


def test_rope_eager_and_traced_forms_agree_to_the_bit():
    cos, sin = L.rope_tables(16, 8, 10000.0)
    x, dy = torch.randn(2, 3, 16, 8, generator=gen(4)), torch.randn(2, 3, 16, 8, generator=gen(5))
    eager = _grads(lambda x: L.apply_rope(x, cos, sin), x, cotangent=dy)
    traced = make_fx(lambda x, dy: _grads(lambda x: L.apply_rope(x, cos, sin), x, cotangent=dy))(x, dy)
    assert "neg" in str(traced.graph)  # the traced form negates half of x, the eager one half of the table
    assert all(torch.equal(a, b) for a, b in zip(eager, traced(x, dy)))


def test_rope_tables_are_built_once_eagerly_and_afresh_when_traced():
    a, b = L.rope_tables(12, 8, 500.0), L.rope_tables(12, 8, 500.0)
    assert a[0] is b[0] and a[1] is b[1]
    with torch.inference_mode():  # tables first made here are still usable by autograd afterwards
        c = L.rope_tables(13, 8, 500.0)
    assert not c[0].is_inference()
    fresh = rope._rope_tables(12, 8, 500.0, None, None, torch.float32)
    assert torch.equal(a[0], fresh[0]) and torch.equal(a[1], fresh[1])
    graph = make_fx(lambda t: t * L.rope_tables(12, 8, 500.0)[0])(torch.ones(12, 8))
    assert "cos" in str(graph.graph)  # built inside the traced program, not captured as a constant


def test_gqa_attention_eagerly_reads_groups_without_repeating_them():
    g = gen(6)
    q, k, v, dy = (torch.randn(*s, generator=g) for s in ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8), (2, 4, 16, 8)))

    def repeated(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True)

    ours, want = _grads(L.attention, q, k, v, cotangent=dy), _grads(repeated, q, k, v, cotangent=dy)
    torch.testing.assert_close(ours[0], want[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(ours[1:], want[1:]):  # key/value gradients: each group's sum taken in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    traced = make_fx(lambda q, k, v: L.attention(q, k, v))(q, k, v)
    kernel = next(n for n in traced.graph.nodes if "scaled_dot_product" in str(n.target))
    assert kernel.args[1].meta["val"].shape[1] == 4  # traced: repeated heads, as the partitioner shards them



def test_gqa_attention_compiled_reads_groups_without_repeating_them():
    g = gen(7)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8)))
    graphs = []

    def keep_graph(gm, example_inputs):  # a torch.compile backend that runs what dynamo captured
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda q, k, v: L.attention(q, k, v), backend=keep_graph, fullgraph=True)(q, k, v)
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")]
    sdpa = [n for n in graphs[0].graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(sdpa) == 1 and sdpa[0].kwargs.get("enable_gqa") is True
    assert not any("repeat_interleave" in c for c in calls)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)

def _autograd_nodes(fn) -> set[str]:
    """The kinds of node in the backward graph that ends at ``fn``."""
    seen, kinds, todo = set(), set(), [fn]
    while todo:
        f = todo.pop()
        if f is not None and id(f) not in seen:
            seen.add(id(f))
            kinds.add(type(f).__name__)
            todo.extend(g for g, _ in f.next_functions)
    return kinds


def test_unstack_unbinds_eagerly_and_selects_when_traced():
    w = torch.randn(3, 4, 5, generator=gen(7))
    tree = {"w": w, "b": torch.randn(3, 5, generator=gen(8))}

    def loss(tree):
        return sum((p["w"].sum(0) * p["b"] * (i + 1)).sum() for i, p in enumerate(L.unstack(tree, 3)))

    leaves = {k: v.clone().requires_grad_() for k, v in tree.items()}
    value = loss(leaves)
    kinds = _autograd_nodes(value.grad_fn)
    assert "UnbindBackward0" in kinds and "SelectBackward0" not in kinds  # one stacked gradient, no zero-filled ones
    eager = torch.autograd.grad(value, list(leaves.values()))
    via_select = torch.func.grad(loss)(tree)  # inside a transform: w[i]
    assert all(torch.equal(a, via_select[k]) for a, k in zip(eager, leaves))
    graph = make_fx(loss)(tree)
    selects = [n for n in graph.graph.nodes if n.target is torch.ops.aten.select.int]
    assert len(selects) == 6 and all(n.args[0].op == "placeholder" and n.args[1] == 0 for n in selects)
    assert "unbind" not in str(graph.graph)


def test_profiler_labels_only_while_profiling():
    x, w = torch.randn(2, 8), torch.ones(8)
    graph = make_fx(lambda x, w: L.rms_norm(x, w))(x, w)
    assert "record_function" not in str(graph.graph)
    with torch.profiler.profile() as prof:
        L.rms_norm(x, w)
    assert any(e.key == "shardfn.rms_norm" for e in prof.key_averages())
