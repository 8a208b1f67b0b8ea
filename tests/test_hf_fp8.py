"""FP8 block-quantized checkpoints (models/hf/): dequantized at load, each box read slice by slice.

The checkpoints are built here: random weights quantized per 128 x 128 block by the test's own
code (scale = amax / 448, fp8 = w / scale, weight_scale_inv = scale), as DeepSeek-V3 publishes
its weights, and the loaded parameters are compared with the test's own dequantization.
"""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from test_hf_import import _write, deepseek_hf_tensors, hf_deepseek_logits

from shardfn import models
from shardfn.core.pytree import flatten_with_paths
from shardfn.models import hf

FP8 = torch.float8_e4m3fn
BLOCK = 128
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
# dims over 128 so that weights have several blocks and a partial last block in each dim
MOE_FP8 = {"vocab_size": 64, "dim": 144, "n_layers": 3, "first_k_dense": 1, "n_heads": 2, "q_lora_rank": 136,
           "kv_lora_rank": 72, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "ffn_dim": 200,
           "n_experts": 4, "top_k": 2, "n_shared_experts": 1, "expert_ffn_dim": 136, "route_scale": 2.5}


def _cfg(**over):
    return models.get("moe").Config.from_dict({**MOE_FP8, **over})


def quantize(w):
    """``(fp8 [R, C], scale [ceil(R/128), ceil(C/128)])``: each 128 x 128 block divided by its amax / 448."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=FP8)
    s = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            scale = w[blk].abs().max() / 448.0
            q[blk] = (w[blk] / scale).to(FP8)
            s[i, j] = scale
    return q, s


def dequantize(q, s):
    """Block by block: the fp8 values in float32 times their block's scale."""
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            out[blk] = q[blk].to(torch.float32) * s[i, j]
    return out


def is_quantized(key):
    """DeepSeek-V3 keeps the embedding, head, norms, router and its bias in bf16; the projections are FP8."""
    return key.endswith("proj.weight")


def fp8_checkpoint(cfg, seed=0):
    """``(HF tensors as stored: FP8 + scales + bf16, the same dequantized in float32)``."""
    stored, plain = {}, {}
    for key, w in deepseek_hf_tensors(cfg, seed).items():
        if is_quantized(key):
            q, s = quantize(w)
            stored[key], stored[key + "_scale_inv"] = q, s
            plain[key] = dequantize(q, s)
        else:
            stored[key] = w.to(torch.bfloat16)
            plain[key] = stored[key].float()
    return stored, plain


def write_fp8(directory, cfg, shards=3, seed=0):
    stored, plain = fp8_checkpoint(cfg, seed)
    _write(directory, stored, shards=shards)
    (directory / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": cfg.dim,
                                                       "num_hidden_layers": cfg.n_layers,
                                                       "quantization_config": QUANT}))
    return stored, plain


# ----------------------------------------------------------------------------- tests


def test_quantizer_in_this_file_is_block_wise():
    w = torch.randn(200, 130)
    q, s = quantize(w)
    assert q.dtype == FP8 and s.shape == (2, 2)
    assert s[1, 1] == w[128:, 128:].abs().max() / 448
    torch.testing.assert_close(dequantize(q, s), w, rtol=0.07, atol=1e-4)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_checkpoint_loads_as_its_dequantization(tmp_path, dtype):
    cfg = _cfg()
    stored, plain = write_fp8(tmp_path / "fp8", cfg)
    assert stored["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (2, 2)
    params = hf.load(tmp_path / "fp8", "moe", cfg, dtype=dtype)
    expected = hf.from_hf(plain, "moe", cfg, dtype=dtype)   # the plain (already tested) path
    for (p1, a), (p2, b) in zip(flatten_with_paths(params), flatten_with_paths(expected)):
        assert p1 == p2 and a.dtype == dtype and torch.equal(a, b), p1
    torch.testing.assert_close(params["moe_layers"]["experts"]["w2"][1, 3],
                               plain["model.layers.2.mlp.experts.3.down_proj.weight"].T.to(dtype), rtol=0, atol=0)
    if dtype == torch.float32:
        tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(models.get("moe").apply(params, tokens, cfg), hf_deepseek_logits(plain, tokens, cfg),
                                   rtol=1e-4, atol=1e-4)


def _bytes(rows, cols, itemsize=1, scale_rows=None, scale_cols=None):
    """Bytes of a ``rows x cols`` window (and of its ``scale_rows x scale_cols`` float32 scales)."""
    return rows * cols * itemsize + (scale_rows * scale_cols * 4 if scale_rows else 0)


# the boxes of our leaves, and what reading each costs, by hand: HF tensors are [out, in], ours [in, out]
REGIONS = {
    # ours [Lm, E, D=144, Fe=136]: layer 1, experts 2-3, our rows 0-71 = HF gate_proj [136, 144] columns 0-71
    "moe_layers.experts.w1": ((slice(1, 2), slice(2, 4), slice(0, 72)),
                              2 * _bytes(136, 72, 1, 2, 1), 2 * _bytes(136, 144, 1, 2, 2)),
    # ours [Lm, q_lora=136, H*(n+r)=48]: head 1's columns 24-47 = HF q_b_proj [48, 136] rows 24-47 (whole heads)
    "moe_layers.attn.wq_b": ((slice(0, 1), slice(None), slice(24, 48)), _bytes(24, 136, 1, 1, 2),
                             _bytes(48, 136, 1, 1, 2)),
    # half a head's columns: the rope rows are permuted within a head, so the whole head is read
    "dense_layers.attn.wq_b": ((slice(0, 1), slice(None), slice(30, 36)), _bytes(24, 136, 1, 1, 2),
                               _bytes(48, 136, 1, 1, 2)),
    # ours [Ld=1, F=200, D=144]: our rows 100-199 = HF down_proj [144, 200] columns 100-199 (scale columns 0-1)
    "dense_layers.mlp.w2": ((slice(None), slice(100, 200)), _bytes(144, 100, 1, 2, 2), _bytes(144, 200, 1, 2, 2)),
    # bf16, not quantized: columns 16-31 of [64, 144]
    "embed": ((slice(0, 64), slice(16, 32)), _bytes(64, 16, 2), _bytes(64, 144, 2)),
    # the router [E, D] (bf16) of MoE layer 0, our rows 128-143 = HF columns
    "moe_layers.router": ((slice(0, 1), slice(128, 144)), _bytes(4, 16, 2), _bytes(4, 144, 2)),
    "moe_layers.attn_norm": ((slice(0, 2), slice(8, 16)), 2 * _bytes(1, 8, 2), 2 * _bytes(1, 144, 2)),
}


def test_regions_read_only_their_rows_and_columns(tmp_path):
    cfg = _cfg()
    stored, plain = write_fp8(tmp_path / "fp8", cfg)
    full = dict(flatten_with_paths(hf.from_hf(plain, "moe", cfg)))
    tensors = hf.read_dir(tmp_path / "fp8")
    regions = {p: box for p, (box, _, _) in REGIONS.items()}
    got = hf.from_hf(tensors, "moe", cfg, regions=regions)
    in_memory = hf.from_hf(stored, "moe", cfg, regions=regions)   # a plain mapping: sliced after reading
    for path, (box, _, _) in REGIONS.items():
        assert torch.equal(got[path], full[path][box]) and torch.equal(in_memory[path], got[path]), path
    read, whole = (sum(r[i] for r in REGIONS.values()) for i in (1, 2))
    assert tensors.bytes_read == read
    print(f"\nbytes read for {len(REGIONS)} regions: {read} of the {whole} their HF tensors hold "
          f"({read / whole:.2f})")
    for path, (box, part, total) in REGIONS.items():
        print(f"  {path:24s} {part:6d} of {total:6d} bytes")
    assert read < 0.5 * whole


def test_strided_boxes_are_read_whole_and_sliced_after(tmp_path):
    cfg = _cfg()
    _, plain = write_fp8(tmp_path / "fp8", cfg, shards=1)
    full = dict(flatten_with_paths(hf.from_hf(plain, "moe", cfg)))
    box = (slice(None), slice(0, 136, 3), slice(1, 48, 5))
    got = hf.load(tmp_path / "fp8", "moe", cfg, regions={"moe_layers.attn.wq_b": box})
    assert torch.equal(got["moe_layers.attn.wq_b"], full["moe_layers.attn.wq_b"][box])


def test_fp8_errors_name_the_key(tmp_path):
    cfg = _cfg()
    stored, _ = fp8_checkpoint(cfg)
    key = "model.layers.1.self_attn.o_proj.weight"
    no_scale = {k: v for k, v in stored.items() if k != key + "_scale_inv"}
    with pytest.raises(ValueError, match=rf"{key} is torch.float8_e4m3fn but the checkpoint has no "
                                         rf"{key}_scale_inv to dequantize it with"):
        hf.from_hf(no_scale, "moe", cfg)
    wrong = {**stored, key + "_scale_inv": torch.ones(3, 3)}
    with pytest.raises(ValueError, match=rf"{key}_scale_inv has shape \(3, 3\), but {key} \[144, 32\] in blocks "
                                         r"of \[128, 128\] needs \(2, 1\)"):
        hf.from_hf(wrong, "moe", cfg)
    norm = "model.layers.0.input_layernorm.weight"
    with pytest.raises(ValueError, match=rf"{norm}_scale_inv is a block scale for {norm}, which is torch.bfloat16, "
                                         r"not FP8"):
        hf.from_hf({**stored, norm + "_scale_inv": torch.ones(1, 2)}, "moe", cfg)
    past = "model.layers.3.self_attn.o_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=r"unknown tensor model\.layers\.3\.self_attn\.o_proj\.weight_scale_inv: .*"
                                         r"its layer 3 is past model\.n_layers=3; a multi-token-prediction layer "
                                         r"loads with model\.mtp_depth=1"):
        hf.from_hf({**stored, past: torch.ones(2, 1)}, "moe", cfg)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "gptq", "bits": 4}, r"quantization_config\.quant_method 'gptq' is not read"),
    ({**QUANT, "fmt": "e5m2"}, r"quantization_config\.fmt 'e5m2' is not read"),
    ({**QUANT, "weight_block_size": [128]}, r"weight_block_size must be two positive ints"),
])
def test_quantization_configs_that_are_not_read_are_refused(tmp_path, quant, message):
    cfg = _cfg()
    write_fp8(tmp_path / "q", cfg, shards=1)
    (tmp_path / "q" / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": quant}))
    with pytest.raises(ValueError, match=message):
        hf.load(tmp_path / "q", "moe", cfg)


def test_weight_block_size_from_config_json(tmp_path):
    cfg = _cfg()
    _, plain = write_fp8(tmp_path / "b", cfg, shards=1)   # quantized in 128 x 128 blocks
    (tmp_path / "b" / "config.json").write_text(json.dumps({"quantization_config": {**QUANT,
                                                                                     "weight_block_size": [64, 64]}}))
    with pytest.raises(ValueError, match=r"in blocks of \[64, 64\] needs \(3, 3\); check "
                                         r"quantization_config\.weight_block_size"):
        hf.load(tmp_path / "b", "moe", cfg)
    assert hf.hf_fp8_block({"quantization_config": QUANT}) == (128, 128) and hf.hf_fp8_block({}) is None


PEAK = textwrap.dedent("""
    import json, sys, torch
    from shardfn import models
    from shardfn.models import hf

    def status():
        lines = [l.split() for l in open("/proc/self/status") if l.startswith(("VmRSS", "VmHWM"))]
        return {l[0][:-1]: int(l[1]) * 1024 for l in lines}

    directory, experts = sys.argv[1], int(sys.argv[2])
    cfg = models.get("moe").Config.from_dict(json.loads(sys.argv[3]))
    paths = [p for p in ("moe_layers.experts.w1", "moe_layers.experts.w2", "moe_layers.experts.w3")]
    regions = {p: (slice(None), slice(0, experts)) for p in paths}
    tensors = hf.read_dir(directory)
    hf.from_hf(tensors, "moe", cfg, regions={"moe_layers.experts.w1": (slice(0, 1), slice(0, 1))})  # warm up
    tensors.bytes_read = 0
    open("/proc/self/clear_refs", "w").write("5")   # the peak RSS starts again from the current RSS
    before = status()["VmRSS"]
    got = hf.from_hf(tensors, "moe", cfg, regions=regions)
    built = sum(x.numel() * x.element_size() for x in got.values())
    print(json.dumps({"peak": status()["VmHWM"] - before, "built": built, "read": tensors.bytes_read}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc/self/status")
def test_peak_memory_of_an_expert_parallel_rank_is_its_share(tmp_path):
    """One ``ep``-rank's experts (a quarter) of a 3-shard FP8 checkpoint: peak RSS over the load vs all experts."""
    over = {"dim": 256, "n_experts": 16, "expert_ffn_dim": 256, "q_lora_rank": 128, "kv_lora_rank": 64,
            "ffn_dim": 256}
    cfg = _cfg(**over)
    write_fp8(tmp_path / "big", cfg, shards=3)

    def run(experts):
        out = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "big"), str(experts),
                              json.dumps({**MOE_FP8, **over})], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    quarter, whole = run(4), run(16)
    print(f"\npeak RSS over the load: 4 of 16 experts {quarter['peak'] / 2**20:.1f} MiB (built "
          f"{quarter['built'] / 2**20:.1f} MiB float32, read {quarter['read'] / 2**20:.1f} MiB); 16 of 16 "
          f"{whole['peak'] / 2**20:.1f} MiB (built {whole['built'] / 2**20:.1f} MiB, read "
          f"{whole['read'] / 2**20:.1f} MiB)")
    assert whole["built"] == 4 * quarter["built"] == 2 * 16 * 3 * 256 * 256 * 4
    assert quarter["read"] * 4 == whole["read"]
    assert quarter["peak"] < 0.5 * whole["peak"]
    assert whole["peak"] < 2 * whole["built"]   # the float32 leaves plus one HF tensor's part at a time
