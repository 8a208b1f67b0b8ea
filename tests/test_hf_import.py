"""Hugging Face safetensors import (models/hf/): against hand-named tensors and HF-convention forwards."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from shardfn import models
from shardfn.config import load_config
from shardfn.core.pytree import flatten_with_paths
from shardfn.models import hf
from shardfn.runtime import data
from shardfn.runtime.train import train

LLAMA = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48}
MOE = {"vocab_size": 64, "dim": 32, "n_layers": 3, "first_k_dense": 1, "n_heads": 2, "q_lora_rank": 16,
       "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "ffn_dim": 48,
       "n_experts": 4, "top_k": 2, "n_shared_experts": 1, "expert_ffn_dim": 16, "route_scale": 2.5}


def _cfg(name, **over):
    return models.get(name).Config.from_dict({**(LLAMA if name == "llama" else MOE), **over})


def _rand(g, *shape, scale=0.2):
    return torch.randn(*shape, generator=g) * scale


def _tokens(vocab=64):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


# ----------------------------------------------------------------------------- hand-named HF tensors


def llama_hf_tensors(cfg, seed=0):
    """A Llama checkpoint as HF names it, written out by hand (not through models/hf/)."""
    g = torch.Generator().manual_seed(seed)
    D, H, Hkv, F_, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size
    hd = D // H
    sd = {"model.embed_tokens.weight": _rand(g, V, D, scale=1.0), "model.norm.weight": 1 + _rand(g, D),
          "lm_head.weight": _rand(g, V, D)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": 1 + _rand(g, D), p + "post_attention_layernorm.weight": 1 + _rand(g, D),
            p + "self_attn.q_proj.weight": _rand(g, H * hd, D), p + "self_attn.k_proj.weight": _rand(g, Hkv * hd, D),
            p + "self_attn.v_proj.weight": _rand(g, Hkv * hd, D), p + "self_attn.o_proj.weight": _rand(g, D, H * hd),
            p + "mlp.gate_proj.weight": _rand(g, F_, D), p + "mlp.up_proj.weight": _rand(g, F_, D),
            p + "mlp.down_proj.weight": _rand(g, D, F_),
        })
    return sd


def deepseek_hf_tensors(cfg, seed=0):
    """A DeepSeek-V3-style checkpoint as HF names it (MLA, sigmoid router with bias, shared expert)."""
    g = torch.Generator().manual_seed(seed)
    D, H, V, E = cfg.dim, cfg.n_heads, cfg.vocab_size, cfg.n_experts
    n, r, v, kv, qr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    sd = {"model.embed_tokens.weight": _rand(g, V, D, scale=1.0), "model.norm.weight": 1 + _rand(g, D),
          "lm_head.weight": _rand(g, V, D)}
    for i in range(cfg.n_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        sd[f"model.layers.{i}.input_layernorm.weight"] = 1 + _rand(g, D)
        sd[f"model.layers.{i}.post_attention_layernorm.weight"] = 1 + _rand(g, D)
        if qr:
            sd.update({a + "q_a_proj.weight": _rand(g, qr, D), a + "q_a_layernorm.weight": 1 + _rand(g, qr),
                       a + "q_b_proj.weight": _rand(g, H * (n + r), qr)})
        else:
            sd[a + "q_proj.weight"] = _rand(g, H * (n + r), D)
        sd.update({a + "kv_a_proj_with_mqa.weight": _rand(g, kv + r, D), a + "kv_a_layernorm.weight": 1 + _rand(g, kv),
                   a + "kv_b_proj.weight": _rand(g, H * (n + v), kv), a + "o_proj.weight": _rand(g, D, H * v)})
        if i < cfg.first_k_dense:
            sd.update({m + "gate_proj.weight": _rand(g, cfg.ffn_dim, D), m + "up_proj.weight": _rand(g, cfg.ffn_dim, D),
                       m + "down_proj.weight": _rand(g, D, cfg.ffn_dim)})
            continue
        sd[m + "gate.weight"] = _rand(g, E, D, scale=1.0)
        sd[m + "gate.e_score_correction_bias"] = _rand(g, E)
        for e in range(E):
            for proj, shape in (("gate_proj", (cfg.expert_ffn_dim, D)), ("up_proj", (cfg.expert_ffn_dim, D)),
                                ("down_proj", (D, cfg.expert_ffn_dim))):
                sd[f"{m}experts.{e}.{proj}.weight"] = _rand(g, *shape)
        Fs = cfg.n_shared_experts * cfg.expert_ffn_dim
        sd.update(
            {
                m + "shared_experts.gate_proj.weight": _rand(g, Fs, D),
                m + "shared_experts.up_proj.weight": _rand(g, Fs, D),
                m + "shared_experts.down_proj.weight": _rand(g, D, Fs),
            }
        )
    for i in range(cfg.n_layers, cfg.n_layers + getattr(cfg, "mtp_depth", 0)):
        # DeepSeek-V3's multi-token-prediction layer: its own projection and norms, copies of the
        # embedding and head, and a full MoE decoder layer's tensors under the same prefix
        p = f"model.layers.{i}."
        sd.update({p + "enorm.weight": 1 + _rand(g, D), p + "hnorm.weight": 1 + _rand(g, D),
                   p + "eh_proj.weight": _rand(g, D, 2 * D), p + "shared_head.norm.weight": 1 + _rand(g, D),
                   p + "embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
                   p + "shared_head.head.weight": sd["lm_head.weight"].clone()})
        layer = deepseek_hf_tensors(dataclasses.replace(cfg, n_layers=i + 1, mtp_depth=0), seed=seed + 1 + i)
        sd.update({k: v for k, v in layer.items() if k.startswith(p)})
    return sd


# ----------------------------------------------------------------------------- HF-convention forwards


def _norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _mscale(factor, m):
    """YaRN's magnitude factor, as DeepSeek-V3 defines it."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def reference_inv_freq(d, theta, scaling=None):
    """The RoPE inverse frequencies from the published formulas, in Python floats: Llama 3.1's
    wavelength bands (HF modeling_rope_utils, llama3) and YaRN's ramp (DeepSeek-V3, yarn)."""
    base = [theta ** (-2 * i / d) for i in range(d // 2)]
    if scaling is None:
        return base
    f, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    if scaling["type"] == "llama3":
        lo, hi, out = scaling["low_freq_factor"], scaling["high_freq_factor"], []
        for w in base:
            wavelen = 2 * math.pi / w
            if wavelen < orig / hi:
                out.append(w)
            elif wavelen > orig / lo:
                out.append(w / f)
            else:
                t = (orig / wavelen - lo) / (hi - lo)
                out.append((1 - t) * w / f + t * w)
        return out

    def correction_dim(rotations):  # the dim whose wave turns `rotations` times over `orig` positions
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), d - 1)
    if low == high:
        high += 0.001
    out = []
    for i, w in enumerate(base):
        extrapolate = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(w / f * (1 - extrapolate) + w * extrapolate)
    return out


def _rope(S, d, theta, scaling=None):
    inv = torch.tensor(reference_inv_freq(d, theta, scaling), dtype=torch.float64)
    freqs = torch.arange(S, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    m = 1.0
    if scaling is not None and scaling["type"] == "yarn":
        m = _mscale(scaling["factor"], scaling["mscale"]) / _mscale(scaling["factor"], scaling["mscale_all_dim"])
    return (emb.cos() * m).float(), (emb.sin() * m).float()


def _softmax_attention(q, k, v, scale):
    S = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale + torch.full((S, S), float("-inf")).triu(1)
    return scores.softmax(-1) @ v  # [B, H, S, dv]


def _swiglu(x, sd, p):
    return F.linear(F.silu(F.linear(x, sd[p + "gate_proj.weight"])) * F.linear(x, sd[p + "up_proj.weight"]),
                    sd[p + "down_proj.weight"])


def hf_llama_logits(sd, tokens, cfg, rope_scaling=None):
    """HF LlamaForCausalLM's math, written from its conventions: [out, in] weights, rotate_half, repeat_kv;
    ``rope_scaling`` a dict as config.json gives it (``type`` llama3 or yarn)."""
    B, S = tokens.shape
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
    cos, sin = _rope(S, hd, cfg.rope_theta, rope_scaling)
    h = sd["model.embed_tokens.weight"][tokens]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        x = _norm(h, sd[p + "input_layernorm.weight"], cfg.norm_eps)
        q, k, v = (F.linear(x, sd[p + f"self_attn.{n}_proj.weight"]).view(B, S, -1, hd).transpose(1, 2) for n in "qkv")
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = (t[:, :, None].expand(B, Hkv, H // Hkv, S, hd).reshape(B, H, S, hd) for t in (k, v))  # repeat_kv
        o = _softmax_attention(q, k, v, 1 / math.sqrt(hd)).transpose(1, 2).reshape(B, S, H * hd)
        h = h + F.linear(o, sd[p + "self_attn.o_proj.weight"])
        h = h + _swiglu(_norm(h, sd[p + "post_attention_layernorm.weight"], cfg.norm_eps), sd, p + "mlp.")
    return F.linear(_norm(h, sd["model.norm.weight"], cfg.norm_eps), sd["lm_head.weight"])


def _interleaved_rope(x, cos, sin):
    b, h, s, d = x.shape  # HF DeepSeek-V3 (rope_interleave): pairs (2i, 2i+1) -> halves, then rotate_half
    x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return x * cos + _rotate_half(x) * sin


def _deepseek_layer(sd, i, h, cos, sin, cfg, softmax_scale, latent_eps):
    """HF DeepSeek-V3 decoder layer ``i`` on ``h`` [B, S, D]: MLA, then a dense MLP or the MoE."""
    B, S, _ = h.shape
    H, n, r, vd = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    x = _norm(h, sd[f"model.layers.{i}.input_layernorm.weight"], cfg.norm_eps)
    if cfg.q_lora_rank:
        q = F.linear(_norm(F.linear(x, sd[a + "q_a_proj.weight"]), sd[a + "q_a_layernorm.weight"], latent_eps),
                     sd[a + "q_b_proj.weight"])
    else:
        q = F.linear(x, sd[a + "q_proj.weight"])
    q_pass, q_rot = q.view(B, S, H, n + r).transpose(1, 2).split([n, r], dim=-1)
    k_pass, k_rot = F.linear(x, sd[a + "kv_a_proj_with_mqa.weight"]).split([cfg.kv_lora_rank, r], dim=-1)
    kv = F.linear(_norm(k_pass, sd[a + "kv_a_layernorm.weight"], latent_eps), sd[a + "kv_b_proj.weight"])
    k_pass, value = kv.view(B, S, H, n + vd).transpose(1, 2).split([n, vd], dim=-1)
    q_rot, k_rot = _interleaved_rope(q_rot, cos, sin), _interleaved_rope(k_rot.view(B, 1, S, r), cos, sin)
    q, k = torch.cat([q_pass, q_rot], -1), torch.cat([k_pass, k_rot.expand(B, H, S, r)], -1)
    o = _softmax_attention(q, k, value, softmax_scale).transpose(1, 2).reshape(B, S, H * vd)
    h = h + F.linear(o, sd[a + "o_proj.weight"])
    x = _norm(h, sd[f"model.layers.{i}.post_attention_layernorm.weight"], cfg.norm_eps)
    if i < cfg.first_k_dense:
        return h + _swiglu(x, sd, m)
    flat = x.reshape(B * S, -1)
    scores = F.linear(flat, sd[m + "gate.weight"]).sigmoid()
    idx = (scores + sd[m + "gate.e_score_correction_bias"]).topk(cfg.top_k, dim=-1).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.route_scale
    y = _swiglu(flat, sd, m + "shared_experts.")
    for e in range(cfg.n_experts):
        y = y + ((idx == e) * w).sum(-1, keepdim=True) * _swiglu(flat, sd, f"{m}experts.{e}.")
    return h + y.view(B, S, -1)


def hf_deepseek_logits(sd, tokens, cfg, rope_scaling=None, latent_eps=1e-6, *, mtp=False):
    """HF DeepseekV3ForCausalLM's math: MLA with interleaved rope, sigmoid router + bias. ``rope_scaling``:
    None or config.json's yarn dict (scaled tables, softmax scale times mscale(factor, mscale_all_dim)^2);
    the latent norms (q_a_layernorm, kv_a_layernorm) use ``latent_eps``, DeepSeek's RMSNorm default.

    ``mtp``: also the logits of DeepSeek-V3's multi-token-prediction layers ``n_layers + k - 1`` (as
    vLLM and Megatron-LM run them): eh_proj of [enorm(embedding of token i+k); hnorm(hidden)], one
    decoder layer, shared_head.norm then shared_head.head; depth 1's hidden is the main model's
    after model.norm, depth k+1's is depth k's layer output. Returns ``(logits, [depth logits])``."""
    S = tokens.shape[1]
    n, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    cos, sin = _rope(S, r, cfg.rope_theta, rope_scaling)
    softmax_scale = (n + r) ** -0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        softmax_scale *= _mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"]) ** 2
    h = sd["model.embed_tokens.weight"][tokens]
    for i in range(cfg.n_layers):
        h = _deepseek_layer(sd, i, h, cos, sin, cfg, softmax_scale, latent_eps)
    h = _norm(h, sd["model.norm.weight"], cfg.norm_eps)
    logits = F.linear(h, sd["lm_head.weight"])
    if not mtp:
        return logits
    depths = []
    for k in range(1, cfg.mtp_depth + 1):
        p, rows = f"model.layers.{cfg.n_layers + k - 1}.", S - k
        e = _norm(sd[p + "embed_tokens.weight"][tokens[:, k:]], sd[p + "enorm.weight"], cfg.norm_eps)
        x = F.linear(torch.cat([e, _norm(h[:, :rows], sd[p + "hnorm.weight"], cfg.norm_eps)], -1),
                     sd[p + "eh_proj.weight"])
        h = _deepseek_layer(sd, cfg.n_layers + k - 1, x, cos[:rows], sin[:rows], cfg, softmax_scale, latent_eps)
        depths.append(F.linear(_norm(h, sd[p + "shared_head.norm.weight"], cfg.norm_eps),
                               sd[p + "shared_head.head.weight"]))
    return logits, depths


# ----------------------------------------------------------------------------- tests


def _write(directory, sd, shards=1):
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(sd)
    if shards == 1:
        save_file(sd, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k].contiguous() for k in keys[s::shards]}
        save_file(part, str(directory / name))
        weight_map.update({k: name for k in part})
    (directory / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def test_llama_hand_named_checkpoint_matches_an_hf_convention_forward(tmp_path):
    cfg = _cfg("llama")
    sd = llama_hf_tensors(cfg)
    params = hf.load(_write(tmp_path / "llama", sd, shards=3), "llama", cfg, hf_config=hf.hf_config("llama", cfg))
    tokens = _tokens()
    ours = models.get("llama").apply(params, tokens, cfg)
    torch.testing.assert_close(ours, hf_llama_logits(sd, tokens, cfg), rtol=1e-4, atol=1e-4)
    assert params["layers"]["attn"]["wq"].shape == (2, 32, 32)  # stacked, [in, out]
    torch.testing.assert_close(params["layers"]["attn"]["wk"][1], sd["model.layers.1.self_attn.k_proj.weight"].T)


@pytest.mark.parametrize("q_lora_rank", [16, 0])
def test_deepseek_hand_named_checkpoint_matches_an_hf_convention_forward(tmp_path, q_lora_rank):
    cfg = _cfg("moe", q_lora_rank=q_lora_rank)
    sd = deepseek_hf_tensors(cfg)
    params = hf.load(_write(tmp_path / "ds", sd), "moe", cfg, hf_config=hf.hf_config("moe", cfg))
    tokens = _tokens()
    ours = models.get("moe").apply(params, tokens, cfg)
    torch.testing.assert_close(ours, hf_deepseek_logits(sd, tokens, cfg), rtol=1e-4, atol=1e-4)
    experts = params["moe_layers"]["experts"]
    assert experts["w1"].shape == (2, 4, 32, 16) and experts["w2"].shape == (2, 4, 16, 32)
    torch.testing.assert_close(experts["w2"][1, 3], sd["model.layers.2.mlp.experts.3.down_proj.weight"].T)
    torch.testing.assert_close(
        params["moe_layers"]["router_bias"][0], sd["model.layers.1.mlp.gate.e_score_correction_bias"]
    )


def test_rope_interleave_false_loads_rows_as_they_are(tmp_path):
    cfg = _cfg("moe")
    sd = deepseek_hf_tensors(cfg)
    d = _write(tmp_path / "ds", sd)
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "rope_interleave": False}))
    plain = hf.load(d, "moe", cfg)
    torch.testing.assert_close(
        plain["moe_layers"]["attn"]["wkv_a"][0], sd["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].T
    )
    interleaved = hf.from_hf(sd, "moe", cfg)
    assert not torch.equal(plain["moe_layers"]["attn"]["wkv_a"], interleaved["moe_layers"]["attn"]["wkv_a"])


@pytest.mark.parametrize("name,over", [("llama", {}), ("llama", {"tie_embeddings": True}), ("moe", {}),
                                       ("moe", {"attention": "gqa", "n_kv_heads": 1, "first_k_dense": 0})])
def test_our_params_round_trip_through_hf_files(tmp_path, name, over):
    cfg = _cfg(name, **over)
    model = models.get(name)
    params = model.init(cfg, seed=3)
    files = hf.save(tmp_path / "out", params, name, cfg, max_shard_bytes=40_000)
    assert len(files) > 1 and (tmp_path / "out" / hf.INDEX_FILE).is_file()
    loaded = hf.load(tmp_path / "out", name, cfg)
    for (p1, a), (p2, b) in zip(flatten_with_paths(params), flatten_with_paths(loaded)):
        assert p1 == p2 and torch.equal(a, b), p1
    tokens = _tokens()
    torch.testing.assert_close(model.apply(loaded, tokens, cfg), model.apply(params, tokens, cfg), rtol=0, atol=0)


def test_layout_documents_every_parameter():
    for name in ("llama", "moe"):
        cfg = _cfg(name)
        ours = {p for p, _ in flatten_with_paths(models.get(name).init(cfg, 0, device="meta"))}
        assert {t.path for t in hf.layout(name, cfg)} == ours
    keys = [k for t in hf.layout("moe", _cfg("moe")) for k in t.keys()]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" in keys
    assert len(keys) == len(set(keys)) == len(deepseek_hf_tensors(_cfg("moe")))


def test_bf16_checkpoint_loads_as_float32(tmp_path):
    cfg = _cfg("llama")
    sd = {k: v.to(torch.bfloat16) for k, v in llama_hf_tensors(cfg).items()}
    params = hf.load(_write(tmp_path / "bf16", sd), "llama", cfg, hf_config=hf.hf_config("llama", cfg))
    assert params["embed"].dtype == torch.float32
    torch.testing.assert_close(params["embed"], sd["model.embed_tokens.weight"].float())


def test_train_init_from_starts_at_the_checkpoints_loss(tmp_path):
    cfg = load_config(None, ["model.n_layers=1", "train.steps=1", "train.batch_size=2", "train.seq_len=16"])
    params = models.get("llama").init(cfg.model, seed=7)
    hf.save(tmp_path / "ckpt", params, "llama", cfg.model)
    cfg = load_config(None, ["model.n_layers=1", "train.steps=1", "train.batch_size=2", "train.seq_len=16",
                             f"train.init_from={tmp_path / 'ckpt'}"])
    result = train(cfg, log=lambda line: None)
    batch = data.get_batch(data.from_config(cfg.data), 0, batch_size=2, seq_len=16, seed=cfg.train.seed)
    expected = float(models.get("llama").loss(params, batch, cfg.model))
    assert result.history[0]["loss"] == pytest.approx(expected, rel=1e-6)


def test_regions_build_only_their_boxes_and_read_only_their_layers_and_experts(tmp_path):
    cfg = _cfg("moe", first_k_dense=0, n_layers=2)
    params = models.get("moe").init(cfg, seed=5)
    hf.save(tmp_path / "out", params, "moe", cfg)
    full = dict(flatten_with_paths(params))
    regions = {"moe_layers.experts.w1": (slice(1, 2), slice(2, 4), slice(0, 16)),  # layer 1, experts 2-3
               "moe_layers.attn.wq_b": (slice(0, 1), slice(8, 16)),                 # layer 0, rows 8-15
               "embed": (slice(0, 64), slice(16, 32))}
    tensors = hf.read_dir(tmp_path / "out")
    read = []
    spy = type("Spy", (), {"__getitem__": lambda self, k: read.append(k) or tensors[k],
                           "__iter__": lambda self: iter(tensors), "__len__": lambda self: len(tensors),
                           "__contains__": lambda self, k: k in tensors})()
    got = hf.from_hf(spy, "moe", cfg, regions=regions)
    assert set(got) == set(regions)
    for path, box in regions.items():
        assert torch.equal(got[path], full[path][box]), path
    assert sorted(read) == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_b_proj.weight",
                            "model.layers.1.mlp.experts.2.gate_proj.weight",
                            "model.layers.1.mlp.experts.3.gate_proj.weight"]


# ----------------------------------------------------------------------------- config.json: RoPE, latent norms, save

LLAMA31 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 4.0, "beta_slow": 0.25,
        "mscale": 1.0, "mscale_all_dim": 0.8}


def _rope_json(fmt, theta, scaling):
    """The RoPE keys of a config.json: old style with ``type`` or ``rope_type``, or transformers 5's rope_parameters."""
    keys = {k: v for k, v in (scaling or {}).items() if k != "type"}
    if fmt == "rope_parameters":
        kind = scaling["type"] if scaling else "default"
        return {"rope_parameters": {"rope_theta": theta, "rope_type": kind, **keys}}
    return {"rope_theta": theta, **({"rope_scaling": {fmt: scaling["type"], **keys}} if scaling else {})}


@pytest.mark.parametrize("fmt", ["type", "rope_type", "rope_parameters"])
def test_yarn_config_json_in_either_format_loads_and_matches_a_reference(tmp_path, fmt):
    cfg = _cfg("moe", rope_scaling=YARN, qk_rope_head_dim=8, rope_theta=100.0)
    sd = deepseek_hf_tensors(cfg)
    d = _write(tmp_path / fmt, sd)
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 3,
                                               **_rope_json(fmt, 100.0, YARN)}))
    params = hf.load(d, "moe", cfg)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(models.get("moe").apply(params, tokens, cfg),
                               hf_deepseek_logits(sd, tokens, cfg, rope_scaling=YARN), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["type", "rope_type", "rope_parameters"])
def test_llama31_config_json_in_either_format_passes_the_check(fmt):
    cfg = _cfg("llama", rope_theta=500000.0, rope_scaling=LLAMA31)
    hf.check_hf_config({"model_type": "llama", "hidden_size": 32, **_rope_json(fmt, 500000, LLAMA31)}, "llama", cfg)
    plain = _cfg("llama", rope_theta=500000.0)
    hf.check_hf_config({"model_type": "llama", **_rope_json(fmt, 500000, None)}, "llama", plain)


def test_rope_disagreements_are_each_named():
    cfg = _cfg("llama", rope_theta=500000.0, rope_scaling=LLAMA31)
    with pytest.raises(ValueError, match=r"disagrees with the model config: hidden_size=64 but model\.dim=32; "
                                         r"rope_theta=10000\.0 but model\.rope_theta=500000\.0; "
                                         r"rope_parameters\.factor=32\.0 "
                                         r"but model\.rope_scaling\.factor=8\.0; override model\.dim=64 "
                                         r"model\.rope_theta=10000\.0 model\.rope_scaling\.factor=32\.0"):
        hf.check_hf_config({"hidden_size": 64, **_rope_json("rope_parameters", 10000.0, {**LLAMA31, "factor": 32})},
                           "llama", cfg)
    with pytest.raises(ValueError, match=r"no RoPE scaling but model\.rope_scaling=\{'type': 'llama3'.*; "
                                         r"override model\.rope_scaling=null"):
        hf.check_hf_config({"rope_theta": 500000.0}, "llama", cfg)
    with pytest.raises(ValueError, match=r"rope_scaling \{'type': 'llama3', 'factor': 8\.0.* but "
                                         r"model\.rope_scaling is null; "
                                         r"override model\.rope_scaling=\{type: llama3, factor: 8\.0, "):
        hf.check_hf_config(_rope_json("rope_type", 500000.0, LLAMA31), "llama", _cfg("llama", rope_theta=500000.0))
    moe_cfg = _cfg("moe", rope_scaling=YARN)
    with pytest.raises(ValueError, match=r"rope_scaling\.beta_fast=32\.0 but model\.rope_scaling\.beta_fast=4\.0; .*"
                                         r"rope_scaling\.mscale_all_dim=0\.0 but "
                                         r"model\.rope_scaling\.mscale_all_dim=0\.8"):
        # yarn keys left out of config.json take Hugging Face's defaults (beta_fast 32, beta_slow 1, mscale 1, 0)
        hf.check_hf_config({"rope_theta": 10000.0, "max_position_embeddings": 8,
                            "rope_scaling": {"type": "yarn", "factor": 4.0}}, "moe", moe_cfg)
    with pytest.raises(ValueError, match=r"rope_scaling \{'type': 'llama3'.* but model\.rope_scaling is yarn"):
        hf.check_hf_config(_rope_json("type", 10000.0, LLAMA31), "moe", moe_cfg)


@pytest.mark.parametrize("fmt", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", ["linear", "dynamic", "longrope", "su"])
def test_rope_types_that_are_not_modelled_are_refused_by_name(fmt, kind):
    scaling = {"rope_type": kind, "factor": 2.0}
    config = {"rope_theta": 1e4, "rope_scaling": scaling} if fmt == "rope_scaling" else \
        {"rope_parameters": {"rope_theta": 1e4, **scaling}}
    with pytest.raises(ValueError, match=rf"{fmt} type '{kind}' is not modelled; the models implement RoPE scaling "
                                         r"llama3, yarn"):
        hf.check_hf_config(config, "llama", _cfg("llama"))


@pytest.mark.parametrize("extra,message", [
    ({"attention_factor": 1.2}, r"rope_scaling\.attention_factor=1\.2 is not modelled"),
    ({"partial_rotary_factor": 0.5}, r"rope_scaling\.partial_rotary_factor=0\.5"),
])
def test_yarn_keys_that_are_not_modelled_are_refused_by_name(extra, message):
    with pytest.raises(ValueError, match=message):
        hf.check_hf_config(_rope_json("type", 10000.0, {**YARN, **extra}), "moe", _cfg("moe", rope_scaling=YARN))


def test_yarn_truncate_false_is_read_and_compared_with_the_model_config():
    """gpt-oss's config.json says truncate: false (the correction range kept fractional)."""
    with pytest.raises(ValueError, match=r"rope_scaling\.truncate=False but model\.rope_scaling\.truncate=True; "
                                         r"override model\.rope_scaling\.truncate=false"):
        hf.check_hf_config(_rope_json("type", 10000.0, {**YARN, "truncate": False}), "moe",
                           _cfg("moe", rope_scaling=YARN))
    cfg = _cfg("moe", rope_scaling={**YARN, "truncate": False})
    hf.check_hf_config(_rope_json("type", 10000.0, {**YARN, "truncate": False}), "moe", cfg)
    assert cfg.rope_scaling.to_dict()["truncate"] is False


def test_mla_latent_norms_use_eps_1e6_whatever_norm_eps():
    cfg = _cfg("moe", norm_eps=1e-5)
    sd = deepseek_hf_tensors(cfg)
    for k in sd:  # small latents, so the eps matters
        if k.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
            sd[k] = sd[k] * 1e-3
    tokens = _tokens()
    ours = models.get("moe").apply(hf.from_hf(sd, "moe", cfg), tokens, cfg)
    torch.testing.assert_close(ours, hf_deepseek_logits(sd, tokens, cfg, latent_eps=1e-6), rtol=1e-4, atol=1e-4)
    assert (ours - hf_deepseek_logits(sd, tokens, cfg, latent_eps=1e-5)).abs().max() > 1e-2


SAVED = [("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA31}, "llama", "LlamaForCausalLM"),
         ("llama", {"tie_embeddings": True}, "llama", "LlamaForCausalLM"),
         ("moe", {"rope_scaling": YARN, "qk_rope_head_dim": 8, "q_lora_rank": 0}, "deepseek_v3",
          "DeepseekV3ForCausalLM"),
         ("moe", {"attention": "gqa", "n_kv_heads": 1, "first_k_dense": 0}, "deepseek_v3", "DeepseekV3ForCausalLM")]


@pytest.mark.parametrize("name,over,model_type,arch", SAVED)
def test_save_writes_a_config_json_that_loads_back(tmp_path, name, over, model_type, arch):
    cfg = _cfg(name, **over)
    params = models.get(name).init(cfg, seed=1, dtype=torch.bfloat16)
    d = tmp_path / "out"
    hf.save(d, params, name, cfg)
    written = json.loads((d / "config.json").read_text())
    assert written["model_type"] == model_type and written["architectures"] == [arch]
    assert (written["hidden_size"], written["num_hidden_layers"], written["num_attention_heads"]) == (32, cfg.n_layers,
                                                                                                      cfg.n_heads)
    assert written["tie_word_embeddings"] is cfg.tie_embeddings and written["torch_dtype"] == "bfloat16"
    assert written["rope_theta"] == cfg.rope_theta and written["hidden_act"] == "silu"
    scaling = over.get("rope_scaling")
    assert written.get("rope_scaling") == (None if scaling is None else {"rope_type": scaling["type"], **scaling})
    if scaling is YARN:
        assert written["max_position_embeddings"] == 32 and written["q_lora_rank"] is None
    loaded = hf.load(d, name, cfg, dtype=torch.bfloat16)  # the config check passes
    for (p1, a), (p2, b) in zip(flatten_with_paths(params), flatten_with_paths(loaded)):
        assert p1 == p2 and torch.equal(a, b), p1
    changed = [("num_hidden_layers", 5, rf"num_hidden_layers=5 but model\.n_layers={cfg.n_layers}")]
    if scaling is not None:
        changed.append(("rope_scaling", {**written["rope_scaling"], "factor": 2.0},
                        rf"rope_scaling\.factor=2\.0 but model\.rope_scaling\.factor={scaling['factor']}"))
    for key, value, message in changed:
        (d / "config.json").write_text(json.dumps({**written, key: value}))
        with pytest.raises(ValueError, match=message):
            hf.load(d, name, cfg)
