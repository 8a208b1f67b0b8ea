"""Qwen3, Qwen2, Mistral, Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss against ``transformers`` itself (models/hf/).

Each case builds a tiny random model from a transformers config object (nothing is downloaded),
writes it with ``save_pretrained``, loads it with ``hf.load`` and compares logits and loss in
fp32; then ``hf.save`` writes our tree back and ``from_pretrained`` reads it, to the bit.
"""

import json

import pytest
import torch

from shardfn import models
from shardfn.models import hf

transformers = pytest.importorskip("transformers")

SEQ = 12
ATTN = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6}


def _hf_config(kind: str, **over):
    """A tiny transformers config of each family, and our ``model.*`` for it."""
    if kind == "qwen3":
        return (transformers.Qwen3Config(**ATTN, head_dim=16, intermediate_size=48, rope_theta=1e6, **over),
                {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                 "ffn_dim": 48, "norm_eps": 1e-6, "rope_theta": 1e6})
    if kind == "qwen2":
        return (transformers.Qwen2Config(**ATTN, intermediate_size=48, rope_theta=1e6, **over),
                {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48,
                 "norm_eps": 1e-6, "rope_theta": 1e6})
    if kind == "mistral":
        return (transformers.MistralConfig(**ATTN, intermediate_size=48, sliding_window=4, rope_theta=1e4, **over),
                {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48,
                 "norm_eps": 1e-6, "rope_theta": 1e4, "sliding_window": 4})
    if kind == "qwen3_moe":
        hf_cfg = transformers.Qwen3MoeConfig(**{**ATTN, "num_hidden_layers": 3}, head_dim=8, intermediate_size=40,
                                             moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                             rope_theta=1e6, **{"norm_topk_prob": True, **over})
        ours = {"vocab_size": 64, "dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8,
                "ffn_dim": 40, "expert_ffn_dim": 16, "n_experts": 4, "top_k": 2, "norm_eps": 1e-6, "rope_theta": 1e6,
                "norm_topk_prob": over.get("norm_topk_prob", True),
                "mlp_only_layers": list(over.get("mlp_only_layers", [])),
                "decoder_sparse_step": over.get("decoder_sparse_step", 1)}
        return hf_cfg, ours
    if kind == "qwen2_moe":
        return (transformers.Qwen2MoeConfig(**ATTN, intermediate_size=40, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                            rope_theta=1e6, **over),
                {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 40,
                 "expert_ffn_dim": 16, "shared_expert_ffn_dim": 24, "n_experts": 4, "top_k": 2, "norm_eps": 1e-6,
                 "rope_theta": 1e6, "norm_topk_prob": False})
    if kind == "gpt_oss":  # HF's defaults: YaRN (factor 32, truncate false), alternating sliding / full layers
        return (transformers.GptOssConfig(**{**ATTN, **over}, head_dim=8, intermediate_size=16, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=4),
                {"vocab_size": 64, "dim": 32, "n_layers": over.get("num_hidden_layers", 2), "n_heads": 4,
                 "n_kv_heads": 2, "head_dim": 8,
                 "expert_ffn_dim": 16, "n_experts": 4, "top_k": 2, "sliding_window": 4, "norm_eps": 1e-6,
                 **({"layer_types": over["layer_types"]} if "layer_types" in over else {})})
    assert kind == "mixtral"
    return (transformers.MixtralConfig(**ATTN, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                       rope_theta=1e6, **over),
            {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "expert_ffn_dim": 16,
             "n_experts": 4, "top_k": 2, "norm_eps": 1e-6, "rope_theta": 1e6})


def _hf_model(hf_cfg, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms at 1 and zero biases (or sinks) would hide a wrong norm, bias or sink
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "_bias", "sinks")):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _tokens(vocab=64):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


CASES = [("qwen3", {}), ("qwen2", {}), ("mistral", {}), ("qwen3_moe", {}),
         ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [1]}),
         ("qwen3_moe", {"decoder_sparse_step": 2}), ("mixtral", {}), ("qwen2_moe", {}), ("gpt_oss", {}),
         ("gpt_oss", {"num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention",
                                                              "sliding_attention"]})]


@pytest.mark.parametrize("kind,over", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_logits_loss_and_round_trip_match_transformers(tmp_path, kind, over):
    hf_cfg, ours = _hf_config(kind, **over)
    ref = _hf_model(hf_cfg)
    ref.save_pretrained(tmp_path / "hf")
    model = models.get(kind)
    cfg = model.Config.from_dict(ours)
    params = hf.load(tmp_path / "hf", kind, cfg)                  # config.json checked against cfg
    x = _tokens()
    with torch.no_grad():
        theirs = ref(x).logits
        mine = model.apply(params, x, cfg)
        assert (mine - theirs).abs().max().item() < 1e-4
        loss = model.loss(params, {"inputs": x[:, :-1], "targets": x[:, 1:]}, cfg)
        assert abs(loss.item() - ref(x, labels=x).loss.item()) < 1e-4
    hf.save(tmp_path / "ours", params, kind, cfg)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert type(back) is type(ref)
    with torch.no_grad():
        assert torch.equal(back(x).logits, theirs)
    assert hf.load(tmp_path / "ours", kind, cfg) is not None   # our config.json passes our own check


def test_mistral_window_is_computed():
    """With the window shorter than the sequence, the logits differ from full attention's, and match HF's."""
    hf_cfg, ours = _hf_config("mistral")
    model = models.get("mistral")
    cfg = model.Config.from_dict(ours)
    params = model.init(cfg, seed=0)
    full = model.Config.from_dict({**ours, "sliding_window": 0})
    x = _tokens()
    windowed, plain = model.apply(params, x, cfg), model.apply(params, x, full)
    torch.testing.assert_close(windowed[:, :4], plain[:, :4])     # within the window: the same
    assert (windowed[:, 4:] - plain[:, 4:]).abs().max() > 1e-3
    assert model.context_refusal(cfg)[0] == "sliding_window" and model.context_refusal(full) is None


def test_config_json_read_in_both_formats_and_disagreements_named(tmp_path):
    hf_cfg, ours = _hf_config("mistral")
    _hf_model(hf_cfg).save_pretrained(tmp_path / "m")
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "rope_parameters" in written                           # transformers 5's format
    cfg = models.get("mistral").Config.from_dict(ours)
    old = {k: v for k, v in written.items() if k != "rope_parameters"} | {"rope_theta": 1e4}
    (tmp_path / "m" / "config.json").write_text(json.dumps(old))  # the older, top-level format
    hf.load(tmp_path / "m", "mistral", cfg)
    for key, value, message in [
        ("sliding_window", None, r"sliding_window=None but model\.sliding_window=4; override model\.sliding_window=0"),
        ("sliding_window", 8, r"sliding_window=8 but model\.sliding_window=4"),
        ("num_key_value_heads", 4, r"num_key_value_heads=4 but model\.n_kv_heads=2"),
        ("model_type", "qwen3", r"model_type 'qwen3' .* is not a 'mistral' model .*set model\.name to match the "
                                  r"checkpoint: model\.name=qwen3"),
        ("model_type", "gemma3", r"model_type 'gemma3' .* is not modelled; the architectures shardfn loads: "
                                  r".*Qwen3ForCausalLM \(model\.name=qwen3\)"),
    ]:
        (tmp_path / "m" / "config.json").write_text(json.dumps({**old, key: value}))
        with pytest.raises(ValueError, match=message):
            hf.load(tmp_path / "m", "mistral", cfg)
    for kind, key, value, message in [("qwen3", "use_sliding_window", True, "use_sliding_window is true"),
                                      ("qwen3", "layer_types", ["sliding_attention", "full_attention"],
                                       "layer_types has sliding_attention"),
                                      ("qwen3", "attention_bias", True, "attention_bias is true")]:
        hf_cfg, ours = _hf_config(kind)
        _hf_model(hf_cfg).save_pretrained(tmp_path / kind)
        written = json.loads((tmp_path / kind / "config.json").read_text())
        (tmp_path / kind / "config.json").write_text(json.dumps({**written, key: value}))
        with pytest.raises(ValueError, match=message):
            hf.load(tmp_path / kind, kind, models.get(kind).Config.from_dict(ours))


@pytest.mark.parametrize("kind,wrong", [("qwen3", "llama"), ("qwen2", "llama"), ("qwen3_moe", "moe"),
                                        ("mixtral", "llama"), ("qwen3", "mistral")])
def test_another_architecture_is_named_not_skipped(tmp_path, kind, wrong):
    """With config.json: refused by model_type naming the model that loads it. Without it (stated
    as ours): a tensor of the checkpoint's architecture is named, and no hint says to skip it."""
    hf_cfg, _ = _hf_config(kind)
    _hf_model(hf_cfg).save_pretrained(tmp_path / "hf")
    model = models.get(wrong)
    cfg = model.Config.from_dict({"vocab_size": 64, "dim": 32, "n_layers": hf_cfg.num_hidden_layers, "n_heads": 4})
    with pytest.raises(ValueError, match=rf"model_type '{kind}' .* is not a '{wrong}' model .*: "
                                         rf"model\.name={kind}$"):
        hf.load(tmp_path / "hf", wrong, cfg)
    (tmp_path / "hf" / "config.json").unlink()
    if kind == "qwen3" and wrong == "mistral":
        return
    with pytest.raises(ValueError, match=r"is a .*which model .* does not have: the checkpoint is another "
                                         r"architecture") as e:
        hf.load(tmp_path / "hf", wrong, cfg, hf_config=hf.hf_config(wrong, cfg))
    assert "ignore" not in str(e.value) and "skip" not in str(e.value)


def test_weights_without_config_json_are_not_assumed(tmp_path):
    """Mistral weights have Llama's names: without config.json, loading them assumes nothing."""
    hf_cfg, ours = _hf_config("mistral")
    ref = _hf_model(hf_cfg)
    ref.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").unlink()
    cfg = models.get("mistral").Config.from_dict(ours)
    with pytest.raises(ValueError, match=r"config\.json: no such file\. The weights alone do not say what "
                                         r"config\.json would \(a sliding window"):
        hf.load(tmp_path / "hf", "mistral", cfg)
    llama = models.get("llama").Config.from_dict({"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4,
                                                   "n_kv_heads": 2, "ffn_dim": 48})
    with pytest.raises(ValueError, match=r"config\.json: no such file"):
        hf.load(tmp_path / "hf", "llama", llama)
    params = hf.load(tmp_path / "hf", "mistral", cfg, hf_config=hf.hf_config("mistral", cfg))  # stated: loads
    with torch.no_grad():
        assert (models.get("mistral").apply(params, _tokens(), cfg) - ref(_tokens()).logits).abs().max() < 1e-4
    with pytest.raises(ValueError, match=r"hf_config= disagrees .*sliding_window=4 but model\.sliding_window=0"):
        full = models.get("mistral").Config.from_dict({**ours, "sliding_window": 0})
        hf.load(tmp_path / "hf", "mistral", full, hf_config=hf.hf_config("mistral", cfg))


@pytest.mark.parametrize("name", ["llama", "moe"])
def test_save_writes_every_key_transformers_needs(tmp_path, name):
    """hf.save of the built-in families rebuilds in transformers (MLA: num_key_value_heads = n_heads)."""
    over = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 2}
    if name == "moe":
        over.update(first_k_dense=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8, ffn_dim=48, n_experts=4, top_k=2, n_shared_experts=1, expert_ffn_dim=16,
                    route_scale=2.5)
    model = models.get(name)
    cfg = model.Config.from_dict(over)
    params = model.init(cfg, seed=1)
    hf.save(tmp_path / "out", params, name, cfg)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 2
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    x = _tokens()
    with torch.no_grad():
        assert (back(x).logits - model.apply(params, x, cfg)).abs().max().item() < 1e-4


def test_gpt_oss_attention_sinks_and_clamped_swiglu_match_transformers():
    """The core pieces of gpt-oss, against transformers' own functions."""
    from transformers.models.gpt_oss import modeling_gpt_oss as G

    from shardfn.core import layers as L

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g), \
        torch.randn(2, 2, 10, 8, generator=g)
    sinks = torch.randn(4, generator=g)
    for window in (0, 3):
        i = torch.arange(10)
        keep = (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - window) if window else True)
        mask = torch.zeros(10, 10).masked_fill(~keep, float("-inf"))
        module = type("M", (), {"num_key_value_groups": 2, "sinks": sinks, "training": False})()
        ref, _ = G.eager_attention_forward(module, q, k, v, mask, scaling=8 ** -0.5)
        ours = L.sink_attention(q, k, v, sinks, window=window)
        assert (ours.transpose(1, 2) - ref).abs().max().item() < 1e-6
    cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2)
    experts = G.GptOssExperts(cfg)
    gate_up = torch.randn(5, 12, generator=g) * 6
    assert torch.equal(L.clamped_swiglu(gate_up, limit=cfg.swiglu_limit), experts._apply_gate(gate_up))


def test_gpt_oss_yarn_is_transformers_at_the_published_size():
    """gpt-oss's YaRN (factor 32, correction range not truncated) at head_dim 64: the frequencies
    and the cos/sin scale transformers computes for GptOssConfig()."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardfn.config import load_config
    from shardfn.core import layers as L

    cfg = load_config("gpt_oss_20b").model
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.GptOssConfig())
    ours = L.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.allclose(ours, inv_freq, rtol=1e-6, atol=0)
    truncated = L.rope_inv_freq(cfg.head_dim, cfg.rope_theta, L.RopeScaling(**{**vars(cfg.rope_scaling),
                                                                                "truncate": None}))
    assert (truncated - inv_freq).abs().max() > 1e-4                              # truncation would show
    cos, _ = L.rope_tables(2, cfg.head_dim, cfg.rope_theta, scaling=cfg.rope_scaling)
    assert abs(cos[0, 0].item() - attention_factor) < 1e-6


def test_gpt_oss_config_json_disagreements_are_named(tmp_path):
    hf_cfg, ours = _hf_config("gpt_oss")
    _hf_model(hf_cfg).save_pretrained(tmp_path / "m")
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg = models.get("gpt_oss").Config.from_dict(ours)
    for key, value, message in [
        ("sliding_window", 8, r"sliding_window=8 but model\.sliding_window=4; override model\.sliding_window=8"),
        ("layer_types", ["full_attention", "full_attention"], r"layer_types=\['full_attention', 'full_attention'\] "
                                                              r"but model\.layer_types=\('sliding_attention'"),
        ("swiglu_limit", 10.0, r"swiglu_limit=10\.0 but model\.swiglu_limit=7\.0"),
        ("attention_bias", False, r"attention_bias is false, but gpt-oss's q/k/v/o projections have biases"),
        ("rope_parameters", {**written["rope_parameters"], "truncate": True},
         r"rope_parameters\.truncate=True but model\.rope_scaling\.truncate=False"),
    ]:
        (tmp_path / "m" / "config.json").write_text(json.dumps({**written, key: value}))
        with pytest.raises(ValueError, match=message):
            hf.load(tmp_path / "m", "gpt_oss", cfg)
