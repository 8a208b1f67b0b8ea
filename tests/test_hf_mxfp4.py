"""gpt-oss's MXFP4 expert weights dequantized at load (models/mxfp4.py, models/hf/), against
transformers' own dequantization (``transformers.integrations.mxfp4.convert_moe_packed_tensors``).

A tiny transformers gpt-oss model's experts are quantized here by the format (32 values of a row
share an e8m0 power of two; each value the nearest FP4 e2m1 code, two codes a byte, low nibble
first), written as ``*_blocks`` / ``*_scales`` safetensors beside the rest, and loaded.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardfn import models
from shardfn.models import hf, mxfp4

transformers = pytest.importorskip("transformers")
reference = pytest.importorskip("transformers.integrations.mxfp4")

OURS = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
        "expert_ffn_dim": 32, "n_experts": 4, "top_k": 2, "sliding_window": 4, "norm_eps": 1e-6}


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 ``(blocks [E, R, G, 16], scales [E, R, G])`` of a stored ``[E, R, G * 32]`` matrix."""
    groups = w.reshape(*w.shape[:-1], -1, 32)                                      # [E, R, G, 32]
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0))  # the max fits 6
    lut = torch.tensor(mxfp4.FP4_VALUES)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)           # the nearest e2m1 value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + mxfp4.SCALE_BIAS).to(torch.uint8)


def _quantized_checkpoint(tmp_path):
    """A tiny gpt-oss checkpoint whose experts are MXFP4, and transformers' dequantization of them."""
    hf_cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=4, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").save_pretrained(tmp_path)
    tensors, expected = load_file(tmp_path / "model.safetensors"), {}
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        w = tensors.pop(key)                                                        # [E, in, out]
        blocks, scales = quantize(w.transpose(1, 2) * 20)                           # stored [E, out, in]
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        expected[key] = reference.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert 0 < (expected[key] - w * 20).abs().max() < 0.3 * (w * 20).abs().max()  # lossy, but close
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                           "model.layers.*.mlp.router"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return expected


def test_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path):
    expected = _quantized_checkpoint(tmp_path)
    cfg = models.get("gpt_oss").Config.from_dict(OURS)
    params = hf.load(tmp_path, "gpt_oss", cfg)
    for i in range(2):
        key = f"model.layers.{i}.mlp.experts"
        assert torch.equal(params["layers"]["experts"]["w13"][i], expected[f"{key}.gate_up_proj"])
        assert torch.equal(params["layers"]["experts"]["w2"][i], expected[f"{key}.down_proj"])
    box = {"layers.experts.w13": (slice(1, 2), slice(2, 4), slice(0, 32), slice(16, 64)),
           "layers.experts.w2": (slice(0, 2), slice(1, 3))}                         # a rank's experts and columns
    part = hf.load(tmp_path, "gpt_oss", cfg, regions=box)
    assert torch.equal(part["layers.experts.w13"], params["layers"]["experts"]["w13"][box["layers.experts.w13"]])
    assert torch.equal(part["layers.experts.w2"], params["layers"]["experts"]["w2"][0:2, 1:3])


def test_half_an_mxfp4_pair_is_named(tmp_path):
    _quantized_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.experts\.down_proj: the checkpoint "
                                         r"has model\.layers\.1\.mlp\.experts\.down_proj_blocks but not the other "
                                         r"half of its MXFP4 pair .*down_proj_scales, uint8 e8m0 scales\)"):
        hf.load(tmp_path, "gpt_oss", models.get("gpt_oss").Config.from_dict(OURS))


def test_dequantize_reads_low_nibble_first_and_e8m0_scales():
    blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)                # codes 1 (0.5) then 2 (1.0)
    out = mxfp4.dequantize(blocks, torch.tensor([[130]], dtype=torch.uint8))       # times 2 ** 3
    assert out.shape == (32, 1) and out[:3, 0].tolist() == [4.0, 8.0, 0.0]
    with pytest.raises(ValueError, match=r"MXFP4 needs uint8 blocks .* got blocks torch\.float32"):
        mxfp4.dequantize(blocks.float(), torch.tensor([[130]], dtype=torch.uint8))
