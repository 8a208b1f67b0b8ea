"""The pure training step and the single-device loop."""

import json
import shutil

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn import models
from shardfn.config import load_config
from shardfn.core import optim
from shardfn.core.pytree import tree_leaves, tree_map
from shardfn.runtime import data
from shardfn.runtime.build import build_step
from shardfn.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from shardfn.runtime.train import train
from shardfn.runtime.train_step import make_optimizer, make_train_step, trainable_mask

SMALL = ["train.batch_size=4", "train.seq_len=32", "train.log_every=1000"]


def _setup(overrides=(), config=None):
    cfg = load_config(config, [*SMALL, *overrides])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, cfg.train.seed)
    opt = make_optimizer(cfg.train, model)
    batch = data.get_batch(data.load_tokens(None), 0, batch_size=4, seq_len=32)
    return cfg, model, params, opt, batch


def test_step_is_pure_and_matches_manual_update():
    cfg, model, params, opt, batch = _setup()
    before = [x.clone() for x in tree_leaves(params)]
    step = make_train_step(model, cfg.model, opt)
    state = opt.init(params)
    new_params, new_state, metrics = step(params, state, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves(params))), "inputs must not be mutated"
    assert set(metrics) == {"loss", "grad_norm", "lr"} and all(m.shape == () for m in metrics.values())

    loss = model.loss(params, batch, cfg.model)
    torch.testing.assert_close(metrics["loss"], loss)
    grads = torch.func.grad(lambda p: model.loss(p, batch, cfg.model))(params)
    updates, _ = opt.update(grads, state, params)
    for a, b in zip(tree_leaves(new_params), tree_leaves(optim.apply_updates(params, updates))):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(metrics["grad_norm"], optim.global_norm(grads))
    assert float(metrics["lr"]) == pytest.approx(cfg.train.lr / cfg.train.warmup_steps)


def test_step_traces_whole_with_make_fx():
    cfg, model, params, opt, batch = _setup()
    step = make_train_step(model, cfg.model, opt)
    state = opt.init(params)
    graph = make_fx(step)(params, state, batch)
    assert "_local_scalar_dense" not in str(graph.graph), "no host syncs inside the step"
    ours, ref = graph(params, state, batch), step(params, state, batch)
    for a, b in zip(tree_leaves(ours), tree_leaves(ref)):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_compiled_step_matches_eager():
    cfg, model, params, opt, batch = _setup(["train.compile=true"])
    state = opt.init(params)
    eager = make_train_step(model, cfg.model, opt)
    compiled = build_step(cfg, model, params)
    p1, s1, m1 = eager(params, state, batch)
    p2, s2, m2 = compiled(params, state, batch)
    torch.testing.assert_close(m1["loss"], m2["loss"], rtol=1e-5, atol=1e-5)
    for a, b in zip(tree_leaves((p1, s1)), tree_leaves((p2, s2))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_short_run_loss_drops(tmp_path):
    cfg = load_config(
        None, ["train.steps=30", "train.batch_size=8", "train.seq_len=64", "train.warmup_steps=5", "train.log_every=10"]
    )
    lines = []
    result = train(cfg, metrics_path=tmp_path / "m.jsonl", log=lines.append)
    losses = [r["loss"] for r in result.history]
    assert len(losses) == 30
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 2.0, losses
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(records[0])
    assert any(line.startswith("step 10/30") and "tok/s" in line for line in lines)
    assert lines[-1].startswith("done: 30 steps")


def test_resume_is_exact(tmp_path):
    common = [*SMALL, "train.steps=6", "train.checkpoint.every=3", "train.checkpoint.keep=5"]
    full = train(load_config(None, [*common, f"train.checkpoint.dir={tmp_path / 'a'}"]), log=lambda _: None)
    assert [p.name for p in sorted((tmp_path / "a").iterdir())] == ["step_00000003", "step_00000006"]
    shutil.copytree(tmp_path / "a" / "step_00000003", tmp_path / "b" / "step_00000003")
    lines = []
    resumed = train(load_config(None, [*common, f"train.checkpoint.dir={tmp_path / 'b'}"]), log=lines.append)
    assert "resuming" in lines[0] and [r["step"] for r in resumed.history] == [4, 5, 6]
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history[3:]]
    for a, b in zip(tree_leaves((full.params, full.opt_state)), tree_leaves((resumed.params, resumed.opt_state))):
        assert torch.equal(a, b)


def test_checkpoint_keeps_newest_and_checks_structure(tmp_path):
    params = {"w": torch.ones(2)}
    opt = optim.adamw(0.1)
    state = opt.init(params)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, params, state, keep=2)
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    step, p, s, *_ = load_checkpoint(latest_checkpoint(tmp_path), params, state)
    assert step == 3 and torch.equal(p["w"], params["w"]) and type(s) is type(state)
    with pytest.raises(ValueError, match="different model"):
        load_checkpoint(latest_checkpoint(tmp_path), {"v": torch.ones(2)}, state)


def test_trainable_mask_freezes_router_bias():
    params = {"embed": torch.ones(2), "moe_layers": {"router_bias": torch.zeros(2), "w": torch.ones(2)}}
    mask = trainable_mask(models.get("moe").FROZEN)
    assert mask(params) == {"embed": True, "moe_layers": {"router_bias": False, "w": True}}
    staged = {"stage1": params}  # a pipeline rank's local tree: the same leaf under a stage prefix
    assert mask(staged) == {"stage1": {"embed": True, "moe_layers": {"router_bias": False, "w": True}}}


def test_moe_step_balances_router_bias_outside_the_optimizer():
    from shardfn.core.moe import update_expert_bias

    cfg = load_config("moe_tiny", SMALL)
    model = models.get("moe")
    params = model.init(cfg.model, 0)
    params["moe_layers"]["router_bias"] = torch.linspace(
        -0.01, 0.01, params["moe_layers"]["router_bias"].numel()
    ).view_as(params["moe_layers"]["router_bias"])
    opt = make_optimizer(cfg.train, model)
    batch = data.get_batch(data.load_tokens(None), 0, batch_size=4, seq_len=32)
    new, _, metrics = make_train_step(model, cfg.model, opt)(params, opt.init(params), batch)
    _, aux = model.loss_and_aux(params, batch, cfg.model)
    expected = update_expert_bias(params["moe_layers"]["router_bias"], aux["expert_counts"], cfg.model.bias_update_rate)
    torch.testing.assert_close(new["moe_layers"]["router_bias"], expected)  # no AdamW step, no decay
    assert {"loss", "grad_norm", "lr", "ce_loss", "balance_loss"} <= set(metrics)


@pytest.mark.parametrize("config", ["llama_tiny", pytest.param("moe_tiny", marks=pytest.mark.slow)])
def test_step_is_one_dynamo_graph(config):
    # A graph break would split the step (e.g. backward and optimizer) into separately compiled pieces.
    cfg, model, params, opt, batch = _setup(config=config)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(make_train_step(model, cfg.model, opt))(params, opt.init(params), batch)
    assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]


def test_throughput_leaves_out_the_first_step():
    from shardfn.runtime.train import first_step_work, progress_line

    t = load_config(None, ["train.batch_size=4", "train.seq_len=32", "train.log_every=3", "train.steps=9"]).train
    values = {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5}
    history = [{"step": 5, "time_s": 8.1}, {"step": 6, "time_s": 0.1}, {"step": 7, "time_s": 0.3}]
    assert progress_line(t, values, 5, history[:1], "lowering and compiling the step on dp2 x tp2").endswith(
        "grad_norm 0.500  first step (build + compile) 8.1 s")
    assert progress_line(t, values, 5, history[:1]).endswith("first step 8.1 s")
    assert progress_line(t, values, 6, history[:2]).endswith("tok/s 1,280")  # 128 tokens in 0.1 s
    assert progress_line(t, values, 7, history).endswith("tok/s 640")  # 256 in 0.4 s: step 5 left out
    assert first_step_work(load_config(None, ["mesh.dp=2", "mesh.tp=2"])) == ("lowering and compiling the step on "
                                                                             "dp2 x tp2")
    assert first_step_work(load_config(None, ["train.compile=true"])) == (
        "compiling one layer, which every layer then runs (train.compile)")
    assert first_step_work(load_config(None, ["train.compile=whole"])) == "compiling the whole step (train.compile)"
    assert first_step_work(load_config(None)) is None


def test_the_log_gives_the_first_step_its_own_line():
    lines = []
    train(load_config(None, [*SMALL, "train.steps=4", "train.log_every=2"]), log=lines.append)
    assert lines[1].startswith("step 1/4") and " first step " in lines[1] and "tok/s" not in lines[1]
    assert lines[2].startswith("step 2/4") and "tok/s" in lines[2]


@pytest.mark.parametrize("config", ["llama_tiny", "moe_tiny"])
def test_eager_step_matches_the_traced_step(config):
    # Eagerly the step takes its gradient with plain autograd, GQA attention without repeated heads
    # and foreach optimizer kernels; traced (what the partitioner and remat rewrite) it is the
    # torch.func program. They agree to float rounding, within the layouts' parity tolerances,
    # and remat changes no bit of the traced program.
    from shardfn.partition.passes.remat import rematerialized

    cfg, model, params, opt, _ = _setup(["train.warmup_steps=1"], config=config)
    tokens = data.load_tokens(None)
    batches = [data.get_batch(tokens, s, batch_size=4, seq_len=32) for s in range(3)]
    runs = {"eager": make_train_step(model, cfg.model, opt)}
    runs.update({p: rematerialized(make_train_step(model, cfg.model, opt), p) for p in ("none", "full")})
    out = {}
    for name, step in runs.items():
        p, s, losses = params, opt.init(params), []
        for b in batches:
            p, s, m = step(p, s, b)
            losses.append(m["loss"])
        out[name] = (torch.stack(losses), p, s)
    for a, b in zip(tree_leaves(out["full"]), tree_leaves(out["none"])):
        assert torch.equal(a, b)
    torch.testing.assert_close(out["eager"][0], out["none"][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(tree_leaves(out["eager"][1:]), tree_leaves(out["none"][1:])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=3e-5)



def test_compiled_layers_compile_the_repeated_layer_once():
    # train.compile=true: the layer function is compiled on its first call and every layer runs
    # that one compilation, and the optimizer's update is compiled once too; the step computes
    # what the eager step does. Traced, nothing compiles.
    import torch._dynamo

    from shardfn.core.regional import compiled_layers, with_compiled_layers

    graphs = []

    def backend(gm, example_inputs):  # records each graph dynamo hands over, runs it as is
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    cfg, model, params, opt, _ = _setup(["model.n_layers=3"])
    batches = [data.get_batch(data.load_tokens(None), s, batch_size=4, seq_len=32) for s in range(2)]
    eager_step = make_train_step(model, cfg.model, opt)
    compiled_step = with_compiled_layers(make_train_step(model, cfg.model, opt), backend=backend)
    out = {}
    for name, step in (("eager", eager_step), ("compiled", compiled_step)):
        p, s, losses = params, opt.init(params), []
        for b in batches:
            p, s, m = step(p, s, b)
            losses.append(m["loss"])
        out[name] = (torch.stack(losses), p)
    # one layer's graph for 3 layers and 2 steps, and the optimizer's update: a sqrt(v) per leaf,
    # the clipping norm's and the bias correction's
    assert len(graphs) == 2, [len(g.graph.nodes) for g in graphs]
    sqrts = [sum(n.target is torch.sqrt for n in g.graph.nodes) for g in graphs]
    assert sqrts == [0, len(tree_leaves(params)) + 2], sqrts
    torch.testing.assert_close(out["compiled"][0], out["eager"][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(tree_leaves(out["compiled"][1]), tree_leaves(out["eager"][1])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with compiled_layers(backend=backend):  # traced: the plain function, no compilation
        make_fx(lambda p, b: model.loss(p, b, cfg.model))(params, batches[0])
    assert len(graphs) == 2
    torch._dynamo.reset()


def test_train_compile_takes_regional_or_whole_and_refuses_the_rest():
    assert load_config(None, ["train.compile=whole"]).train.compile == "whole"
    assert load_config(None, ["train.compile=true"]).train.compile is True
    with pytest.raises(ValueError, match=r"train.compile must be false, true, regional or whole, got 'fast'"):
        load_config(None, ["train.compile=fast"])


def test_a_donating_step_trains_as_the_pure_one_and_refuses_skip_nonfinite():
    # what `shardfn train` builds (donate=True): the same losses and parameters, bit for bit, as
    # the step that leaves its inputs alone; with train.nonfinite=skip it cannot donate
    cfg = load_config("moe_tiny", SMALL)
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    tokens = data.load_tokens(None)
    runs = []
    for donate in (False, True):
        step = build_step(cfg, model, params, donate=donate)
        p, s = step.place(tree_map(torch.clone, params))
        losses = []
        for i in range(4):
            p, s, m = step(p, s, data.get_batch(tokens, i, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len))
            losses.append(m["loss"])
        runs.append((losses, p, s))
    (l0, p0, s0), (l1, p1, s1) = runs
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((p0, s0)), tree_leaves((p1, s1))))
    with pytest.raises(ValueError, match="train.nonfinite=skip runs without donation"):
        make_train_step(model, cfg.model, make_optimizer(cfg.train, model), skip_nonfinite=True, donate=True)
