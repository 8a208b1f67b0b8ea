"""DeepSeek-V3's multi-token prediction (models/moe.py ``mtp_depth``; models/hf/ layers n_layers..):
against an HF-convention reference forward, through HF files and FP8, and in the parameter counts."""

import json

import pytest
import torch
import torch.nn.functional as F
from test_hf_fp8 import fp8_checkpoint
from test_hf_import import MOE, _tokens, _write, deepseek_hf_tensors, hf_deepseek_logits
from test_models import BIG, config_file

from shardfn import cli, models
from shardfn.core.pytree import flatten_with_paths
from shardfn.core.transforms import value_and_grad
from shardfn.models import hf

moe = models.get("moe")


def _cfg(**over):
    return moe.Config.from_dict({**MOE, "mtp_depth": 1, **over})


def reference_loss(sd, tokens, targets, cfg):
    """Main cross-entropy + lambda * mean over depths of each depth's cross-entropy against targets[:, k:]."""
    logits, depths = hf_deepseek_logits(sd, tokens, cfg, mtp=True)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    per_depth = [F.cross_entropy(x.reshape(-1, x.shape[-1]), targets[:, k:].reshape(-1))
                 for k, x in enumerate(depths, 1)]
    return ce + cfg.mtp_loss_weight * sum(per_depth) / len(per_depth), ce, per_depth


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_forward_and_loss_match_an_hf_convention_reference(depth):
    cfg = _cfg(mtp_depth=depth)
    sd = deepseek_hf_tensors(cfg)
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.mlp.experts.3.down_proj.weight"} <= set(sd)
    params = hf.from_hf(sd, "moe", cfg)
    tokens = _tokens()
    targets = torch.roll(tokens, -1, 1)
    logits, depths, aux = moe.apply_with_mtp(params, tokens, cfg)
    ref_logits, ref_depths = hf_deepseek_logits(sd, tokens, cfg, mtp=True)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert [x.shape for x in depths] == [(2, 12 - k, 64) for k in range(1, depth + 1)]
    for ours, ref in zip(depths, ref_depths):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(moe.apply(params, tokens, cfg), ref_logits, rtol=1e-4, atol=1e-4)  # MTP skipped

    value, aux = moe.loss_and_aux(params, {"inputs": tokens, "targets": targets}, cfg)
    ref_value, ref_ce, ref_depth_ce = reference_loss(sd, tokens, targets, cfg)
    torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux["ce_loss"], ref_ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux["mtp_loss"], torch.stack(ref_depth_ce).mean(), rtol=1e-5, atol=1e-5)
    assert aux["mtp_expert_counts"].shape == (depth, cfg.n_experts)
    routed = torch.tensor([2 * (12 - k) * cfg.top_k for k in range(1, depth + 1)])  # B * (S - k) tokens, top_k each
    assert torch.equal(aux["mtp_expert_counts"].sum(-1), routed)


def test_mtp_loss_weight_and_gradients():
    cfg = _cfg(mtp_loss_weight=0.1, aux_loss_alpha=0.01)
    params = moe.init(cfg, seed=0)
    tokens = _tokens()
    batch = {"inputs": tokens, "targets": torch.roll(tokens, -1, 1)}
    (value, aux), grads = value_and_grad(moe.loss_and_aux, has_aux=True)(params, batch, cfg)
    main_balance = moe.apply_with_aux(params, tokens, cfg)[1]["balance_loss"]
    assert aux["balance_loss"] > main_balance > 0   # the MTP layer's balance loss is added
    torch.testing.assert_close(value, aux["ce_loss"] + aux["balance_loss"] + 0.1 * aux["mtp_loss"])
    for path in ("mtp.eh_proj", "mtp.enorm", "mtp.block.attn.wq_a", "mtp.block.experts.w1", "mtp.block.router"):
        assert dict(flatten_with_paths(grads))[path].abs().sum() > 0, path
    # the main model gets the MTP loss's gradient too (through the embedding and its hidden state)
    zero = _cfg(mtp_loss_weight=0.0, aux_loss_alpha=0.01)
    (no_mtp, _), zero_grads = value_and_grad(moe.loss_and_aux, has_aux=True)(params, batch, zero)
    torch.testing.assert_close(value - no_mtp, 0.1 * aux["mtp_loss"])
    for path in ("embed", "moe_layers.attn.wq_a", "dense_layers.mlp.w1"):
        assert not torch.equal(dict(flatten_with_paths(grads))[path], dict(flatten_with_paths(zero_grads))[path])
    biased = moe.aux_update(params, aux, cfg)
    assert not torch.equal(biased["mtp"]["block"]["router_bias"], params["mtp"]["block"]["router_bias"])
    assert "expert_load_max_over_mean/mtp1" in moe.aux_metrics(aux)
    assert "mtp.block.router_bias" in moe.FROZEN


def test_mtp_params_and_config():
    cfg = _cfg(mtp_depth=2)
    params = moe.init(cfg, seed=0, device="meta")
    mtp = dict(flatten_with_paths(params["mtp"]))
    assert mtp["eh_proj"].shape == (2, 64, 32) and mtp["block.experts.w1"].shape == (2, 4, 32, 16)
    assert moe.param_axes(cfg)["mtp"]["eh_proj"] == ("layers", None, "embed")
    assert moe.stacks(cfg) == [("dense_layers", 1), ("moe_layers", 2)]
    without = moe.init(_cfg(mtp_depth=0), seed=0)
    assert "mtp" not in without
    with_mtp = moe.init(_cfg(), seed=0)
    for path, x in flatten_with_paths(without):  # adding the MTP module draws no other value differently
        assert torch.equal(x, dict(flatten_with_paths(with_mtp))[path]), path
    with pytest.raises(ValueError, match=r"model\.mtp_depth must be >= 0, got -1"):
        _cfg(mtp_depth=-1)
    with pytest.raises(ValueError, match=r"model\.mtp_depth=2 needs sequences longer than 2 tokens .* got 2"):
        moe.apply_with_mtp(moe.init(cfg, 0), torch.zeros(1, 2, dtype=torch.long), cfg)


def test_mtp_round_trips_through_hf_files(tmp_path):
    cfg = _cfg(mtp_depth=1)
    params = moe.init(cfg, seed=3)
    hf.save(tmp_path / "out", params, "moe", cfg, max_shard_bytes=40_000)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1
    tensors = hf.read_dir(tmp_path / "out")
    assert torch.equal(tensors["model.layers.3.embed_tokens.weight"], params["embed"])        # copies HF keeps
    assert torch.equal(tensors["model.layers.3.shared_head.head.weight"], params["out"].T)
    assert torch.equal(tensors["model.layers.3.eh_proj.weight"], params["mtp"]["eh_proj"][0].T)
    assert set(tensors) == set(deepseek_hf_tensors(cfg))
    loaded = hf.load(tmp_path / "out", "moe", cfg)
    for (p1, a), (p2, b) in zip(flatten_with_paths(params), flatten_with_paths(loaded)):
        assert p1 == p2 and torch.equal(a, b), p1
    assert tensors.bytes_read > 0
    box = {"mtp.block.experts.w2": (slice(0, 1), slice(1, 2))}
    part = hf.load(tmp_path / "out", "moe", cfg, regions=box)
    assert torch.equal(part["mtp.block.experts.w2"], params["mtp"]["block"]["experts"]["w2"][:, 1:2])


def test_tied_mtp_head_copy_is_the_embedding(tmp_path):
    cfg = _cfg(tie_embeddings=True)
    params = moe.init(cfg, seed=1)
    hf.save(tmp_path / "tied", params, "moe", cfg)
    tensors = hf.read_dir(tmp_path / "tied")
    assert torch.equal(tensors["model.layers.3.shared_head.head.weight"], params["embed"])
    loaded = hf.load(tmp_path / "tied", "moe", cfg)
    assert torch.equal(loaded["mtp"]["norm"], params["mtp"]["norm"])


def test_mtp_layers_and_the_model_config_must_agree(tmp_path):
    cfg = _cfg()
    hf.save(tmp_path / "mtp", moe.init(cfg, seed=0), "moe", cfg)
    plain = _cfg(mtp_depth=0)
    with pytest.raises(ValueError, match=r"unknown tensor model\.layers\.3\..*its layer 3 is past model\.n_layers=3; "
                                         r"a multi-token-prediction layer loads with model\.mtp_depth=1"):
        hf.load(tmp_path / "mtp", "moe", plain)
    main = hf.load(tmp_path / "mtp", "moe", plain, ignore=["model.layers.3.*"])  # the main model alone
    assert "mtp" not in main
    hf.save(tmp_path / "plain", moe.init(plain, seed=0), "moe", plain)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=0 but model\.mtp_depth=1; override "
                                         r"model\.mtp_depth=0"):
        hf.load(tmp_path / "plain", "moe", cfg)


def test_fp8_checkpoint_with_an_mtp_layer(tmp_path):
    from test_hf_fp8 import _cfg as fp8_cfg

    cfg = fp8_cfg(mtp_depth=1)
    stored, plain = fp8_checkpoint(cfg)
    assert stored["model.layers.3.eh_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv" in stored
    _write(tmp_path / "fp8", stored, shards=2)
    loaded = hf.load(tmp_path / "fp8", "moe", cfg, hf_config=hf.hf_config("moe", cfg))  # no config.json: stated
    for (p1, a), (p2, b) in zip(flatten_with_paths(loaded), flatten_with_paths(hf.from_hf(plain, "moe", cfg))):
        assert p1 == p2 and torch.equal(a, b), p1


# ----------------------------------------------------------------------------- counts

DSV3 = BIG["deepseek_v3_671b"]
_ATTN = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
MTP_LAYER = _ATTN + 257 * 3 * 7168 * 2048 + 7168 * 256 + 256 + 2 * 7168   # one MoE decoder layer
MTP = MTP_LAYER + 2 * 7168 * 7168 + 3 * 7168                              # + eh_proj, enorm, hnorm, norm
COPIES = 2 * 129280 * 7168                                                # the embedding and head HF stores again


def test_shardfn_params_for_deepseek_v3_with_and_without_mtp(capsys):
    assert cli.main(["params", "--config", "deepseek_v3_671b", "--json"]) == 0
    assert tuple(json.loads(capsys.readouterr().out).values()) == DSV3          # mtp_depth 0: as before
    assert cli.main(["params", "--config", "deepseek_v3_671b", "--json", "model.mtp_depth=1"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert counts["total"] == DSV3[0] + MTP == 682_636_487_424
    active = _ATTN + 9 * 3 * 7168 * 2048 + 7168 * 256 + 256 + 2 * 7168 + 2 * 7168 * 7168 + 3 * 7168
    assert counts["active"] == DSV3[1] + active
    # DeepSeek-V3 publishes 685B on Hugging Face: 671B main + 14B MTP, counting the MTP's copies of
    # the embedding and head, which the module shares with the main model (and we count once)
    assert MTP + COPIES == pytest.approx(14e9, rel=0.05) and MTP + COPIES == 13_463_426_304
    assert DSV3[0] + MTP + COPIES == pytest.approx(685e9, rel=0.001)
    module, c = config_file("deepseek_v3_671b")
    assert c.mtp_depth == 0 and c.mtp_loss_weight == 0.3


def test_a_pipeline_refuses_mtp_naming_the_key(capsys):
    from shardfn import cli

    code = cli.main(["train", "--config", "moe_tiny", "--nproc", "2", "mesh.pp=2", "model.mtp_depth=1"])
    err = capsys.readouterr().err
    assert code == 2 and "model.mtp_depth: 1: the multi-token-prediction modules do not run in pipeline" in err
    assert "Traceback" not in err
