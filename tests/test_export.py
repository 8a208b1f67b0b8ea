"""``shardfn export`` (cli/export.py) and ``checkpoint.load_params``: a checkpoint saved on one
device, on an fsdp mesh or by pipeline ranks becomes a Hugging Face directory that ``hf.load``
reads back bitwise, in one process; its mistakes are one line and exit code 2."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardfn import cli, models
from shardfn.config import load_config
from shardfn.core.pytree import flatten_with_paths
from shardfn.models import hf
from shardfn.runtime import checkpoint as ck
from shardfn.runtime.launch import spawn
from shardfn.runtime.train import train
from shardfn.runtime.train_step import make_optimizer

SMALL = ["train.batch_size=4", "train.seq_len=16", "model.n_layers=1", "train.steps=2", "train.log_every=1000",
         "train.warmup_steps=2"]


def _cfg(overrides=()):
    return load_config("llama_tiny", [*SMALL, *overrides])


def _assert_trees_equal(a, b):
    fa, fb = flatten_with_paths(a), flatten_with_paths(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        assert x.dtype == y.dtype and torch.equal(x, y), path


def _saved_params(path, cfg):
    """The checkpoint's parameters through ``load_checkpoint`` (the loader a resumed run uses)."""
    model = models.get(cfg.model_name)
    like = model.init(cfg.model, cfg.train.seed + 1)
    return ck.load_checkpoint(path, like, make_optimizer(cfg.train, model).init(like)).params


def _export(*args):
    return cli.main(["export", *map(str, args)])


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _train_rank(overrides):
    from shardfn.runtime.partitioned import full

    return full(train(load_config("llama_tiny", overrides), log=lambda _: None).params)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """A one-device run of 2 steps saving after each: ``(cfg, directory, final params)``."""
    d = tmp_path_factory.mktemp("one") / "ckpt"
    cfg = _cfg(["train.checkpoint.every=1", f"train.checkpoint.dir={d}"])
    return cfg, d, train(cfg, log=lambda _: None).params


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """The same run on 2 gloo ranks with mesh.fsdp=2: ``(cfg, directory, final params gathered)``."""
    d = tmp_path_factory.mktemp("fsdp2") / "ckpt"
    overrides = [*SMALL, "mesh.fsdp=2", "train.checkpoint.every=2", f"train.checkpoint.dir={d}"]
    out = spawn(_train_rank, 2, args=(overrides,), timeout_s=600)
    return load_config("llama_tiny", overrides), d, out[0]


# ----------------------------------------------------------------------------- round trips


def test_one_device_checkpoint_exports_and_loads_back_bitwise(one_device, tmp_path, capsys):
    cfg, d, final = one_device
    out = tmp_path / "hf"
    assert _export("--checkpoint", d, "--out", out) == 0  # a checkpoint directory: its newest step
    said = capsys.readouterr().out
    assert f"exported {d / 'step_00000002'} (step 2, llama" in said and "model.safetensors, config.json" in said
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name != "hf"], "nothing is left beside --out"
    loaded = hf.load(out, "llama", cfg.model)
    _assert_trees_equal(loaded, _saved_params(d / "step_00000002", cfg))
    _assert_trees_equal(loaded, final)
    config = json.loads((out / "config.json").read_text())
    hf.check_hf_config(config, "llama", cfg.model)  # passes: the run's own model
    assert config["torch_dtype"] == "float32" and config["num_hidden_layers"] == 1
    with pytest.raises(ValueError, match="num_hidden_layers=1 but model.n_layers=2"):
        hf.check_hf_config(config, "llama", load_config("llama_tiny").model)


def test_a_step_directory_exports_that_step(one_device, tmp_path):
    cfg, d, _ = one_device
    assert _export("--checkpoint", d / "step_00000001", "--out", tmp_path / "hf") == 0
    step1 = _saved_params(d / "step_00000001", cfg)
    _assert_trees_equal(hf.load(tmp_path / "hf", "llama", cfg.model), step1)
    assert not torch.equal(step1["embed"], _saved_params(d / "step_00000002", cfg)["embed"])


def test_fsdp2_checkpoint_exports_what_the_one_device_export_of_its_parameters_is(fsdp2, tmp_path):
    cfg, d, final = fsdp2
    path = d / "step_00000002"
    assert ck.read_meta(path)["world_size"] == 2 and len(list(path.glob("*.distcp"))) == 2  # each rank's shards
    assert _export("--checkpoint", d, "--out", tmp_path / "from_fsdp2") == 0
    saved = _saved_params(path, cfg)
    _assert_trees_equal(hf.load(tmp_path / "from_fsdp2", "llama", cfg.model), saved)
    _assert_trees_equal(saved, final)
    # the same parameters saved by one device, then exported: the same files, byte for byte
    model = models.get(cfg.model_name)
    one = ck.save_checkpoint(tmp_path / "one", 2, saved, make_optimizer(cfg.train, model).init(saved),
                             config=_cfg().to_dict())
    assert _export("--checkpoint", one, "--out", tmp_path / "from_one") == 0
    assert _files(tmp_path / "from_fsdp2") == _files(tmp_path / "from_one")


def _pipeline_rank(overrides):
    train(load_config("llama_tiny", overrides), log=lambda _: None)


@pytest.mark.slow  # the fsdp2 export test holds the sharded-checkpoint export in the default suite
def test_pipeline_checkpoint_exports_bitwise(tmp_path):
    d = tmp_path / "ckpt"
    overrides = [*SMALL, "model.n_layers=2", "mesh.pp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2",
                 "train.checkpoint.every=2", f"train.checkpoint.dir={d}"]
    spawn(_pipeline_rank, 2, args=(overrides,), timeout_s=600)
    cfg, path = load_config("llama_tiny", overrides), d / "step_00000002"
    chunks = dcp_chunks(path, "params.layers.attn.wq")
    assert sorted(c.offsets[0] for c in chunks) == [0, 1], "each stage saved its own layer"
    assert _export("--checkpoint", d, "--out", tmp_path / "hf") == 0
    _assert_trees_equal(hf.load(tmp_path / "hf", "llama", cfg.model), _saved_params(path, cfg))


def dcp_chunks(path, key):
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata[key].chunks


def test_dtype_and_shards(one_device, tmp_path, capsys):
    cfg, d, final = one_device
    out = tmp_path / "hf"
    assert _export("--checkpoint", d, "--out", out, "--dtype", "bfloat16", "--max-shard-bytes", "64KiB") == 0
    assert "safetensors files, model.safetensors.index.json, config.json" in capsys.readouterr().out
    index = json.loads((out / hf.INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert all(p.stat().st_size <= (64 << 10) + (1 << 10) for p in out.glob("*.safetensors"))  # + the header
    half = {path: x.to(torch.bfloat16) for path, x in flatten_with_paths(final)}
    loaded = hf.load(out, "llama", cfg.model, dtype=torch.bfloat16)
    assert all(torch.equal(x, half[path]) and x.dtype == torch.bfloat16 for path, x in flatten_with_paths(loaded))
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    hf.check_hf_config(config, "llama", cfg.model)


def test_load_params_reads_whole_tensors_into_a_meta_tree(one_device):
    cfg, d, final = one_device
    like = models.get("llama").init(cfg.model, 0, device="meta")
    params = ck.load_params(ck.latest_checkpoint(d), like, config=cfg.to_dict())
    _assert_trees_equal(params, final)
    assert all(x.is_meta for _, x in flatten_with_paths(like)), "the like tree is not written into"
    other = load_config("llama_tiny", [*SMALL[:2], "model.n_layers=2"])
    with pytest.raises(ValueError, match=r"'params.layers.attn.w.' has shape \(1, .*model.n_layers is 1 in the "
                                         r"checkpoint and 2 here"):
        ck.load_params(ck.latest_checkpoint(d), models.get("llama").init(other.model, 0, device="meta"),
                       config=other.to_dict())


def test_config_agreeing_with_the_checkpoint_is_accepted(one_device, tmp_path):
    cfg, d, final = one_device
    assert _export("--config", "llama_tiny", "--checkpoint", d, "--out", tmp_path / "a", "model.n_layers=1") == 0
    _assert_trees_equal(hf.load(tmp_path / "a", "llama", cfg.model), final)
    assert _export("--checkpoint", d, "--out", tmp_path / "b", "train.lr=0.5", "mesh.fsdp=2") == 0  # not the model


def test_a_checkpoint_saved_without_its_config_needs_one(one_device, tmp_path, capsys):
    cfg, _, final = one_device
    model = models.get("llama")
    bare = ck.save_checkpoint(tmp_path / "bare", 2, final, make_optimizer(cfg.train, model).init(final))
    assert _export("--checkpoint", bare, "--out", tmp_path / "a") == 2
    assert "records no config" in capsys.readouterr().err
    assert _export("--config", "llama_tiny", "--checkpoint", bare, "--out", tmp_path / "a", "model.n_layers=1") == 0
    _assert_trees_equal(hf.load(tmp_path / "a", "llama", cfg.model), final)


# ----------------------------------------------------------------------------- mistakes


def _broken(d: Path, tmp: Path, how: str) -> Path:
    """A copy of the run's checkpoint directory spoiled ``how``; the path to give --checkpoint."""
    copy = tmp / "copy"
    shutil.copytree(d, copy)
    if how == "tmp":
        shutil.copytree(copy / "step_00000002", copy / "step_00000003.tmp")
        return copy / "step_00000003.tmp"
    if how == "no_marker":
        (copy / "step_00000002" / ck.MARKER).unlink()
        return copy / "step_00000002"
    if how == "only_tmp":
        for p in copy.iterdir():
            p.rename(p.with_name(p.name + ".tmp"))
        return copy
    raise AssertionError(how)


@pytest.mark.parametrize("args,names", [
    (["--checkpoint", "{tmp}/missing"], "{tmp}/missing: no such directory"),
    (["--checkpoint", "{tmp}"], "is not a checkpoint: it holds no step_N directory"),
    (["--checkpoint", "{d}/step_00000001/meta.json"], "is a file"),
    (["--checkpoint", "{broken:tmp}"], "is an incomplete save (a .tmp directory"),
    (["--checkpoint", "{broken:no_marker}"], "is an incomplete save (no COMPLETE marker"),
    (["--checkpoint", "{broken:only_tmp}"], "only incomplete saves (step_00000001.tmp, step_00000002.tmp)"),
    (["--checkpoint", "{d}", "--config", "llama_tiny"],
     "holds another model: model.n_layers is 1 in the checkpoint and 2 in --config llama_tiny"),
    (["--checkpoint", "{d}", "model.dim=32"], "model.dim is 64 in the checkpoint and 32 in the overrides"),
    (["--checkpoint", "{d}", "model.n_layerz=2"], "model.n_layerz"),
    (["--checkpoint", "{d}", "--config", "nope.yaml"], "config file 'nope.yaml' not found"),
    (["--checkpoint", "{d}", "--max-shard-bytes", "lots"], "--max-shard-bytes: cannot read 'lots' as a size"),
    (["--checkpoint", "{d}", "--max-shard-bytes", "0"], "--max-shard-bytes must be at least 1 byte"),
], ids=["missing", "not_a_checkpoint", "a_file", "tmp", "no_marker", "only_tmp", "config", "override",
        "unknown_key", "no_config_file", "shard_size", "zero_shard_size"])
def test_mistakes_are_one_line_and_exit_2(one_device, tmp_path, capsys, args, names):
    _, d, _ = one_device
    fill = {"{tmp}": str(tmp_path), "{d}": str(d)}
    for how in ("tmp", "no_marker", "only_tmp"):
        if any(f"{{broken:{how}}}" in a for a in args):
            fill[f"{{broken:{how}}}"] = str(_broken(d, tmp_path, how))

    def filled(a):
        for k, v in fill.items():
            a = a.replace(k, v)
        return a

    args = [filled(a) for a in args]
    out = tmp_path / "out"
    assert _export(*args, "--out", out) == 2
    err = capsys.readouterr().err
    assert names.replace("{tmp}", str(tmp_path)) in err
    assert err.startswith("shardfn export: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_an_incomplete_save_names_the_newest_complete_one(one_device, tmp_path, capsys):
    _, d, _ = one_device
    assert _export("--checkpoint", _broken(d, tmp_path, "tmp"), "--out", tmp_path / "out") == 2
    assert f"the newest complete one there is {tmp_path / 'copy' / 'step_00000002'}" in capsys.readouterr().err


def test_out_must_be_new_or_empty(one_device, tmp_path, capsys):
    cfg, d, final = one_device
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert _export("--checkpoint", d, "--out", tmp_path / "full") == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    assert _export("--checkpoint", d, "--out", tmp_path / "empty") == 0
    _assert_trees_equal(hf.load(tmp_path / "empty", "llama", cfg.model), final)
    assert _export("--checkpoint", d, "--out", tmp_path / "new" / "nested") == 0  # parents made


def test_bad_dtype_and_missing_flags_are_usage_errors():
    for argv in (["export", "--checkpoint", "x", "--out", "y", "--dtype", "float16"], ["export", "--out", "y"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2


def test_cli_doc_export_usage_lists_every_option():
    import argparse

    from shardfn.cli.main import SUBCOMMANDS, _resolve

    doc = (Path(cli.__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    usage = next(line for line in doc.splitlines() if line.startswith("## `shardfn export"))
    parser = argparse.ArgumentParser()
    _resolve(SUBCOMMANDS["export"].add_arguments)(parser)
    options = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options and all(o in usage for o in options), (options, usage)
