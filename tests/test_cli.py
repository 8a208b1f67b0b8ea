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
    assert all({"step", "loss", "grad_norm", "lr", "tokens_per_s", "time_s"} <= set(r) for r in records)
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


def _raises(error):
    def run(args):
        raise error
    return run


@pytest.mark.parametrize("how", ["flag", "flag-after", "env"])
def test_a_failure_is_one_line_and_debug_shows_its_traceback(how, monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "boom", cli.Subcommand("fail", lambda p: None,
                                                                 _raises(RuntimeError("kaboom"))))
    monkeypatch.delenv("SHARDFN_DEBUG", raising=False)
    assert cli.main(["boom"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardfn boom: RuntimeError: kaboom\n") and "Traceback" not in err
    assert "shardfn --debug boom" in err and "SHARDFN_DEBUG=1" in err
    argv = {"flag": ["--debug", "boom"], "flag-after": ["boom", "--debug"], "env": ["boom"]}[how]
    if how == "env":
        monkeypatch.setenv("SHARDFN_DEBUG", "1")
    with pytest.raises(RuntimeError, match="kaboom"):  # the traceback is Python's own
        cli.main(argv)


def test_ctrl_c_in_any_subcommand_exits_130(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "wait", cli.Subcommand("wait", lambda p: None,
                                                                 _raises(KeyboardInterrupt())))
    monkeypatch.delenv("SHARDFN_DEBUG", raising=False)
    assert cli.main(["wait"]) == 130
    assert capsys.readouterr().err == "shardfn wait: interrupted\n"


def test_debug_in_top_help(capsys):
    assert cli.main(["--help"]) == 0
    assert "--debug" in capsys.readouterr().out


def test_train_nproc_defaults_to_runtime_nproc_else_the_mesh_size(capsys):
    # runtime.nproc stands in for --nproc: 3 ranks for a 2-device mesh is refused before any spawn
    assert cli.main(["train", "mesh.dp=2", "runtime.nproc=3"]) == 2
    assert "--nproc 3 but the mesh has 2 devices; make them equal" in capsys.readouterr().err
    assert cli.main(["train", "mesh.dp=2", "runtime.nproc=3", "--nproc", "1"]) == 2   # --nproc wins
    assert "--nproc 1 but the mesh has 2 devices" in capsys.readouterr().err


def _cli_doc() -> str:
    from pathlib import Path

    return (Path(cli.__file__).resolve().parent.parent / "docs" / "cli.md").read_text()


def test_cli_doc_train_usage_lists_every_option():
    from shardfn.cli.main import SUBCOMMANDS, _resolve

    usage = next(line for line in _cli_doc().splitlines() if line.startswith("## `shardfn train"))
    parser = __import__("argparse").ArgumentParser()
    _resolve(SUBCOMMANDS["train"].add_arguments)(parser)
    options = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options and all(f"[{o}" in usage for o in options), (options, usage)


def test_plan_memory_line_names_the_budget(capsys):
    assert cli.main(["plan", "partition.memory_budget=1MiB"]) == 0
    out = capsys.readouterr().out
    assert "of 1.00 MiB (partition.memory_budget): DOES NOT FIT" in out
    assert cli.main(["plan", "--hardware", "h200"]) == 0
    assert "(h200 memory): fits" in capsys.readouterr().out




def test_inspect_under_ep_lists_the_moe_all_to_alls(capsys):
    """The runtime's exchanges, derived here from moe_tiny's shapes: each rank holds batch * seq / ep
    tokens, top_k rows each; uniform routing sends (ep-1)/ep of them away, dim fp32 values a row,
    four times a MoE layer (dispatch, combine, and both backward); and the tokens per expert, E/ep
    int64 to the other rank, once a layer."""
    from shardfn.config import load_config

    overrides = ["mesh.ep=2", "train.seq_len=32"]
    cfg = load_config("moe_tiny", overrides)
    m, ep = cfg.model, 2
    n_moe = m.n_layers - m.first_k_dense
    tokens = cfg.train.batch_size * cfg.train.seq_len // ep
    token_bytes = 4 * n_moe * (tokens * m.top_k * (ep - 1) // ep) * m.dim * 4
    count_bytes = n_moe * (m.n_experts // ep) * (ep - 1) * 8
    assert cli.main(["inspect", "--config", "moe_tiny", *overrides, "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["comm"] if r["op"] == "all_to_all"]
    assert rows == [
        {"op": "all_to_all", "axis": "ep", "what": "moe tokens", "bytes": token_bytes, "count": 4 * n_moe},
        {"op": "all_to_all", "axis": "ep", "what": "moe counts", "bytes": count_bytes, "count": n_moe},
    ]
    assert token_bytes == 262_144 and count_bytes == 64
