"""Both models against independent plain-torch nn.Module references, plus configs and counts.

The references use nn.Linear / nn.Embedding and their own RMSNorm, RoPE (complex rotation of
the (i, i + D/2) pairs), explicit softmax attention and a per-expert MoE loop; none of shardfn's
layers. Our weights ([in, out], stacked over layers) are loaded into them transposed.
"""

import dataclasses
import math
import resource
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn import models
from shardfn.core import moe as core_moe
from shardfn.core.pytree import axes_leaves, paths, tree_leaves

llama, moe = models.get("llama"), models.get("moe")

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
AXIS_NAMES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "expert", "expert_mlp", "q_lora", "kv_lora",
              "layers", "norm", None}


# ----------------------------------------------------------------------------- reference modules


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, theta):
    """x [B, H, S, D]: (x_i + j x_{i+D/2}) times e^{j pos theta^(-2i/D)}."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angles = (torch.arange(x.shape[2], dtype=torch.float64)[:, None] * freqs).float()
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1)


def causal_softmax_attention(q, k, v, scale):
    scores = torch.einsum("bhsd,bhtd->bhst", q, k) * scale
    s = q.shape[2]
    scores = scores + torch.full((s, s), float("-inf")).triu(1)
    return torch.einsum("bhst,bhtd->bhsd", scores.softmax(-1), v)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GQAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, theta):
        super().__init__()
        self.h, self.hkv, self.hd, self.theta = n_heads, n_kv_heads, dim // n_heads, theta
        self.wq = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, self.hkv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, s, self.hkv, self.hd).transpose(1, 2)
        kv_head = torch.arange(self.h) // (self.h // self.hkv)  # query head -> its kv head
        q, k, v = rope(q, self.theta), rope(k, self.theta)[:, kv_head], v[:, kv_head]
        out = causal_softmax_attention(q, k, v, 1 / math.sqrt(self.hd))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank:
            self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(c.q_lora_rank, 1e-6)  # DeepSeek-V3's latent norms: eps 1e-6 always
            self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(c.dim, c.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.wkv_b = nn.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.wo = nn.Linear(c.n_heads * c.v_head_dim, c.dim, bias=False)

    def forward(self, x):
        c, (b, s, _) = self.c, x.shape
        n, r = c.qk_nope_head_dim, c.qk_rope_head_dim
        q = self.wq_b(self.q_norm(self.wq_a(x))) if c.q_lora_rank else self.wq(x)
        q = q.view(b, s, c.n_heads, n + r).transpose(1, 2)
        latent, k_pe = self.wkv_a(x).split([c.kv_lora_rank, r], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, c.n_heads, n + c.v_head_dim).transpose(1, 2)
        q_pe, k_pe = rope(q[..., n:], c.rope_theta), rope(k_pe[:, None], c.rope_theta)  # [B, H|1, S, r]
        scores = (torch.einsum("bhsd,bhtd->bhst", q[..., :n], kv[..., :n])
                  + torch.einsum("bhsd,bxtd->bhst", q_pe, k_pe)) / math.sqrt(n + r)
        scores = scores + torch.full((s, s), float("-inf")).triu(1)
        out = torch.einsum("bhst,bhtd->bhsd", scores.softmax(-1), kv[..., n:])
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Gate(nn.Module):
    """DeepSeek-V3's gate: scores, bias for selection, group limit, top-k, weights from raw scores."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.weight = nn.Linear(c.dim, c.n_experts, bias=False)
        self.bias = nn.Parameter(torch.zeros(c.n_experts))

    def forward(self, x):
        c = self.c
        logits = self.weight(x)
        scores = logits.softmax(-1) if c.score_func == "softmax" else logits.sigmoid()
        biased = scores + self.bias
        if c.n_groups > 1:
            grouped = biased.view(x.shape[0], c.n_groups, -1)
            best = grouped.topk(2, dim=-1)[0].sum(-1).topk(c.topk_groups, dim=-1)[1]
            drop = torch.ones(x.shape[0], c.n_groups, dtype=torch.bool).scatter(1, best, False)
            biased = grouped.masked_fill(drop[..., None], float("-inf")).flatten(1)
        indices = biased.topk(c.top_k, dim=-1)[1]
        weights = scores.gather(1, indices)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * c.route_scale, indices


class MoEFeedForward(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c, self.gate = c, Gate(c)
        self.experts = nn.ModuleList(FeedForward(c.dim, c.expert_ffn_dim) for _ in range(c.n_experts))
        self.shared = FeedForward(c.dim, c.n_shared_experts * c.expert_ffn_dim) if c.n_shared_experts else None

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(indices == e)
            if len(rows):
                y = y.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)


class Block(nn.Module):
    def __init__(self, attn, ffn, dim, eps):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.ffn = RMSNorm(dim, eps), attn, RMSNorm(dim, eps), ffn

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, blocks, vocab, dim, eps, tied):
        super().__init__()
        self.embed, self.blocks, self.norm = nn.Embedding(vocab, dim), nn.ModuleList(blocks), RMSNorm(dim, eps)
        self.out = None if tied else nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        return h @ self.embed.weight.t() if self.out is None else self.out(h)


def llama_reference(c):
    blocks = [Block(GQAttention(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta), FeedForward(c.dim, c.ffn_dim),
                    c.dim, c.norm_eps) for _ in range(c.n_layers)]
    return Transformer(blocks, c.vocab_size, c.dim, c.norm_eps, c.tie_embeddings)


def moe_reference(c):
    def attn():
        if c.attention == "mla":
            return MLAttention(c)
        return GQAttention(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta)

    blocks = [Block(attn(), FeedForward(c.dim, c.ffn_dim) if i < c.first_k_dense else MoEFeedForward(c), c.dim,
                    c.norm_eps) for i in range(c.n_layers)]
    return Transformer(blocks, c.vocab_size, c.dim, c.norm_eps, c.tie_embeddings)


# ----------------------------------------------------------------------------- weight mapping


def pairs(ref, c, kind):
    """``(our path, layer index or None, expert index or None, ref parameter, transposed)``."""
    out = [("embed", None, None, ref.embed.weight, False), ("norm", None, None, ref.norm.weight, False)]
    if ref.out is not None:
        out.append(("out", None, None, ref.out.weight, True))
    for i, block in enumerate(ref.blocks):
        if kind == "llama":
            stack, li = "layers", i
        else:
            stack, li = ("dense_layers", i) if i < c.first_k_dense else ("moe_layers", i - c.first_k_dense)
        out += [(f"{stack}.attn_norm", li, None, block.attn_norm.weight, False),
                (f"{stack}.mlp_norm", li, None, block.mlp_norm.weight, False)]
        for name, mod in block.attn.named_children():
            w = mod.weight
            out.append((f"{stack}.attn.{name}", li, None, w, w.dim() == 2))
        ffn = block.ffn
        if isinstance(ffn, MoEFeedForward):
            out += [(f"{stack}.router", li, None, ffn.gate.weight.weight, True),
                    (f"{stack}.router_bias", li, None, ffn.gate.bias, False)]
            for e, expert in enumerate(ffn.experts):
                out += [(f"{stack}.experts.{w}", li, e, getattr(expert, w).weight, True) for w in ("w1", "w2", "w3")]
            if ffn.shared is not None:
                out += [
                    (f"{stack}.shared.{w}", li, None, getattr(ffn.shared, w).weight, True) for w in ("w1", "w2", "w3")
                ]
        else:
            out += [(f"{stack}.mlp.{w}", li, None, getattr(ffn, w).weight, True) for w in ("w1", "w2", "w3")]
    return out


def leaf(tree, path, layer, expert):
    for key in path.split("."):
        tree = tree[key]
    if layer is not None:
        tree = tree[layer]
    return tree if expert is None else tree[expert]


def load(ref, params, c, kind):
    """Copy our params into the reference; every one of our elements must be used exactly once."""
    mapping = pairs(ref, c, kind)
    with torch.no_grad():
        for path, li, e, p, transposed in mapping:
            w = leaf(params, path, li, e)
            p.copy_(w.t() if transposed else w)
    assert sum(p.numel() for *_, p, _ in mapping) == sum(x.numel() for x in tree_leaves(params))
    assert sum(p.numel() for p in ref.parameters()) == sum(x.numel() for x in tree_leaves(params))
    return mapping


def batch_of(c, b=2, s=8, seed=0):
    t = torch.randint(0, c.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


# ----------------------------------------------------------------------------- configs under test

LLAMAS = {
    "gqa": llama.Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, init_std=0.2),
    "mha_tied": llama.Config(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32,
                             rope_theta=500000.0, tie_embeddings=True, init_std=0.2),
}
MOES = {
    "mla_sigmoid_groups": moe.Config(vocab_size=64, dim=32, n_layers=3, first_k_dense=1, n_heads=2, q_lora_rank=16,
                                     kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                     ffn_dim=48, n_experts=8, top_k=2, n_shared_experts=1, expert_ffn_dim=16,
                                     score_func="sigmoid", n_groups=4, topk_groups=2, route_scale=2.5,
                                     aux_loss_alpha=0.01, init_std=0.2),
    "mla_direct_q_softmax": moe.Config(vocab_size=64, dim=32, n_layers=2, first_k_dense=0, n_heads=2, q_lora_rank=0,
                                       kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8,
                                       n_experts=4, top_k=1, n_shared_experts=0, expert_ffn_dim=8,
                                       score_func="softmax", norm_topk_prob=False, init_std=0.2),
    "gqa_tied": moe.Config(vocab_size=64, dim=32, n_layers=2, first_k_dense=1, n_heads=4, attention="gqa",
                           n_kv_heads=2, ffn_dim=32, n_experts=8, top_k=3, n_shared_experts=2, expert_ffn_dim=8,
                           tie_embeddings=True, init_std=0.2),
}
CASES = [("llama", k) for k in LLAMAS] + [("moe", k) for k in MOES]


def setup(kind, name):
    module, c = (llama, LLAMAS[name]) if kind == "llama" else (moe, MOES[name])
    ref = llama_reference(c) if kind == "llama" else moe_reference(c)
    params = module.init(c, seed=0)
    if kind == "moe":  # a non-zero selection bias, so the test covers "bias picks, scores weigh"
        params["moe_layers"]["router_bias"] = 0.05 * torch.randn(params["moe_layers"]["router_bias"].shape)
    return module, c, ref, params, load(ref, params, c, kind)


@pytest.mark.parametrize("kind,name", CASES)
def test_logits_match_reference(kind, name):
    module, c, ref, params, _ = setup(kind, name)
    tokens = batch_of(c)["inputs"]
    logits = module.apply(params, tokens, c)
    assert logits.shape == (2, 8, c.vocab_size) and logits.std() > 0.1
    torch.testing.assert_close(logits, ref(tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind,name", CASES)
def test_gradients_match_reference_autograd(kind, name):
    module, c, ref, params, mapping = setup(kind, name)
    batch = batch_of(c, seed=1)
    grads = torch.func.grad(module.loss)(params, batch, c)
    ref_loss = F.cross_entropy(ref(batch["inputs"]).reshape(-1, c.vocab_size), batch["targets"].reshape(-1))
    if kind == "moe" and c.aux_loss_alpha:
        ref_loss = ref_loss + reference_balance_loss(ref, batch["inputs"], c)
    ref_loss.backward()
    torch.testing.assert_close(module.loss(params, batch, c), ref_loss.detach(), rtol=0, atol=1e-5)
    for path, li, e, p, transposed in mapping:
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        got = leaf(grads, path, li, e)
        torch.testing.assert_close(
            got, want.t() if transposed else want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{path}: {m}"
        )
    if kind == "moe":
        assert torch.count_nonzero(grads["moe_layers"]["router_bias"]) == 0


def reference_balance_loss(ref, tokens, c):
    """The balance loss recomputed from the reference's own MoE inputs (captured by hooks)."""
    inputs = []
    hooks = [b.ffn.register_forward_hook(lambda m, a, out: inputs.append(a[0])) for b in ref.blocks
             if isinstance(b.ffn, MoEFeedForward)]
    ref(tokens)
    for h in hooks:
        h.remove()
    total = 0.0
    moe_blocks = [b.ffn for b in ref.blocks if isinstance(b.ffn, MoEFeedForward)]
    for ffn, x in zip(moe_blocks, inputs):
        b, s, _ = x.shape
        logits = ffn.gate.weight(x.reshape(b * s, -1))
        scores = logits.softmax(-1) if c.score_func == "softmax" else logits.sigmoid()
        _, idx = ffn.gate(x.reshape(b * s, -1))
        norm = (scores / scores.sum(-1, keepdim=True)).view(b, s, -1).mean(1)            # P_i per sequence
        hits = F.one_hot(idx.view(b, -1), c.n_experts).sum(1).float() * c.n_experts / (c.top_k * s)  # f_i
        total = total + c.aux_loss_alpha * (hits * norm).sum(-1).mean()
    return total


def test_cross_entropy_is_torch_mean_to_the_bit_and_refuses_negative_targets():
    """The mean over every position (sum / number of positions: no count of kept targets for a
    mesh to all-reduce) gives F.cross_entropy's value and gradient bit for bit; a target torch
    would ignore (-100) is an error, not a position silently left out of the mean."""
    torch.manual_seed(0)
    for shape in [(4, 64, 256), (3, 7, 11)]:
        logits = torch.randn(*shape, requires_grad=True)
        targets = torch.randint(0, shape[-1], shape[:2])
        ours = llama.cross_entropy(logits, targets)
        theirs = F.cross_entropy(logits.reshape(-1, shape[-1]), targets.reshape(-1))
        assert torch.equal(ours, theirs)
        assert torch.equal(*(torch.autograd.grad(x, logits)[0] for x in (ours, theirs)))
    targets[0, 0] = -100
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        llama.cross_entropy(logits, targets)


def test_moe_aux_counts_every_routed_token():
    c = MOES["mla_sigmoid_groups"]
    params, batch = moe.init(c, 0), batch_of(c)
    value, aux = moe.loss_and_aux(params, batch, c)
    assert aux["expert_counts"].shape == (c.n_moe_layers, c.n_experts)
    assert (aux["expert_counts"].sum(-1) == 2 * 8 * c.top_k).all()
    assert aux["balance_loss"] > 0
    torch.testing.assert_close(value, aux["ce_loss"] + aux["balance_loss"])
    biased = core_moe.update_expert_bias(params["moe_layers"]["router_bias"], aux["expert_counts"], c.bias_update_rate)
    assert biased.shape == params["moe_layers"]["router_bias"].shape


ONE_LAYER = {
    "llama": dataclasses.replace(LLAMAS["gqa"], n_layers=1),
    "moe": dataclasses.replace(MOES["mla_sigmoid_groups"], n_layers=1, first_k_dense=0),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_compiled_logits_match_eager(kind):
    module, c = (llama if kind == "llama" else moe), ONE_LAYER[kind]
    params, tokens = module.init(c, seed=0), batch_of(c, s=4)["inputs"]
    compiled = torch.compile(lambda p, t: module.apply(p, t, c))
    torch.testing.assert_close(compiled(params, tokens), module.apply(params, tokens, c), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_moe_gradient_matches_eager():
    c = ONE_LAYER["moe"]
    params, batch = moe.init(c, seed=0), batch_of(c, s=4)
    # aot_eager: Dynamo + AOTAutograd over torch.func.grad (the custom op included), no codegen.
    compiled = torch.compile(torch.func.grad_and_value(lambda p, b: moe.loss(p, b, c)), backend="aot_eager")
    grads, value = compiled(params, batch)
    want_grads, want = torch.func.grad_and_value(moe.loss)(params, batch, c)
    torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(tree_leaves(grads), tree_leaves(want_grads)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,name", [("llama", "gqa"), ("moe", "mla_sigmoid_groups"), ("moe", "gqa_tied")])
def test_loss_gradient_traces_with_fake_tensors_and_no_host_sync(kind, name):
    module, c = (llama, LLAMAS[name]) if kind == "llama" else (moe, MOES[name])
    params, batch = module.init(c, seed=0), batch_of(c)
    fn = torch.func.grad_and_value(lambda p, b: module.loss(p, b, c))
    graph = make_fx(fn, tracing_mode="fake")(params, batch)
    assert "_local_scalar_dense" not in str(graph.graph)
    (grads, value), (want_grads, want) = graph(params, batch), fn(params, batch)
    torch.testing.assert_close(value, want)
    for a, b in zip(tree_leaves(grads), tree_leaves(want_grads), strict=True):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("kind,name", CASES)
def test_param_axes_mirror_params(kind, name):
    module, c = (llama, LLAMAS[name]) if kind == "llama" else (moe, MOES[name])
    params, axes = module.init(c, seed=0, device="meta"), module.param_axes(c)
    assert paths(params) == paths(axes, is_leaf=lambda x: isinstance(x, tuple))
    for x, names in zip(tree_leaves(params), axes_leaves(axes)):
        assert len(names) == x.dim() and set(names) <= AXIS_NAMES
    stacks = [k for k in params if k.endswith("layers")]
    assert all(a[0] == "layers" for k in stacks for a in axes_leaves(axes[k]))
    counts = module.param_counts(c)
    assert counts["total"] == sum(x.numel() for x in tree_leaves(params))


def test_param_trees():
    assert paths(llama.init(llama.Config(), 0, device="meta")) == [
        "embed", "layers.attn.wk", "layers.attn.wo", "layers.attn.wq", "layers.attn.wv", "layers.attn_norm",
        "layers.mlp.w1", "layers.mlp.w2", "layers.mlp.w3", "layers.mlp_norm", "norm", "out"]
    p = moe.init(moe.Config(), 0, device="meta")
    assert "moe_layers.router_bias" in paths(p) and p["moe_layers"]["experts"]["w1"].shape == (2, 8, 64, 32)
    assert p["dense_layers"]["attn"]["wq_a"].shape == (1, 64, 32)


def test_init_is_deterministic():
    a, b, c = llama.init(llama.Config(), 3), llama.init(llama.Config(), 3), llama.init(llama.Config(), 4)
    assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b)))
    assert not torch.equal(a["embed"], c["embed"])
    bf = moe.init(moe.Config(), 0, dtype=torch.bfloat16)
    assert all(x.dtype == torch.bfloat16 for x in tree_leaves(bf))
    assert torch.count_nonzero(bf["moe_layers"]["router_bias"]) == 0 and bool((bf["norm"] == 1).all())


# ----------------------------------------------------------------------------- configs and counts


def config_file(name):
    model = dict(yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["model"])
    module = models.get(model.pop("name"))
    return module, module.Config.from_dict(model)


def mla_attention_params(d, heads, q_lora, kv_lora, nope, rope, v):
    return d * q_lora + q_lora + q_lora * heads * (nope + rope) + d * (kv_lora + rope) + kv_lora \
        + kv_lora * heads * (nope + v) + heads * v * d


# Expected counts written out from the published architecture tables (no shardfn code).
_DSV3_ATTN = mla_attention_params(7168, 128, 1536, 512, 128, 64, 128)
_K2_ATTN = mla_attention_params(7168, 64, 1536, 512, 128, 64, 128)
_EXPERT = 3 * 7168 * 2048
BIG = {
    "llama3_8b": (8_030_261_248, 8_030_261_248),
    "deepseek_v3_671b": (
        2 * 129280 * 7168 + 7168 + 3 * (_DSV3_ATTN + 3 * 7168 * 18432 + 2 * 7168)
        + 58 * (_DSV3_ATTN + 257 * _EXPERT + 7168 * 256 + 256 + 2 * 7168),
        2 * 129280 * 7168 + 7168 + 3 * (_DSV3_ATTN + 3 * 7168 * 18432 + 2 * 7168)
        + 58 * (_DSV3_ATTN + 9 * _EXPERT + 7168 * 256 + 256 + 2 * 7168)),
    "kimi_k2_1t": (
        2 * 163840 * 7168 + 7168 + (_K2_ATTN + 3 * 7168 * 18432 + 2 * 7168)
        + 60 * (_K2_ATTN + 385 * _EXPERT + 7168 * 384 + 384 + 2 * 7168),
        2 * 163840 * 7168 + 7168 + (_K2_ATTN + 3 * 7168 * 18432 + 2 * 7168)
        + 60 * (_K2_ATTN + 9 * _EXPERT + 7168 * 384 + 384 + 2 * 7168)),
}
HEADLINE = {"llama3_8b": (8.03e9, 8.03e9), "deepseek_v3_671b": (671e9, 37e9), "kimi_k2_1t": (1.03e12, 32e9)}
"""Published totals (DeepSeek-V3 without its MTP module); active counts are rounded to 1e9 there."""


@pytest.mark.parametrize("name", list(BIG))
def test_param_counts_of_published_models(name):
    module, c = config_file(name)
    counts = module.param_counts(c)
    assert (counts["total"], counts["active"]) == BIG[name]
    total, active = HEADLINE[name]
    assert counts["total"] == pytest.approx(total, rel=0.01)
    assert counts["active"] == pytest.approx(active, rel=0.03)


def test_meta_init_of_a_trillion_parameters_allocates_nothing():
    module, c = config_file("kimi_k2_1t")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    params = module.init(c, seed=0, device="meta", dtype=torch.bfloat16)
    assert all(x.is_meta for x in tree_leaves(params))
    assert sum(x.numel() for x in tree_leaves(params)) == module.param_counts(c)["total"] > 1e12
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024
    assert len(tree_leaves(params)) < 40  # stacked: one tree, not 61 copies


@pytest.mark.parametrize("name", ["llama_tiny", "moe_tiny", "llama3_8b", "llama3_1_8b", "deepseek_v3_671b",
                                  "kimi_k2_1t"])
def test_config_files_build(name):
    module, c = config_file(name)
    assert module.param_counts(c)["total"] > 0
    if name.endswith("tiny"):
        params = module.init(c, seed=0)
        assert module.loss(params, batch_of(c), c).item() == pytest.approx(math.log(c.vocab_size), rel=0.05)


BAD = [
    (llama, {"n_kv_heads": 3}, "model.n_kv_heads"),
    (llama, {"n_heads": 5}, "model.n_heads"),
    (llama, {"n_heads": 64, "dim": 64}, "model.n_heads"),        # head dim 1: odd, no RoPE
    (llama, {"dim": "64"}, "model.dim must be int"),
    (llama, {"tie_embeddings": 1}, "model.tie_embeddings must be bool"),
    (llama, {"n_layer": 2}, "unknown config key 'model.n_layer'"),
    (llama, {"vocab_size": 0}, "model.vocab_size"),
    (moe, {"top_k": 9}, "model.top_k"),
    (moe, {"n_groups": 3}, "model.n_groups"),
    (moe, {"n_groups": 2, "topk_groups": 3}, "model.topk_groups"),
    (moe, {"n_groups": 8}, "model.n_groups"),                    # one expert per group
    (moe, {"n_groups": 4, "topk_groups": 1, "top_k": 3}, "model.top_k"),
    (moe, {"expert_ffn_dim": 30}, "model.expert_ffn_dim .* multiple of 8"),
    (moe, {"dim": 60, "n_heads": 4}, "model.dim .* multiple of 8"),
    (moe, {"first_k_dense": 3}, "model.first_k_dense"),
    (moe, {"attention": "mqa"}, "model.attention"),
    (moe, {"attention": "gqa", "n_kv_heads": 3}, "model.n_kv_heads"),
    (moe, {"score_func": "relu"}, "model.score_func"),
    (moe, {"qk_rope_head_dim": 5}, "model.qk_rope_head_dim"),
    (moe, {"experts": 8}, "unknown config key 'model.experts'; valid keys: name, vocab_size"),
]


@pytest.mark.parametrize("module,overrides,message", BAD, ids=[f"{m.__name__.split('.')[-1]}-{k}" for m, o, k in BAD])
def test_bad_configs_name_the_key(module, overrides, message):
    with pytest.raises(ValueError, match=message):
        module.Config.from_dict(overrides)


def test_registry():
    import shardfn.models.llama as llama_module
    assert models.get("llama").module is llama_module and models.get("moe").module is moe.module
    assert models.get(llama_module).module is llama_module and models.get(moe) is moe
    with pytest.raises(ValueError, match="unknown model 'gpt'; valid models: llama, moe"):
        models.get("gpt")
