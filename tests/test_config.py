"""Run configs: YAML + dotted overrides -> typed dataclasses, with errors that name the key."""

import textwrap

import pytest

from shardfn import config as C


def _write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


MINIMAL = """
model:
  name: llama
  n_layers: 2
"""


def test_defaults_and_types(tmp_path):
    cfg = C.load_config(_write(tmp_path, MINIMAL))
    assert cfg.model_name == "llama" and cfg.model.n_layers == 2
    assert cfg.mesh.world_size == 1 and cfg.mesh.axes() == {"pp": 1, "dp": 1, "fsdp": 1, "ep": 1, "tp": 1}
    assert cfg.train == C.TrainConfig() and cfg.data.path is None
    assert cfg.rules == C.DEFAULT_RULES
    assert cfg.source == str(tmp_path / "run.yaml")


def test_file_values_and_yaml_float_forms(tmp_path):
    cfg = C.load_config(_write(tmp_path, MINIMAL + textwrap.dedent("""
    train:
      lr: 1e-3          # YAML 1.1 would read this as a string
      eps: 1.0e-8
      steps: 1e3        # an integral float is accepted for an int key
      grad_clip: null
      checkpoint: {every: 5, dir: ckpts}
    mesh: {dp: 2, tp: 2}
    partition: {memory_budget: 40GiB}
    """)))
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 1000 and isinstance(cfg.train.steps, int)
    assert cfg.train.grad_clip is None and cfg.train.checkpoint.every == 5 and cfg.train.checkpoint.dir == "ckpts"
    assert cfg.mesh.world_size == 4
    assert cfg.partition.memory_budget == 40 * 2**30


def test_overrides_are_yaml_scalars(tmp_path):
    cfg = C.load_config(_write(tmp_path, MINIMAL), [
        "train.steps=50", "model.n_layers=3", "train.lr=2e-4", "train.compile=true", "data.path=null",
        "rules.embed=[fsdp, dp]", "rules.mlp=null", "train.checkpoint.keep=4",
    ])
    assert cfg.train.steps == 50 and cfg.model.n_layers == 3 and cfg.train.lr == 2e-4
    assert cfg.train.compile is True and cfg.data.path is None and cfg.train.checkpoint.keep == 4
    assert cfg.rules["embed"] == ["fsdp", "dp"] and cfg.rules["mlp"] is None
    assert cfg.rules["heads"] == "tp"  # untouched rules keep their defaults


@pytest.mark.parametrize("override, key", [
    ("train.stepz=5", "train.stepz"),
    ("mesh.xp=2", "mesh.xp"),
    ("train.checkpoint.often=3", "train.checkpoint.often"),
    ("rules.embd=tp", "rules.embd"),
])
def test_unknown_override_key_names_it_and_lists_valid(tmp_path, override, key):
    with pytest.raises(ValueError, match=f"'{key}'") as e:
        C.load_config(_write(tmp_path, MINIMAL), [override])
    assert "valid" in str(e.value)


def test_unknown_key_in_file_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"'train\.batchsize'.*batch_size"):
        C.load_config(_write(tmp_path, MINIMAL + "train:\n  batchsize: 4\n"))
    with pytest.raises(ValueError, match=r"unknown config section 'trian'.*train"):
        C.load_config(_write(tmp_path, MINIMAL + "trian:\n  steps: 4\n"))
    with pytest.raises(ValueError, match="unknown config section 'optimizer'"):
        C.load_config(_write(tmp_path, MINIMAL), ["optimizer.lr=1"])


def test_bad_model_config_names_model_key(tmp_path):
    with pytest.raises(ValueError, match=r"model\.n_layerz"):
        C.load_config(_write(tmp_path, MINIMAL), ["model.n_layerz=2"])
    with pytest.raises(ValueError, match=r"model\.name"):
        C.load_config(_write(tmp_path, MINIMAL), ["model.name=gpt9"])


def test_bad_values_name_key_and_requirement(tmp_path):
    path = _write(tmp_path, MINIMAL)
    with pytest.raises(ValueError, match=r"train\.steps must be an int, got 'many'"):
        C.load_config(path, ["train.steps=many"])
    with pytest.raises(ValueError, match=r"train\.b2 must be in \[0, 1\)"):
        C.load_config(path, ["train.b2=1.0"])
    with pytest.raises(ValueError, match=r"mesh\.tp must be >= 1"):
        C.load_config(path, ["mesh.tp=0"])
    with pytest.raises(ValueError, match=r"partition\.ep_chunks must be an integer >= 1"):
        C.load_config(path, ["partition.ep_chunks=0"])
    with pytest.raises(ValueError, match=r"rules\.heads: unknown mesh axis 'xp'"):
        C.load_config(path, ["rules.heads=xp"])
    with pytest.raises(ValueError, match=r"train\.compile must be false, true, regional or whole, got .3."):
        C.load_config(path, ["train.compile=3"])
    with pytest.raises(ValueError, match="section.key=value"):
        C.load_config(path, ["steps=3"])
    with pytest.raises(ValueError, match=r"partition\.memory_budget.*40GiB"):
        C.load_config(path, ["partition.memory_budget=lots"])


def test_batch_must_split_over_data_parallel_axes(tmp_path):
    path = _write(tmp_path, MINIMAL)
    with pytest.raises(ValueError, match=r"train\.batch_size: 6 is not divisible by the data-parallel size .* = 4"):
        C.load_config(path, ["mesh.dp=2", "mesh.fsdp=2", "train.batch_size=6"])
    cfg = C.load_config(path, ["mesh.dp=2", "mesh.tp=2", "train.batch_size=6"])
    assert cfg.data_parallel_size == 2
    with pytest.raises(ValueError, match=r"pipeline\.microbatches: 4 does not divide the per-rank batch"):
        C.load_config(path, ["mesh.dp=2", "train.batch_size=12", "pipeline.microbatches=4"])


def test_to_dict_round_trips(tmp_path):
    cfg = C.load_config(_write(tmp_path, MINIMAL), ["train.steps=7", "mesh.dp=2"])
    again = C.config_from_dict(cfg.to_dict())
    assert again.train == cfg.train and again.mesh == cfg.mesh and again.model == cfg.model


def test_default_config_is_packaged_llama_tiny():
    assert C.DEFAULT_CONFIG.is_file(), "examples/configs/llama_tiny.yaml ships with the package"
    cfg = C.load_config()
    assert cfg.model_name == "llama" and cfg.source == str(C.DEFAULT_CONFIG)
    assert C.resolve_path("llama_tiny") == C.DEFAULT_CONFIG
    assert "llama_tiny" in C.available_configs()


def test_missing_config_lists_packaged_ones():
    with pytest.raises(FileNotFoundError, match="llama_tiny"):
        C.load_config("no_such_config")


def test_parse_helpers():
    assert C.parse_override("model.n_layers=2") == ("model.n_layers", 2)
    assert C.parse_override("data.path=a=b.txt") == ("data.path", "a=b.txt")
    assert C.parse_value("1e-3") == 1e-3 and C.parse_value("null") is None and C.parse_value("x: [") == "x: ["
    assert C.parse_bytes("1.5 GB") == 1_500_000_000 and C.parse_bytes("2KiB") == 2048


def test_config_doc_block_is_a_valid_config():
    import re
    from pathlib import Path

    import yaml

    doc = (Path(C.__file__).resolve().parent / "docs" / "config.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", doc, re.S).group(1)
    cfg = C.config_from_dict(yaml.load(block, Loader=C._Loader))
    assert cfg.train == C.load_config().train  # docs/config.md shows llama_tiny's train section


def test_auto_solver_keys(tmp_path):
    path = _write(tmp_path, MINIMAL)
    part = C.load_config(path).partition
    assert (part.auto_time_limit_s, part.auto_mip_gap, part.auto_hardware, part.auto_strict) == (10.0, 0.05, "h100",
                                                                                                   False)
    part = C.load_config(path, ["partition.auto=true", "partition.auto_time_limit_s=60", "partition.auto_mip_gap=0.01",
                                "partition.auto_hardware=h200", "partition.auto_strict=true"]).partition
    assert (part.auto_time_limit_s, part.auto_mip_gap, part.auto_hardware, part.auto_strict) == (60.0, 0.01, "h200",
                                                                                                   True)
    with pytest.raises(ValueError, match=r"partition\.auto_mip_gap must be >= 0 .*, got -0\.1"):
        C.load_config(path, ["partition.auto_mip_gap=-0.1"])
    with pytest.raises(ValueError, match=r"partition\.auto_time_limit_s must be > 0"):
        C.load_config(path, ["partition.auto_time_limit_s=0"])
    with pytest.raises(ValueError, match=r"partition\.auto_hardware must be one of \['a100'.*got 'h1000'"):
        C.load_config(path, ["partition.auto=true", "partition.auto_hardware=h1000"])
