"""A catalogue of wrong input at every public entry point, and the error each one gets.

One row per case: the input, the exception type, and a regex the message must match. Every
message names the cause (the key, value or mesh axis) and, where there is one, the fix. All
cases run in this process: meshes are fake (torch's fake process group), nothing is spawned.
"""

from __future__ import annotations

import json

import pytest
import torch

import shardfn as sf
from shardfn import P, cli
from shardfn.config import load_config

# ----------------------------------------------------------------------------- config values

# (override, message): keys, types and ranges not already pinned by tests/test_config.py
CONFIG_CASES = [
    ("rules.batch=[dp, dp]", r"rules\.batch names a mesh axis twice: \['dp', 'dp'\]"),
    ("rules.heads=3", r"rules\.heads must be a mesh axis name, a list of names, or null; got 3"),
    ("rules.layers=[pp, xp]", r"rules\.layers: unknown mesh axis 'xp'; valid mesh axes: pp, dp, fsdp, cp, ep, tp"),
    ("train.nonfinite=ignore", r"train\.nonfinite must be one of raise, skip, got 'ignore'"),
    ("train.grad_clip=0", r"train\.grad_clip must be > 0 or null, got 0\.0"),
    ("train.lr=-1", r"train\.lr must be >= 0, got -1\.0"),
    ("train.min_lr_ratio=2", r"train\.min_lr_ratio must be in \[0, 1\], got 2\.0"),
    ("train.eps=0", r"train\.eps must be > 0, got 0\.0"),
    ("train.b1=-0.5", r"train\.b1 must be in \[0, 1\), got -0\.5"),
    ("train.weight_decay=-0.1", r"train\.weight_decay must be >= 0, got -0\.1"),
    ("train.warmup_steps=-1", r"train\.warmup_steps must be >= 0, got -1"),
    ("train.seq_len=0", r"train\.seq_len must be >= 1, got 0"),
    ("train.steps=null", r"train\.steps must not be null; give an int"),
    ("train.checkpoint.keep=0", r"train\.checkpoint\.keep must be >= 1, got 0"),
    ("train.checkpoint.every=-1", r"train\.checkpoint\.every must be >= 0 \(0 disables\), got -1"),
    ("train.checkpoint=5", r"train\.checkpoint is a section \(keys: every, dir, keep, resume\), got 5"),
    ("train.steps.x=1", r"cannot override 'train\.steps\.x': 'train\.steps' is a value, not a section"),
    ("mesh=3", r"bad override 'mesh=3': write section\.key=value"),
    ("mesh.dp=2.5", r"mesh\.dp must be an int, got 2\.5 \(float\)"),
    ("mesh.dp=true", r"mesh\.dp must be an int, got True \(bool\)"),
    ("mesh.tp=-2", r"mesh\.tp must be >= 1, got -2"),
    ("data.path=[a]", r"data\.path must be a str or null, got \['a'\] \(list\)"),
    ("data.corpus_bytes=0", r"data\.corpus_bytes must be >= 1, got 0"),
    ("pipeline.microbatches=0", r"pipeline\.microbatches must be >= 1, got 0"),
    ("pipeline.stages=0", r"pipeline\.stages must be >= 1 or null, got 0"),
    ("pipeline.schedule=pipedream",
     r"pipeline\.schedule must be one of gpipe, 1f1b, interleaved_1f1b, zbh1, dualpipev, got 'pipedream'"),
    ("partition.memory_budget=0", r"partition\.memory_budget must be > 0 or null, got 0"),
    ("partition.auto=maybe", r"partition\.auto must be a bool, got 'maybe' \(str\)"),
    ("runtime.timeout_s=0", r"runtime\.timeout_s must be > 0, got 0\.0"),
    ("runtime.nproc=0", r"runtime\.nproc must be >= 1 or null, got 0"),
    ("runtime.threads=0", r"runtime\.threads must be >= 1 or null, got 0"),
    ("runtime.device=tpu", r"runtime\.device must be a torch device such as cpu, cuda or cuda:1, got 'tpu'"),
    ("model.dim=abc", r"model\.dim must be int, got str 'abc'"),
    ("model.n_layers=0", r"model\.n_layers must be >= 1, got 0"),
]


@pytest.mark.parametrize("override,message", CONFIG_CASES, ids=[o.split("=")[0] + "=" + o.split("=", 1)[-1][:12]
                                                                for o, _ in CONFIG_CASES])
def test_config_value(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_schedule_name_accepts_the_spelling_get_schedule_accepts():
    assert load_config(None, ["pipeline.schedule=interleaved-1f1b"]).pipeline.schedule == "interleaved-1f1b"


# (file text, message): whole files that are not run configs
CONFIG_FILE_CASES = {
    "a-list": ("- a\n- b\n", r"a run config is a mapping of sections \(model, mesh, .*\), got list"),
    "bad-yaml": ("model: {name: llama\n", r"bad\.yaml: not valid YAML"),
    "no-model-name": ("model: {dim: 64}\n", r"needs a model section with a name, e\.g\. `model: \{name: llama"),
    "empty": ("", r"needs a model section with a name.*got None"),
    "section-a-value": ("model: {name: llama}\nmesh: 4\n", r"config section 'mesh' must be a mapping of keys, got 4"),
}


@pytest.mark.parametrize("case", list(CONFIG_FILE_CASES))
def test_config_file(case, tmp_path):
    text, message = CONFIG_FILE_CASES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path)


# ----------------------------------------------------------------------------- meshes and specs

MESH_CASES = {
    "no-axes": ({}, ValueError, r"Mesh needs at least one axis, e\.g\. Mesh\(\{'dp': 1\}\)"),
    "size-0": ({"dp": 0}, ValueError, r"mesh axis 'dp' has size 0; sizes are positive integers"),
    "float-size": ({"dp": 2.0}, ValueError, r"mesh axis 'dp' has size 2\.0; sizes are positive integers"),
    "bad-name": ({"d-p": 2}, ValueError, r"mesh axis names are identifiers; got 'd-p'"),
}


@pytest.mark.parametrize("case", list(MESH_CASES))
def test_mesh(case, clean_process_group):
    axes, error, message = MESH_CASES[case]
    with pytest.raises(error, match=message):
        sf.Mesh(axes, fake=True)


@pytest.mark.parametrize("entries,message", [
    ((3,), r"P entries are None, an axis name or a tuple of axis names; got 3"),
    ((["dp", "tp"],), r"got \['dp', 'tp'\]"),
], ids=["int-entry", "list-entry"])
def test_partition_spec(entries, message):
    with pytest.raises(TypeError, match=message):
        P(*entries)


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    yield sf.Mesh({"dp": 2, "tp": 2}, fake=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _double(x):
    return x * 2


def _local_map_zz(x):
    return sf.local_map(_double, in_specs=(P("zz"),), out_specs=P("zz"))(x)


X = torch.zeros(4, 4)

# (fn, jit kwargs, args, error, message): sf.jit(fn, mesh, **kwargs).lower(*args)
JIT_CASES = {
    "spec-longer-than-tensor": (_double, dict(in_specs=P("dp", None, "tp")), (X,), ValueError,
                                r"input 0: spec P\('dp', None, 'tp'\) has 3 entries but the tensor has 2 dims"),
    "spec-a-bare-string": (_double, dict(in_specs="dp"), (X,), TypeError,
                           r"input 0: a spec is a P\(\.\.\.\) or None, got the string 'dp'; write P\('dp'\)"),
    "in_specs-longer-than-args": (torch.add, dict(in_specs=(P(), P(), P())), (X, X), ValueError,
                                  r"in_specs must be a pytree prefix of the arguments: tuple arity mismatch; "
                                  r"expected: 3, got: 2"),
    "in_specs-other-keys": (lambda p: p["w"] * 2, dict(in_specs=({"v": P()},)), ({"w": X},), ValueError,
                            r"in_specs must be a pytree prefix.*missing key\(s\): \['v'\], extra key\(s\): \['w'\]"),
    "two-axes-indivisible": (_double, dict(in_specs=P(("dp", "tp"))), (torch.zeros(6, 4),), ValueError,
                             r"input 0: dim 0 of size 6 is not divisible by mesh axes \('dp', 'tp'\) \(size 4\); "
                             r"pick a size that divides"),
    "out-unknown-axis": (_double, dict(in_specs=P(), out_specs=P("ep")), (X,), ValueError,
                         r"output 0 \(4, 4\): unknown mesh axis 'ep' in P\('ep'\); the mesh has axes \('dp', 'tp'\)"),
    "out-indivisible": (lambda x: x[:3] * 2, dict(in_specs=P(), out_specs=P("dp")), (X,), ValueError,
                        r"output 0 \(3, 4\): dim 0 of size 3 is not divisible by mesh axes \('dp',\) \(size 2\)"),
    "out-axes-out-of-order": (_double, dict(in_specs=P(), out_specs=P(("tp", "dp"))), (X,), ValueError,
                              r"output 0 \(4, 4\): the axes \('tp', 'dp'\) of dim 0 .* must follow the mesh order"),
    "python-int-argument": (torch.mul, dict(in_specs=(P(), P())), (X, 3), TypeError,
                            r"argument leaf '1' is a int; sf\.jit traces functions of pytrees of tensors "
                            r"\(close over Python values"),
    "constrain-unknown-axis": (lambda x: sf.constrain(x, P("zz")) * 2, dict(in_specs=P()), (X,), ValueError,
                               r"sf\.constrain at graph node 'constrain'.*unknown mesh axis 'zz' in P\('zz'\)"),
    "constrain-indivisible": (lambda x: sf.constrain(x[:3], P("dp")) * 2, dict(in_specs=P()), (X,), ValueError,
                              r"sf\.constrain at graph node .*dim 0 of size 3 is not divisible by mesh axes \('dp',\)"),
    "constrain-string-spec": (lambda x: sf.constrain(x, "dp") * 2, dict(in_specs=P()), (X,), TypeError,
                              r"sf\.constrain: a spec is a P\(\.\.\.\) or a pytree of them, got the string 'dp'; "
                              r"write P\('dp'\)"),
    "constrain-too-many-dims": (lambda x: sf.constrain(x, P("dp", None, "tp")), dict(in_specs=P()), (X,), ValueError,
                                r"sf\.constrain at graph node .*has 3 entries but the tensor has 2 dims"),
    "local_map-unknown-axis": (_local_map_zz, dict(in_specs=P()), (X,), ValueError,
                               r"sf\.local_map: unknown mesh axis 'zz' in P\('zz'\); the mesh has axes \('dp', 'tp'\)"),
}


@pytest.mark.parametrize("case", list(JIT_CASES))
def test_jit(case, mesh):
    fn, kwargs, args, error, message = JIT_CASES[case]
    with pytest.raises(error, match=message):
        sf.jit(fn, mesh, backend=None, **kwargs).lower(*args)


def test_jit_needs_a_mesh():
    with pytest.raises(TypeError, match=r"sf\.jit: mesh must be a shardfn\.Mesh, got dict \{'dp': 2\}; "
                                        r"build one with sf\.Mesh"):
        sf.jit(_double, {"dp": 2}, in_specs=P())


# ----------------------------------------------------------------------------- the command line

# (argv, message on stderr): every one exits 2, before anything is trained or spawned
CLI_CASES = {
    "nproc-not-mesh-size": (
        ["train", "--nproc", "3", "mesh.dp=2"],
        r"shardfn train: error: --nproc 3 but the mesh has 2 devices; make them equal",
    ),
    "runtime.nproc-not-mesh-size": (["train", "runtime.nproc=4", "mesh.dp=2"], r"--nproc 4 but the mesh has 2 devices"),
    "nproc-0": (["train", "--nproc", "0"], r"shardfn train: error: --nproc must be >= 1, got 0"),
    "nproc-2-one-device": (["train", "--nproc", "2"], r"--nproc 2 but the mesh has 1 device; make them equal"),
    "tp-3-nproc-3": (
        ["train", "--nproc", "3", "mesh.tp=3"],
        r"shardfn train: error: mesh\.tp: 3 does not divide model\.n_heads = 4",
    ),
    "data-path-missing-nproc-2": (
        ["train", "--nproc", "2", "mesh.dp=2", "data.path=no/such.txt"],
        r"shardfn train: error: data\.path 'no/such\.txt' is not a file; give a text file, or data\.path=null",
    ),
    "init_from-missing-nproc-2": (
        ["train", "--nproc", "2", "mesh.dp=2", "train.init_from=no/such/dir"],
        r"shardfn train: error: train\.init_from: 'no/such/dir' is not a directory; give a directory of Hugging "
        r"Face \*\.safetensors files",
    ),
    "trace-without-pp": (
        ["train", "--trace", "tr", "train.steps=1"],
        r"shardfn train: error: --trace tr records pipeline schedules: set mesh\.pp > 1",
    ),
    "train-bad-schedule": (
        ["train", "mesh.pp=2", "pipeline.schedule=bogus"],
        r"shardfn train: error: pipeline\.schedule must be one of gpipe, .*got 'bogus'",
    ),
    "params-unknown-model": (
        ["params", "model.name=gpt"],
        r"shardfn params: error: model\.name: unknown model 'gpt'; valid models: llama, moe",
    ),
    "config-is-a-directory": (
        ["params", "--config", "."],
        r"config file '\.' not found; .*packaged configs: "
        r".*llama_tiny",
    ),
    "schedule-unknown-name": (
        ["schedule", "--name", "pipedream"],
        r"shardfn schedule: error: unknown schedule 'pipedream'; valid names: gpipe, 1f1b",
    ),
    "schedule-0-stages": (["schedule", "--stages", "0"], r"1f1b needs n_ranks >= 1 .*\(got n_ranks=0"),
    "schedule-0-microbatches": (["schedule", "--microbatches", "0"], r"got n_ranks=4, n_microbatches=0"),
    "schedule-virtual-for-1f1b": (
        ["schedule", "--name", "1f1b", "--virtual", "3"],
        r"1f1b has 1 stage\(s\) per rank, got n_virtual=3; for more stages per rank use "
        r"interleaved_1f1b",
    ),
    "schedule-dualpipev-few-mb": (
        ["schedule", "--name", "dualpipev", "--stages", "4", "--microbatches", "4"],
        r"dualpipev needs n_microbatches >= 2 \* n_ranks .*use n_microbatches=8 or more",
    ),
    "schedule-costs-kind": (["schedule", "--costs", "X=1"], r"costs has unknown kind 'X'; valid kinds: F, B, I, W"),
    "schedule-costs-negative": (["schedule", "--costs", "F=-1"], r"costs\['F'\] must be > 0, got -1\.0"),
    "schedule-file-missing": (["schedule", "--file", "no/such/schedule.yaml"], r"no/such/schedule\.yaml"),
    "plan-unknown-hardware": (
        ["plan", "--hardware", "tpu9"],
        r"unknown hardware 'tpu9'; valid names are \['a100', 'b200', .*or pass the path of a YAML file",
    ),
    "plan-search-without-gpus": (["plan", "--search"], r"--search needs --gpus N"),
    "plan-search-bad-schedule": (
        ["plan", "--search", "--gpus", "4", "--schedules", "1f1b,pipedream"],
        r"--schedules: unknown schedule 'pipedream'; valid: gpipe, 1f1b",
    ),
    "plan-search-bad-microbatches": (
        ["plan", "--search", "--gpus", "4", "--microbatches", "a,b"],
        r"--microbatches takes comma-separated integers, got 'a,b'",
    ),
    "plan-gpus-not-mesh-size": (
        ["plan", "--gpus", "8", "mesh.dp=2"],
        r"mesh: the mesh pp\*dp\*fsdp\*ep\*tp = 1\*2\*1\*1\*1 = 2 devices but --gpus is 8; "
        r"set mesh\.dp=8",
    ),
    "plan-pp-over-layers": (
        ["plan", "mesh.pp=4"],
        r"mesh\.pp: 4 pipeline stages for model\.n_layers = 2 layers; use at most 2",
    ),
    "plan-ep-batch": (
        ["plan", "--config", "moe_tiny", "mesh.ep=3"],
        r"train\.batch_size: 8 is not divisible by the data-parallel size dp\*fsdp\*ep = 3",
    ),
    "inspect-pp": (
        ["inspect", "mesh.pp=2"],
        r"shardfn inspect lowers one program; for mesh\.pp > 1 use `shardfn plan`",
    ),
    "inspect-ep-not-dividing-experts": (
        ["inspect", "--config", "moe_tiny", "mesh.ep=3", "train.batch_size=12"],
        r"mesh\.ep: 3 does not divide model\.n_experts = 8",
    ),
    "inspect-tp-indivisible": (
        ["inspect", "mesh.tp=3"],
        r"input params\.embed: dim 0 of size 256 is not divisible by mesh axes \('tp',\) "
        r"\(size 3\)",
    ),
    "inspect-rule-unknown-axis": (["inspect", "rules.embed=xp"], r"rules\.embed: unknown mesh axis 'xp'"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli(case, capsys, tmp_path, monkeypatch, clean_process_group):
    argv, message = CLI_CASES[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert _search(message, err), f"{message!r} not in stderr:\n{err}"
    assert len(err.strip().splitlines()) == 1, f"one message, once:\n{err}"


def test_cli_train_data_shorter_than_a_row(tmp_path, capsys):
    (tmp_path / "short.txt").write_text("hello")
    assert cli.main(["train", "--nproc", "2", "mesh.dp=2", f"data.path={tmp_path / 'short.txt'}"]) == 2
    assert capsys.readouterr().err == ("shardfn train: error: the data has 5 tokens, fewer than seq_len + 1 = 129; "
                                       "use a longer file or a smaller train.seq_len.\n")


def _search(pattern, text):
    import re

    return re.search(pattern, text)


@pytest.mark.parametrize("argv,message", [
    (["train", "--nproc", "x"], r"argument --nproc: invalid int value: 'x'"),
    (["plan", "--dtype", "float8"],
     r"argument --dtype: invalid choice: 'float8' \(choose from 'float32', 'bfloat16'\)"),
], ids=["nproc-not-int", "plan-dtype"])
def test_cli_argparse(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert _search(message, capsys.readouterr().err)


# ----------------------------------------------------------------------------- schedules

@pytest.mark.parametrize("call,message", [
    (lambda S: S.get_schedule("gpipe", 0, 4), r"gpipe needs n_ranks >= 1 and n_microbatches >= 1 \(got n_ranks=0"),
    (lambda S: S.get_schedule("interleaved_1f1b", 2, 4, n_virtual=0), r"interleaved_1f1b needs n_virtual >= 1, got 0"),
    (lambda S: S.get_schedule("zbh1", 2, 4, n_virtual=2), r"zbh1 has 1 stage\(s\) per rank, got n_virtual=2"),
    (lambda S: S.stage_to_rank_map(4, 6), r"n_stages=6 must be a positive multiple of n_ranks=4"),
    (lambda S: S.stage_to_rank_map(2, 6, "v"), r"a V placement has 2 stages per rank: n_stages must be 4"),
], ids=["gpipe-0-ranks", "interleaved-0-virtual", "zbh1-virtual", "stages-not-multiple", "v-placement"])
def test_schedule(call, message):
    from shardfn.partition.pipeline import schedules

    with pytest.raises(ValueError, match=message):
        call(schedules)


# ----------------------------------------------------------------------------- pipeline steps

@pytest.mark.parametrize("config,overrides,message", [
    ("moe_tiny", ["mesh.pp=2", "mesh.ep=2", "pipeline.schedule=dualpipev", "pipeline.microbatches=2"],
     r"dualpipev needs n_microbatches >= 2 \* n_ranks .*use n_microbatches=4 or more"),
    (None, ["mesh.pp=2", "pipeline.stages=3"], r"pipeline\.stages: 3 is not a multiple of mesh\.pp = 2; use 2 or null"),
    (None, ["mesh.pp=2", "pipeline.schedule=interleaved_1f1b", "pipeline.microbatches=3", "train.batch_size=6"],
     r"interleaved_1f1b needs n_microbatches to be a multiple of n_ranks .*use 2 or 4"),
], ids=["dualpipev-microbatches", "stages-not-multiple-of-pp", "interleaved-microbatches"])
def test_pipeline_step(config, overrides, message):
    from shardfn import models
    from shardfn.runtime.pipeline_step import build_pipeline_step

    cfg = load_config(config, overrides)
    model = models.get(cfg.model_name)
    with pytest.raises(ValueError, match=message):
        build_pipeline_step(cfg, model, model.init(cfg.model, 0, device="meta"))


# ----------------------------------------------------------------------------- checkpoints

def test_checkpoint_load_of_an_empty_dir(tmp_path):
    from shardfn.runtime import checkpoint as ck

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty is not a complete checkpoint \(no COMPLETE marker or DCP index\); "
                                         r"load one of latest_checkpoint"):
        ck.load_checkpoint(tmp_path / "empty", {}, {})


@pytest.mark.parametrize("layout", ["missing-dir", "only-a-killed-save"])
def test_resume_from_a_dir_with_nothing_to_resume(layout, tmp_path, capsys):
    from shardfn.runtime import run_identity as ri

    d = tmp_path / "ckpt"
    if layout == "only-a-killed-save":
        (d / "step_00000004.tmp").mkdir(parents=True)  # a save that never got its COMPLETE marker
    cfg = load_config(None, ["train.checkpoint.resume=true", f"train.checkpoint.dir={d}"])
    with pytest.raises(ValueError, match=r"train\.checkpoint\.resume=true \(--resume\), but train\.checkpoint\.dir="
                                         r".*ckpt' holds no complete checkpoint; point it at the run's directory"):
        ri.resume_path(cfg.train.checkpoint)
    assert cli.main(["train", "--resume", f"train.checkpoint.dir={d}"]) == 2
    assert "start without --resume" in capsys.readouterr().err


def test_checkpoint_save_keep_0(tmp_path):
    from shardfn.runtime import checkpoint as ck

    with pytest.raises(ValueError, match=r"keep must be >= 1 \(train\.checkpoint\.keep\), got 0"):
        ck.save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, {}, keep=0)


# ----------------------------------------------------------------------------- Hugging Face import

@pytest.fixture(scope="module")
def llama_hf():
    from shardfn import models
    from shardfn.models import hf

    cfg = load_config(None).model
    return cfg, hf.to_hf(models.get("llama").init(cfg, 0), "llama", cfg)


def _write_dir(d, files: dict):
    d.mkdir()
    for name, content in files.items():
        (d / name).write_text(content) if isinstance(content, str) else (d / name).write_bytes(content)
    return d


# (files in the directory, error, message): hf.load of a directory that is not a checkpoint
HF_DIR_CASES = {
    "empty-dir": (
        {},
        FileNotFoundError,
        r"train\.init_from: '.*' holds no \*\.safetensors files "
        r"\(and no model\.safetensors\.index\.json\)",
    ),
    "index-names-a-missing-shard": (
        {
            "model.safetensors.index.json": json.dumps(
                {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
            )
        },
        FileNotFoundError,
        r"index\.json maps model\.norm\.weight to model-00001-of-00002\.safetensors, which is not in",
    ),
    "index-without-weight_map": (
        {"model.safetensors.index.json": "{}"},
        ValueError,
        r"index\.json: not a safetensors index \(a JSON object with a 'weight_map'",
    ),
    "not-safetensors": (
        {"model.safetensors": b"garbage"},
        ValueError,
        r"model\.safetensors: not a readable safetensors file",
    ),
}


@pytest.mark.parametrize("case", list(HF_DIR_CASES))
def test_hf_dir(case, tmp_path):
    from shardfn.models import hf

    files, error, message = HF_DIR_CASES[case]
    d = _write_dir(tmp_path / "ckpt", files)
    with pytest.raises(error, match=message):
        hf.load(d, "llama", load_config(None).model)


def test_hf_dir_is_a_file(tmp_path):
    from shardfn.models import hf

    (tmp_path / "model.safetensors").write_text("x")
    with pytest.raises(FileNotFoundError,
                       match=r"is not a directory; give a directory of Hugging Face \*\.safetensors"):
        hf.load(tmp_path / "model.safetensors", "llama", load_config(None).model)


# (config.json, message): a directory whose tensors are right but whose config.json is not
HF_CONFIG_CASES = {
    "not-json": ("{bad", r"config\.json: not valid JSON"),
    "disagrees": (json.dumps({"model_type": "llama", "hidden_size": 4096}),
                  r"config\.json disagrees with the model config: hidden_size=4096 but model\.dim=64; override "
                  r"model\.dim=4096"),
    "other-model-type": (json.dumps({"model_type": "mistral"}),
                         r"model_type 'mistral' is not a 'llama' model .*set model\.name to match the checkpoint"),
    "rope-scaling": (json.dumps({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}}),
                     r"rope_scaling type 'linear' is not modelled; the models implement RoPE scaling llama3, yarn"),
    "hidden-act": (json.dumps({"model_type": "llama", "hidden_act": "gelu"}),
                   r"hidden_act 'gelu'; the models use SwiGLU with silu"),
}


@pytest.mark.parametrize("case", list(HF_CONFIG_CASES))
def test_hf_config_json(case, tmp_path, llama_hf):
    from safetensors.torch import save_file

    from shardfn.models import hf

    cfg, tensors = llama_hf
    text, message = HF_CONFIG_CASES[case]
    d = _write_dir(tmp_path / "ckpt", {"config.json": text})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        hf.load(d, "llama", cfg)


def _shape(t):
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:3]


def _dtype(t):
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)


def _extra(t):
    t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(4)


def _missing(t):
    del t["model.norm.weight"]


@pytest.mark.parametrize("edit,message", [
    (_shape, r"model\.embed_tokens\.weight has shape \(3, 64\), but model 'llama' with this config needs \(256, 64\) "
             r"for embed; check the model\.\* sizes"),
    (_dtype, r"model\.norm\.weight has dtype torch\.int32; parameters are floating point"),
    (_extra, r"tensor model\.layers\.0\.self_attn\.q_proj\.bias is a q/k/v projection bias \(Qwen2: "
             r"model\.name=qwen2\), which model 'llama' does not have: the checkpoint is another architecture"),
    (_missing, r"missing tensor model\.norm\.weight, needed by model 'llama' with model\.n_layers=2"),
], ids=["wrong-shape", "int-dtype", "bias", "missing-tensor"])
def test_hf_tensors(edit, message, llama_hf):
    from shardfn.models import hf

    cfg, tensors = llama_hf
    tensors = dict(tensors)
    edit(tensors)
    with pytest.raises(ValueError, match=message):
        hf.from_hf(tensors, "llama", cfg)


def test_hf_unknown_model():
    from shardfn.models import hf

    with pytest.raises(ValueError, match=r"unknown model 'gpt'; valid models: llama, moe"):
        hf.layout("gpt", load_config(None).model)


def test_train_init_from_an_empty_dir(tmp_path):
    from shardfn.runtime.train import train

    (tmp_path / "hf").mkdir()
    cfg = load_config(None, [f"train.init_from={tmp_path / 'hf'}", "train.steps=1"])
    with pytest.raises(FileNotFoundError, match=r"train\.init_from: '.*hf' holds no \*\.safetensors files"):
        train(cfg, log=lambda line: None)


def test_a_spec_tree_that_does_not_fit_prints_shapes_not_values(clean_process_group):
    import shardfn as sf
    from shardfn import P
    from shardfn.core import optim

    params = {"w1": torch.randn(4, 8), "w2": torch.randn(8, 4)}
    state = optim.adamw(1e-3).init(params)
    jitted = sf.jit(lambda p, s: (p, s), sf.Mesh({"dp": 2}, fake=True), in_specs=(P(), ({"a": P()},)), backend=None)
    with pytest.raises(ValueError) as e:
        jitted.lower(params, state)
    message = str(e.value)
    assert "in_specs must be a pytree prefix of the arguments: tuple arity mismatch" in message
    assert "mu={'w1': float32[4, 8], 'w2': float32[8, 4]}" in message and "tensor(" not in message
