"""NaN/Inf steps: train.nonfinite=raise stops the run naming the step; =skip leaves params and state unchanged."""

import json
import re

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn import models
from shardfn.config import load_config
from shardfn.core.pytree import tree_leaves
from shardfn.models import hf
from shardfn.runtime import data
from shardfn.runtime.launch import spawn
from shardfn.runtime.train import nonfinite_message, train
from shardfn.runtime.train_step import make_optimizer, make_train_step

POISON = ord("~")  # a byte the embedded corpus never uses; its embedding row is NaN
SMALL = ["model.n_layers=1", "train.batch_size=4", "train.seq_len=32", "train.log_every=1000", "train.steps=6",
         "train.warmup_steps=2"]


def _same(a, b):
    """Bitwise-equal trees, NaNs in the same places."""
    return all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) and torch.equal(x.isnan(), y.isnan())
               for x, y in zip(tree_leaves(a), tree_leaves(b)))


def poisoned_run(tmp_path, steps=6):
    """A text file holding POISON once, inside one of step 2's rows, and an HF dir whose embedding
    row for POISON is NaN: exactly the steps whose inputs contain it have a NaN loss."""
    cfg = load_config(None, SMALL)
    corpus = bytearray(data.embedded_corpus(4096))
    offset = np.random.default_rng([cfg.train.seed, 2]).integers(0, len(corpus) - 32, size=4)[0]
    corpus[offset + 5] = POISON
    (tmp_path / "text.txt").write_bytes(bytes(corpus))
    params = models.get("llama").init(cfg.model, seed=0)
    params["embed"][POISON] = float("nan")
    hf.save(tmp_path / "hf", params, "llama", cfg.model)
    tokens = data.load_tokens(tmp_path / "text.txt")
    bad = [s for s in range(steps) if (data.get_batch(tokens, s, batch_size=4, seq_len=32)["inputs"] == POISON).any()]
    assert 2 in bad and 0 not in bad and len(bad) < steps, bad
    return [*SMALL, f"train.init_from={tmp_path / 'hf'}", f"data.path={tmp_path / 'text.txt'}"], params, bad


def replay(overrides, params, bad):
    """The skip run by hand: the plain step on every step, its result dropped on the bad ones."""
    cfg = load_config(None, overrides)
    model = models.get("llama")
    opt = make_optimizer(cfg.train, model)
    step, state = make_train_step(model, cfg.model, opt), opt.init(params)
    tokens = data.from_config(cfg.data)
    for s in range(cfg.train.steps):
        new = step(params, state, data.get_batch(tokens, s, batch_size=4, seq_len=32, seed=cfg.train.seed))
        if s not in bad:
            params, state = new[0], new[1]
    return params, state


def test_skip_inside_the_step_returns_inputs_unchanged_without_a_host_sync():
    cfg = load_config(None, SMALL)
    model = models.get("llama")
    opt = make_optimizer(cfg.train, model)
    params = model.init(cfg.model, seed=0)
    batch = data.get_batch(data.load_tokens(None), 0, batch_size=4, seq_len=32)
    guarded, plain = make_train_step(model, cfg.model, opt, skip_nonfinite=True), make_train_step(model, cfg.model, opt)
    state = opt.init(params)
    assert _same(guarded(params, state, batch)[:2], plain(params, state, batch)[:2])  # finite: the same update
    poisoned = {**params, "norm": params["norm"].clone()}
    poisoned["norm"][3] = float("inf")
    new_params, new_state, metrics = guarded(poisoned, state, batch)
    assert not torch.isfinite(metrics["loss"]) and _same((new_params, new_state), (poisoned, state))
    graph = make_fx(guarded)(poisoned, state, batch)
    assert "_local_scalar_dense" not in str(graph.graph) and "where" in str(graph.graph)


def test_nonfinite_message_names_which():
    assert nonfinite_message({"loss": 1.0, "grad_norm": 2.0}) is None
    assert nonfinite_message({"loss": float("nan"), "grad_norm": float("inf")}) == "loss is nan, grad_norm is inf"
    assert nonfinite_message({"loss": 1.0, "grad_norm": float("inf")}) == "grad_norm is inf"


def test_skip_keeps_training_and_matches_a_replay(tmp_path):
    overrides, params, bad = poisoned_run(tmp_path)
    lines = []
    result = train(load_config(None, [*overrides, "train.nonfinite=skip"]), log=lines.append)
    assert [r["step"] - 1 for r in result.history if r.get("skipped")] == bad
    assert all(np.isfinite(r["loss"]) for r in result.history if not r.get("skipped"))
    assert any(f"step {bad[0] + 1}: loss is nan, grad_norm is nan; skipped the update" in line for line in lines)
    assert _same((result.params, result.opt_state), replay(overrides, params, bad))


def test_raise_names_the_step_and_value(tmp_path):
    overrides, _, bad = poisoned_run(tmp_path)
    with pytest.raises(FloatingPointError, match=rf"step {bad[0] + 1}: loss is nan, grad_norm is nan; "
                                                 rf".*train\.nonfinite=skip"):
        train(load_config(None, overrides), log=lambda line: None)


def _two_rank_worker(overrides):
    from shardfn.runtime.partitioned import full

    result = train(load_config(None, [*overrides, "mesh.dp=2", "train.nonfinite=skip"]), log=lambda line: None)
    try:
        train(load_config(None, [*overrides, "mesh.dp=2"]), log=lambda line: None)
        error = None
    except FloatingPointError as e:
        error = str(e)
    return full(result.params), [r["step"] for r in result.history if r.get("skipped")], error


def test_two_ranks_skip_alike_and_raise_naming_the_step(tmp_path):
    overrides, params, bad = poisoned_run(tmp_path)
    ref_params, _ = replay(overrides, params, bad)
    for got, skipped, error in spawn(_two_rank_worker, 2, args=(overrides,), timeout_s=600):
        assert skipped == [s + 1 for s in bad]
        assert error is not None and error.startswith(f"step {bad[0] + 1}: loss is nan, grad_norm is nan")
        for a, b in zip(tree_leaves(got), tree_leaves(ref_params)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, equal_nan=True)  # 6 Adam steps of rounding


def test_nonfinite_advice_holds_for_the_config():
    from shardfn.runtime.train import nonfinite_error

    clipped = str(nonfinite_error(load_config(None, SMALL), 7, "grad_norm is nan", first=False))
    assert clipped.startswith("step 7: grad_norm is nan; the run stopped there (no checkpoint after it)")
    assert "lower train.lr (now 0.003)" in clipped and "train.nonfinite=skip" in clipped
    assert "grad_clip" not in clipped  # it is set already
    unclipped = str(nonfinite_error(load_config(None, [*SMALL, "train.grad_clip=null"]), 7, "loss is inf", first=False))
    assert "set train.grad_clip (e.g. 1.0; it is null)" in unclipped
    first = str(nonfinite_error(load_config(None, [*SMALL, "train.init_from=w/"]), 1, "loss is nan", first=True))
    assert "no update had been applied" in first and "train.init_from=w/" in first and "train.lr" not in first


def _strict(text):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_cli_nan_is_one_message_exit_2_and_strict_metrics(tmp_path, capsys, monkeypatch):
    from shardfn import cli

    monkeypatch.chdir(tmp_path)
    argv = ["train", *SMALL, "train.lr=1e30", "train.warmup_steps=0", "--metrics", "m.jsonl"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"shardfn train: error: step (\d+): (loss|grad_norm) is (nan|inf).*; the run stopped there "
                        r"\(no checkpoint after it\)\. To go on: lower train\.lr \(now 1e\+30\), or set "
                        r"train\.nonfinite=skip to skip such updates\n", err), err
    records = [_strict(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert None in records[-1].values()  # the non-finite value, as null


def test_metrics_line_is_strict_json():
    from shardfn.runtime.train import metrics_line

    line = metrics_line({"step": 3, "loss": float("nan"), "grad_norm": float("-inf"), "lr": 1e-3})
    assert _strict(line) == {"step": 3, "loss": None, "grad_norm": None, "lr": 1e-3}


def test_cli_nan_on_two_ranks_is_one_message_naming_the_rank(tmp_path, capsys, monkeypatch):
    from shardfn import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDFN_DEBUG", raising=False)
    argv = ["train", "--nproc", "2", "mesh.dp=2", *SMALL, "train.lr=1e30", "train.warmup_steps=0",
            "train.grad_clip=null", "runtime.timeout_s=60"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"shardfn train: error: rank 0: step \d+: (loss|grad_norm) is (nan|inf).*To go on: lower "
                        r"train\.lr \(now 1e\+30\), set train\.grad_clip \(e\.g\. 1\.0; it is null\), or set "
                        r"train\.nonfinite=skip to skip such updates\n", err), err
