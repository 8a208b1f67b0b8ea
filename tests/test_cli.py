"""The ``shardfn`` command line: subcommands, overrides, exit codes."""

import json
import subprocess
import sys

import pytest

from shardfn import cli


def _run(*args):
    return subprocess.run([sys.executable, "-m", "shardfn.cli", *args], capture_output=True, text=True, timeout=300)


def test_params_json_llama3_8b(capsys):
    assert cli.main(["params", "--config", "llama3_8b", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert counts["total"] == counts["active"]
    assert counts["total"] == pytest.approx(8.03e9, rel=1e-3)


def test_params_human_readable(capsys):
    assert cli.main(["params"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("total") and "active" in out


def test_train_with_overrides_writes_metrics(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    code = cli.main(["train", "train.steps=3", "--metrics", str(metrics), "train.batch_size=2", "train.seq_len=16"])
    assert code == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(isinstance(r["loss"], float) and r["tokens_per_s"] > 0 for r in records)
    assert "step 3/3" in capsys.readouterr().out


def test_unknown_override_key_exits_2_naming_it():
    proc = _run("train", "train.stepz=5")
    assert proc.returncode == 2
    assert "train.stepz" in proc.stderr and "steps" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_model_key_exits_2(capsys):
    assert cli.main(["params", "model.n_layerz=2"]) == 2
    assert "model.n_layerz" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["trian"]) == 2
    assert "valid subcommands: train, params" in capsys.readouterr().err
    assert cli.main(["train", "steps=5"]) == 2
    assert "section.key=value" in capsys.readouterr().err
    assert cli.main(["params", "--config", "nope.yaml"]) == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--no-such-flag"])
    assert e.value.code == 2


def test_help_lists_subcommands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "params" in out


def test_register_subcommand_resolves_lazily(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "hello", cli.SUBCOMMANDS["params"]._replace(help="say hello"))
    cli.register_subcommand("later", "imported on use", "no_such_module:add", "no_such_module:run")
    try:
        assert cli.main(["--help"]) == 0
        assert "imported on use" in capsys.readouterr().out  # listing does not import the module
        assert cli.main(["hello", "--json"]) == 0
    finally:
        cli.SUBCOMMANDS.pop("later")
