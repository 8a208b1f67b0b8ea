"""RoPE scaling (core.rope.RopeScaling: llama3, yarn) against the published formulas.

The references (``reference_inv_freq``, the HF-convention forwards) live in test_hf_import.py and
are written from Hugging Face's and DeepSeek-V3's definitions, in plain Python and torch; none of
them calls shardfn's RoPE code.
"""

import math

import pytest
import torch
import yaml
from test_hf_import import (
    _cfg,
    _mscale,
    deepseek_hf_tensors,
    hf_deepseek_logits,
    hf_llama_logits,
    llama_hf_tensors,
    reference_inv_freq,
)

from shardfn import models
from shardfn.config import config_from_dict, load_config
from shardfn.core import layers as L
from shardfn.core.rope import RopeScaling
from shardfn.models import hf

LLAMA31 = {"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
           "original_max_position_embeddings": 8192}
DEEPSEEK_V3 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
               "mscale": 1.0, "mscale_all_dim": 1.0}
KIMI_K2 = {**DEEPSEEK_V3, "factor": 32, "beta_fast": 1}

FREQ_CASES = [
    ("llama3.1", 128, 500000.0, LLAMA31),
    ("llama3-tiny", 16, 10000.0, {**LLAMA31, "factor": 4, "original_max_position_embeddings": 32}),
    ("deepseek-v3", 64, 10000.0, DEEPSEEK_V3),
    ("kimi-k2", 64, 50000.0, KIMI_K2),
    ("yarn-tiny", 8, 100.0, {**DEEPSEEK_V3, "factor": 4, "original_max_position_embeddings": 8, "beta_fast": 4,
                             "beta_slow": 0.25}),
    ("yarn-equal-bounds", 8, 10000.0, {**DEEPSEEK_V3, "factor": 2, "original_max_position_embeddings": 4}),
]


@pytest.mark.parametrize("name,dim,theta,scaling", FREQ_CASES, ids=[c[0] for c in FREQ_CASES])
def test_inverse_frequencies_match_the_published_formulas(name, dim, theta, scaling):
    ours = L.rope_inv_freq(dim, theta, RopeScaling.from_dict(scaling))
    expected = torch.tensor(reference_inv_freq(dim, theta, scaling), dtype=torch.float32)
    torch.testing.assert_close(ours, expected, rtol=2e-6, atol=0)
    plain = torch.tensor(reference_inv_freq(dim, theta), dtype=torch.float32)
    assert not torch.allclose(ours, plain), "the scaling must change some frequency"


def test_llama3_keeps_short_waves_divides_long_ones_and_blends_between():
    inv = L.rope_inv_freq(128, 500000.0, RopeScaling.from_dict(LLAMA31))
    plain = L.rope_inv_freq(128, 500000.0)
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    torch.testing.assert_close(inv[short], plain[short], rtol=0, atol=0)
    torch.testing.assert_close(inv[long], plain[long] / 8, rtol=1e-6, atol=0)
    ratio = plain[~short & ~long] / inv[~short & ~long]
    assert bool(((ratio > 1) & (ratio < 8)).all())


def test_yarn_factors_of_the_published_configs():
    ds = RopeScaling.from_dict(DEEPSEEK_V3)
    assert L.yarn_mscale(40.0, 1.0) == pytest.approx(0.1 * math.log(40) + 1)
    assert L.rope_softmax_factor(ds) == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    assert L.rope_softmax_factor(RopeScaling.from_dict(LLAMA31)) == L.rope_softmax_factor(None) == 1.0
    cos, sin = L.rope_tables(16, 64, 10000.0, scaling=ds)   # mscale == mscale_all_dim: tables unscaled
    assert float(cos[0].max()) == pytest.approx(1.0)
    odd = RopeScaling.from_dict({**DEEPSEEK_V3, "mscale": 0.707})
    cos, sin = L.rope_tables(16, 64, 10000.0, scaling=odd)
    assert float(cos[0].max()) == pytest.approx(_mscale(40, 0.707) / _mscale(40, 1.0), rel=1e-6)


LLAMA_SCALINGS = {
    "llama3": {**LLAMA31, "factor": 4, "original_max_position_embeddings": 32},  # hd 16: keep, blend and divide
    "yarn": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "beta_fast": 4, "beta_slow": 0.25,
             "mscale": 1.0, "mscale_all_dim": 0.5},
}


@pytest.mark.parametrize("kind", list(LLAMA_SCALINGS))
def test_llama_logits_past_the_original_context_match_a_reference(kind):
    scaling = LLAMA_SCALINGS[kind]
    cfg = _cfg("llama", n_heads=2, n_kv_heads=1, rope_scaling=scaling)
    plain_cfg = _cfg("llama", n_heads=2, n_kv_heads=1)
    sd = llama_hf_tensors(cfg)
    params = hf.from_hf(sd, "llama", cfg)
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))  # 40 > 32 positions
    ours = models.get("llama").apply(params, tokens, cfg)
    torch.testing.assert_close(ours, hf_llama_logits(sd, tokens, cfg, rope_scaling=scaling), rtol=1e-4, atol=1e-4)
    plain = models.get("llama").apply(params, tokens, plain_cfg)
    assert (ours - plain).abs().max() > 1e-2


@pytest.mark.parametrize("q_lora_rank", [16, 0])
def test_deepseek_logits_with_yarn_match_a_reference(q_lora_rank):
    scaling = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "beta_fast": 4, "beta_slow": 0.25,
               "mscale": 1.0, "mscale_all_dim": 0.8}  # both the table factor and the softmax factor differ from 1
    over = {"q_lora_rank": q_lora_rank, "qk_rope_head_dim": 8, "rope_theta": 100.0}
    cfg = _cfg("moe", rope_scaling=scaling, **over)
    sd = deepseek_hf_tensors(cfg)
    params = hf.from_hf(sd, "moe", cfg)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(4))  # 24 > 8 positions
    ours = models.get("moe").apply(params, tokens, cfg)
    torch.testing.assert_close(ours, hf_deepseek_logits(sd, tokens, cfg, rope_scaling=scaling), rtol=1e-4, atol=1e-4)
    plain = models.get("moe").apply(params, tokens, _cfg("moe", **over))
    assert (ours - plain).abs().max() > 1e-2


def test_published_configs_carry_their_rope_scaling():
    ds, kimi, l31 = (load_config(n).model for n in ("deepseek_v3_671b", "kimi_k2_1t", "llama3_1_8b"))
    assert ds.rope_scaling == RopeScaling.from_dict(DEEPSEEK_V3)
    assert kimi.rope_scaling == RopeScaling.from_dict(KIMI_K2) and kimi.rope_theta == 50000.0
    assert l31.rope_scaling == RopeScaling.from_dict(LLAMA31) and l31.rope_theta == 500000.0
    l3 = load_config("llama3_8b").model
    assert l3.rope_scaling is None and models.get("llama").param_counts(l31) == models.get("llama").param_counts(l3)


def test_rope_scaling_survives_the_run_configs_yaml_round_trip():
    cfg = config_from_dict({"model": {"name": "moe", "rope_scaling": DEEPSEEK_V3}})
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again.model == cfg.model and hash(again.model) == hash(cfg.model)
    over = config_from_dict({"model": {"name": "moe", "rope_scaling": DEEPSEEK_V3}}, ["model.rope_scaling.factor=32"])
    assert over.model.rope_scaling.factor == 32.0
    assert config_from_dict({"model": {"name": "moe", "rope_scaling": DEEPSEEK_V3}},
                            ["model.rope_scaling=null"]).model.rope_scaling is None


BAD = [
    ({"type": "linear", "factor": 2}, r"model\.rope_scaling\.type 'linear' is not a supported .* llama3 \(factor, "),
    ({"factor": 2}, r"model\.rope_scaling\.type None is not a supported .* yarn \(factor, "),
    ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
     r"model\.rope_scaling of type yarn is missing beta_fast, beta_slow, mscale, mscale_all_dim"),
    ({**LLAMA31, "beta_fast": 32}, r"model\.rope_scaling: beta_fast is not a key of a llama3 scaling; valid keys"),
    ({**LLAMA31, "factor": "8"}, r"model\.rope_scaling\.factor must be a number"),
    ({**LLAMA31, "low_freq_factor": 4, "high_freq_factor": 1}, r"model\.rope_scaling\.low_freq_factor = 4\.0"),
    ({**LLAMA31, "factor": 0.5}, r"model\.rope_scaling\.factor must be >= 1"),
    ({**DEEPSEEK_V3, "original_max_position_embeddings": 4096.5}, r"model\.rope_scaling\.original_max_position"),
    ({**DEEPSEEK_V3, "rope_type": "llama3"}, r"model\.rope_scaling: type and rope_type disagree"),
    ("yarn", r"model\.rope_scaling must be a mapping with a type and its keys, or null"),
]


@pytest.mark.parametrize("name", ["llama", "moe"])
@pytest.mark.parametrize("bad,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_rope_scaling_names_the_key_and_the_options(name, bad, message):
    with pytest.raises(ValueError, match=message):
        models.get(name).Config.from_dict({"rope_scaling": bad})


def test_rope_type_is_accepted_for_type_and_null_keys_are_not_given():
    a = RopeScaling.from_dict({**{k: v for k, v in LLAMA31.items() if k != "type"}, "rope_type": "llama3"})
    b = RopeScaling.from_dict({**LLAMA31, "beta_fast": None})
    assert a == b == RopeScaling.from_dict(LLAMA31)
    assert a.to_dict() == {**LLAMA31, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
