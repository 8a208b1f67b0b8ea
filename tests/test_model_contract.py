"""A user's own model through the whole stack (models.contract, docs/models.md).

``tests/tiny_dense.py`` is the smallest dense decoder (10 contract lines) and
``examples/models/qwen_moe.py`` a model that is not one of the built-in families (QK-norm,
softmax top-2 MoE, no shared experts). Both are named by their file, or by a registered name;
both train on one device and on meshes of gloo ranks to the one-device curve (fp32, rtol 1e-5),
and every case that used to misbehave silently is an error or a line that says so.
"""

from pathlib import Path

import pytest
import torch

from shardfn import models
from shardfn.config import config_from_dict, load_config
from shardfn.models.contract import ModelError
from shardfn.partition.errors import LayoutError
from shardfn.partition.layouts.axes import check_run

ROOT = Path(__file__).resolve().parent.parent
DENSE = str(ROOT / "tests" / "tiny_dense.py")
EXAMPLE = str(ROOT / "examples" / "models" / "qwen_moe.yaml")
BASE = ["train.steps=3", "train.batch_size=8", "train.seq_len=32", "train.warmup_steps=1", "train.log_every=100",
        "train.checkpoint.every=0"]
EXAMPLE_LAYOUTS = {"ep2": ["mesh.ep=2"], "tp2": ["mesh.tp=2"], "cp2": ["mesh.cp=2"],
                   "pp2": ["mesh.pp=2", "pipeline.microbatches=2"]}
"""What the default suite trains the example on (one 2-rank spawn); the data-parallel layouts
(``EXAMPLE_DATA_LAYOUTS``, covered for the dense model) run with ``-m slow``."""
EXAMPLE_DATA_LAYOUTS = {"dp2": ["mesh.dp=2"], "fsdp2": ["mesh.fsdp=2"]}
DENSE_LAYOUTS = {"dp2": ["mesh.dp=2"], "pp2": ["mesh.pp=2", "pipeline.microbatches=2"]}
MOE_AUX = ["model.aux_loss_alpha=0.01", "model.n_layers=4"]
"""moe_tiny with a balance loss and 4 layers (pp2 puts MoE layers on both stages): its aux values
(``ce_loss``, ``balance_loss``) are metrics."""
MOE_AUX_LAYOUTS = {"moe_tiny pp2": ["mesh.pp=2", "pipeline.microbatches=2"]}
"""What the example's default spawn also trains: moe_tiny's aux metrics under pp."""


def dense_config(*overrides, name=DENSE):
    return config_from_dict({"model": {"name": name}}, [*BASE, *overrides])


def _curves(cfg) -> dict[str, torch.Tensor]:
    """Each metric the run reports every step (loss, grad_norm, lr, aux values), by step."""
    from shardfn.runtime.train import train

    history = train(cfg, log=lambda line: None).history
    keys = [k for k in history[0] if k not in ("step", "tokens_per_s", "time_s") and all(k in r for r in history)]
    return {k: torch.tensor([r[k] for r in history], dtype=torch.float64) for k in keys}


def _losses(cfg) -> torch.Tensor:
    return _curves(cfg)["loss"]


def layouts_worker(cfg_dicts: list) -> list:
    """Each run config trained in turn on this rank's process group: its metrics by step."""
    from shardfn.config import config_from_dict

    return [_curves(config_from_dict(d)) for d in cfg_dicts]


_RUNS: dict = {}


def run_layout_curves(configs: dict) -> dict:
    """``layouts_worker`` on 2 gloo ranks, once per session for each set of layouts; rank 0's metrics."""
    from shardfn.runtime.launch import spawn

    key = tuple(configs)
    if key not in _RUNS:
        out = spawn(layouts_worker, 2, args=([c.to_dict() for c in configs.values()],), timeout_s=600)
        _RUNS[key] = dict(zip(configs, out[0]))
    return _RUNS[key]


def run_layouts(configs: dict) -> dict:
    """:func:`run_layout_curves`' losses."""
    return {name: curves["loss"] for name, curves in run_layout_curves(configs).items()}


# ----------------------------------------------------------------------------- the open door


def test_a_model_is_named_by_file_module_path_or_registered_name(tmp_path):
    by_file = models.get(DENSE)
    assert by_file.module.__file__ == DENSE and by_file.stacks(by_file.Config()) == [("layers", 2)]
    assert models.get("shardfn.models.llama").module is models.get("llama").module
    models.register("tiny_dense_by_name", DENSE)
    cfg = config_from_dict({"model": {"name": "tiny_dense_by_name"}})
    assert cfg.model_name == "tiny_dense_by_name" and cfg.model.dim == 32
    import json
    import os

    assert json.loads(os.environ[models.REGISTRY_ENV])["tiny_dense_by_name"] == DENSE  # what spawned ranks read
    # a relative .py in a YAML file is the file beside it
    assert load_config(EXAMPLE).model_name == str(ROOT / "examples" / "models" / "qwen_moe.py")


def test_an_unresolved_name_says_what_was_tried():
    with pytest.raises(ValueError, match=r"model.name: unknown model 'nosuch.module'; valid models: llama, moe.* "
                                         r"tried a registered name, a module path \(no module named 'nosuch'\)"):
        config_from_dict({"model": {"name": "nosuch.module"}})
    with pytest.raises(ValueError, match=r"unknown model 'gone.py'; .*tried a registered name, a \.py file \(no file "):
        models.get("gone.py")


def test_a_module_without_the_required_members_is_named(tmp_path):
    (tmp_path / "half_model.py").write_text("class Config:\n    pass\n")
    with pytest.raises(ModelError, match=r"model '.*half_model.py' \(.*\) does not define param_table, loss \(or "
                                         r"loss_and_aux\)"):
        models.get(str(tmp_path / "half_model.py"))


# ----------------------------------------------------------------------------- the defaults


def test_the_contract_derives_the_rest_from_the_table():
    dense = models.get(DENSE)
    c = dense.Config()
    assert dense.param_counts(c) == {"total": 49312, "active": 49312}  # 2 x 256 x 32 + 32 + 2 x 16448
    assert dense.layout_units(c) == {"heads": ("n_heads", 4)}
    assert dense.attention_shape(c) == (4, 8, 8) and dense.kv_width(c) == 64
    assert dense.FROZEN == () and dense.experts_per_token(c) == 0 and dense.pipeline_refusal(c) is None
    assert dense.with_layers(c, {"layers": 1}).n_layers == 1
    assert dense.param_axes(c)["layers"]["attn"]["wq"] == ("layers", "embed", "heads")
    example = models.get(load_config(EXAMPLE).model_name)
    e = example.Config()
    assert example.layout_units(e) == {"heads": ("n_heads", 4), "kv_heads": ("n_kv_heads", 2),
                                       "expert": ("n_experts", 4)}
    assert example.active_fraction(e) == {"expert": 0.5} and example.experts_per_token(e) == 2
    # every expert weight is 4 x 64 x 32 per layer, 3 of them, 2 layers: half of 49152 is inactive
    assert example.param_counts(e) == {"total": 107392, "active": 107392 - 49152 // 2}
    assert example.attention_shape(e) == (4, 16, 16) and example.kv_width(e) == 64


def test_llama_and_moe_keep_their_numbers_through_the_defaults():
    llama, moe = models.get("llama"), models.get("moe")
    assert llama.param_counts(llama.Config()) == {"total": 155968, "active": 155968}
    assert moe.param_counts(moe.Config()) == {"total": 241808, "active": 168080}
    assert moe.layout_units(moe.Config()) == {"heads": ("n_heads", 4), "expert": ("n_experts", 8)}
    assert moe.active_fraction(moe.Config()) == {"expert": 0.25}


# ----------------------------------------------------------------------------- checked, not silent


def test_an_unknown_logical_axis_names_the_parameter_the_axis_and_the_valid_names(tmp_path):
    (tmp_path / "misspelt.py").write_text(Path(DENSE).read_text().replace('"wq": normal((D, D), ("embed", "heads"))',
                                                                        '"wq": normal((D, D), ("embed", "head"))'))
    cfg = dense_config(name=str(tmp_path / "misspelt.py"))
    with pytest.raises(ModelError, match=r"parameter layers.attn.wq dim 2 has unknown logical axis 'head'; valid "
                                         r"names: vocab, embed, heads, kv_heads, .*\(or None\)"):
        check_run(models.get(cfg.model_name), cfg)


def test_expert_parallelism_on_a_model_without_experts_is_an_error():
    cfg = dense_config("mesh.ep=2")
    with pytest.raises(LayoutError, match=r"mesh.ep: 2, but model '.*tiny_dense.py' has no parameter dim on the "
                                          r"logical axis 'expert'.*or set mesh.ep=1"):
        check_run(models.get(cfg.model_name), cfg)


def test_a_sequence_split_on_a_model_that_ignores_positions_is_an_error():
    cfg = dense_config("mesh.cp=2")
    with pytest.raises(LayoutError, match=r"mesh.cp: 2 reorders each sequence's tokens and passes their positions "
                                          r"as batch\['positions'\], which model '.*tiny_dense.py' does not read"):
        check_run(models.get(cfg.model_name), cfg)


def test_train_compile_says_when_it_compiles_no_model_layer():
    from shardfn.runtime.train import first_step_work

    assert first_step_work(dense_config("train.compile=true")).startswith(
        f"compiling no model layer: model '{DENSE}' marks no function with shardfn.core.regional.repeated")
    assert first_step_work(load_config(EXAMPLE, ["train.compile=true"])) == (
        "compiling one layer, which every layer then runs (train.compile)")


def _unmarked_example(tmp_path) -> str:
    """The example model with its layer function's @repeated mark taken off, as a file of its own."""
    source = (ROOT / "examples" / "models" / "qwen_moe.py").read_text()
    assert source.count("@repeated\n") == 1
    path = tmp_path / "qwen_moe_unmarked.py"
    path.write_text(source.replace("@repeated\n", ""))
    return str(path)


def test_train_compile_finds_the_layer_function_of_an_unmarked_model(tmp_path, monkeypatch):
    """The unmarked example's ``block`` is the function its loss calls once per layer; train.compile
    names it, marks it, and the step compiles it once: loss and gradients as eager (fp32)."""
    from shardfn.core import regional
    from shardfn.core.layer_search import find_layer_fns, mark_found_layers
    from shardfn.core.transforms import value_and_grad
    from shardfn.runtime.train import first_step_work

    name = _unmarked_example(tmp_path)
    model = models.get(name)
    cfg = model.Config(n_layers=3)
    assert model.compiled_layer_fns() == [] and list(find_layer_fns(model, cfg)) == ["block"]
    line = first_step_work(config_from_dict({"model": {"name": name}}, [*BASE, "train.compile=true"]))
    assert line == ("compiling one layer, which every layer then runs (train.compile): block, found unmarked as the "
                    "function the loss calls once per layer of params['layers'] (2 layers)")
    params = model.init(cfg, 0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens, "targets": tokens.roll(-1, 1)}
    grad_fn = value_and_grad(lambda p: model.loss(p, batch, cfg))
    eager_loss, eager_grads = grad_fn(params)

    compiled = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or real_compile(fn, **kw))
    assert list(mark_found_layers(model, cfg)) == ["block"] and model.compiled_layer_fns() == [model.block]
    with regional.compiled_layers(backend="aot_eager"):
        loss, grads = grad_fn(params)
    assert [f.__name__ for f in compiled] == ["block"]  # one compilation, which all 3 layers ran
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(grads, eager_grads, rtol=1e-5, atol=1e-7)


def test_train_compile_on_inline_layers_says_what_to_write():
    from shardfn.runtime.train import first_step_work

    assert first_step_work(dense_config("train.compile=true")) == (
        f"compiling no model layer: model '{DENSE}' marks no function with shardfn.core.regional.repeated, and no "
        f"function of its module takes one layer of params['layers'] (2 layers) as its first argument (its layers "
        f"run inline in the loss), so only the optimizer update runs compiled; put one layer's code in a function "
        f"called once per layer, e.g. `h = block(p, h, ...)` for each p in core.layers.unstack(...), and mark it "
        f"@repeated, or set train.compile=whole (train.compile)")


@pytest.mark.slow
def test_train_compile_trains_an_unmarked_model_as_eager(tmp_path):
    cfg = config_from_dict({"model": {"name": _unmarked_example(tmp_path)}}, BASE)
    eager = _losses(cfg)
    compiled = _losses(config_from_dict({"model": {"name": cfg.model_name}}, [*BASE, "train.compile=true"]))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)


def test_export_without_hf_names_is_one_line(tmp_path, capsys):
    from shardfn import cli

    run, config = tmp_path / "run", tmp_path / "dense.yaml"
    config.write_text(f"model: {{name: {DENSE}}}\n")
    assert cli.main(["train", "--config", str(config), "train.steps=1", "train.batch_size=2", "train.seq_len=16",
                     "train.checkpoint.every=1", f"train.checkpoint.dir={run}"]) == 0
    capsys.readouterr()
    code = cli.main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert f"model '{DENSE}' ({DENSE}) has no Hugging Face names: define hf_tensors(cfg)" in err


# ----------------------------------------------------------------------------- trained on every layout


def test_the_minimal_dense_model_trains_on_one_device_dp2_and_pp2():
    models.register("tiny_dense_by_name", DENSE)  # the spawned ranks resolve the registered name
    ref = _losses(dense_config(name="tiny_dense_by_name"))
    assert ref[-1] < ref[0]
    runs = run_layouts({k: dense_config(*v, name="tiny_dense_by_name") for k, v in DENSE_LAYOUTS.items()})
    for name, losses in runs.items():
        torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layouts", [pytest.param(EXAMPLE_LAYOUTS, id="ep2-tp2-cp2-pp2"),
                                     pytest.param(EXAMPLE_DATA_LAYOUTS, id="dp2-fsdp2", marks=pytest.mark.slow)])
def test_the_example_model_matches_one_device_on_every_layout(layouts):
    ref = _losses(load_config(EXAMPLE, BASE))
    assert ref[-1] < ref[0]
    runs = run_layouts(_example_spawn(layouts))
    assert set(layouts) <= set(runs)
    for name in layouts:
        torch.testing.assert_close(runs[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _example_spawn(layouts: dict) -> dict:
    """The configs of one 2-rank spawn: the example on ``layouts``, and with the default layouts
    moe_tiny's aux metrics under pp (:data:`MOE_AUX_LAYOUTS`)."""
    configs = {k: load_config(EXAMPLE, [*BASE, *v]) for k, v in layouts.items()}
    if layouts is EXAMPLE_LAYOUTS:
        configs.update({k: load_config("moe_tiny", [*BASE, *MOE_AUX, *v]) for k, v in MOE_AUX_LAYOUTS.items()})
    return configs


def test_scalar_aux_metrics_under_pp_are_one_devices():
    """moe_tiny's ce_loss and balance_loss, made on both stages of pp2 (the balance loss by the MoE
    layers of each), summed over the stages and averaged over the microbatches: one device's, every step."""
    ref = _curves(load_config("moe_tiny", [*BASE, *MOE_AUX]))
    assert {"ce_loss", "balance_loss"} <= set(ref) and bool((ref["balance_loss"] > 0).all())
    runs = run_layout_curves(_example_spawn(EXAMPLE_LAYOUTS))
    for name in MOE_AUX_LAYOUTS:
        for key in ("loss", "ce_loss", "balance_loss"):
            torch.testing.assert_close(runs[name][key], ref[key], rtol=1e-5, atol=0, msg=lambda m: f"{name} {key}: {m}")


# ----------------------------------------------------------------------------- parallelism out of model files


def test_no_parallelism_words_in_model_files_and_no_config_fields_read_outside():
    import re

    for path in sorted((ROOT / "models").glob("*.py")) + [ROOT / "examples" / "models" / "qwen_moe.py"]:
        text = path.read_text()
        for word in ("mesh.", "takes_shared", "capacity_factor", "all_to_all"):
            assert word not in text, f"{path.name} mentions {word!r}"
    field_read = re.compile(r"\b(?:mcfg|model_cfg|cfg\.model)\.(?!model_name\b)[a-z_]+\b(?!\()")
    for folder in ("partition", "runtime", "plan", "cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith(("#", '"', "'"))]
            hits = [line.strip() for line in code if field_read.search(line.split("#")[0])]
            assert not hits, f"{path.relative_to(ROOT)} reads a model Config field by name: {hits[0]}"


def test_the_example_plans_at_a_100b_class_size(capsys):
    from shardfn import cli

    config = str(ROOT / "examples" / "models" / "qwen_moe_100b.yaml")
    assert cli.main(["params", "--config", config]) == 0
    assert capsys.readouterr().out.split() == ["total", "99.71B", "(99,706,355,712)", "active", "6.09B",
                                               "(6,089,490,432)"]
    # remat and 8 microbatches: without them the estimate's activations (290 GiB) do not fit an h200
    assert cli.main(["plan", "--config", config, "mesh.fsdp=8", "mesh.ep=8", "--checkpointing",
                     "pipeline.microbatches=8"]) == 0
    out = capsys.readouterr().out
    assert "params: 99.71B total, 6.09B active per token" in out and "layers 0-47" in out and ": fits" in out


def _split(loss_fn, cfg, tokens):
    """The two-stage split of ``loss_fn`` on ``tokens``: the pipeline, each stage's share of the
    FLOPs, and the warnings it gave."""
    import warnings

    from shardfn.partition.pipeline.split import build_pipeline

    moe = models.get("moe")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pipe = build_pipeline(loss_fn, moe.init(cfg, 0), {"inputs": tokens, "targets": tokens.roll(-1, 1)},
                              n_stages=2)
    total = sum(s.flops for s in pipe.stages)
    return pipe, [s.flops / total for s in pipe.stages], [str(w.message) for w in record
                                                          if str(w.message).startswith("pipeline stages")]


def test_a_per_layer_auxiliary_loss_splits_as_evenly_as_without_it():
    """moe (9 layers) with a balance loss, summed after the last layer, splits where it does
    without (47% / 53% of the FLOPs; it was 22% / 78% when the running sum blocked every cut but
    one): each stage adds up its layers' terms, and the two stages' loss, gradients and aux values
    are one device's."""
    from shardfn.core.pytree import tree_leaves
    from shardfn.core.transforms import value_and_grad
    from shardfn.partition.pipeline.schedules import get_schedule
    from shardfn.partition.pipeline.split import merge_params, stage_params
    from shardfn.runtime.executor import run_schedule, split_microbatches

    moe = models.get("moe")
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    shares = {}
    for alpha in (0.0, 0.01):
        cfg = moe.Config(n_layers=9, aux_loss_alpha=alpha)
        pipe, shares[alpha], warned = _split(lambda p, b: moe.loss_and_aux(p, b, cfg), cfg, tokens[:2])
        assert warned == []
    assert [round(x, 3) for x in shares[0.01]] == [0.468, 0.532]
    torch.testing.assert_close(shares[0.01], shares[0.0], rtol=0, atol=1e-3)
    assert [s.sides for s in pipe.stages] == [("loss", "aux:balance_loss"), ("aux:balance_loss", "aux:ce_loss")]

    params = moe.init(cfg, 0)
    batch = {"inputs": tokens, "targets": tokens.roll(-1, 1)}
    out = run_schedule(pipe, get_schedule("interleaved_1f1b", 1, 2, 2), 0,
                       {s: stage_params(params, pipe, s) for s in range(2)}, split_microbatches(batch, 2), group=None)
    (loss, aux), grads = value_and_grad(lambda p: moe.loss_and_aux(p, batch, cfg), has_aux=True)(params)
    assert aux["balance_loss"] > 0 and set(out.aux) == {"balance_loss", "ce_loss"}
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=0)
    for key, value in out.aux.items():
        torch.testing.assert_close(value, aux[key], rtol=1e-5, atol=0)
    for a, b in zip(tree_leaves(merge_params(out.grads, pipe)), tree_leaves(grads)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_split_that_truly_cannot_balance_says_which_values_cross():
    """A loss that multiplies by the per-layer sum keeps it alive across every layer boundary:
    that split stays uneven, and the warning names the values."""
    moe = models.get("moe")
    cfg = moe.Config(n_layers=9, aux_loss_alpha=0.01)

    def scaled(p, b):
        value, aux = moe.loss_and_aux(p, b, cfg)
        return value * (1 + aux["balance_loss"])

    _, shares, (message,) = _split(scaled, cfg, torch.zeros(2, 16, dtype=torch.long))
    assert [round(x, 2) for x in shares] == [0.22, 0.78]
    assert message.startswith("pipeline stages hold 22% / 78% of the cost, more than 10% off even: 7 of 8 layer "
                              "boundaries are no valid cut (one activation crossing): before layer moe_layers.4, "
                              "6 values cross: ")
    assert "(mul.Tensor, shape [])" in message and "unless the loss adds it up" in message
