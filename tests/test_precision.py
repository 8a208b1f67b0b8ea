"""Mixed precision (core/precision.py, train.precision): fp32 master weights and optimizer state,
bf16 compute, fp32 gradient reduction; and the planner's bytes equal the run's for every
precision x remat combination on a 2-rank fsdp mesh."""

import pytest
import torch
from parity import BASE

from shardfn import models
from shardfn import plan as pl
from shardfn.config import load_config
from shardfn.core.precision import get_policy, with_policy
from shardfn.core.pytree import tree_leaves
from shardfn.core.transforms import value_and_grad
from shardfn.runtime import data
from shardfn.runtime.build import build_step
from shardfn.runtime.param_source import abstract
from shardfn.runtime.train import train

COMBOS = [(p, r) for p in ("fp32", "bf16") for r in ("none", "selective", "full")]


def test_with_policy_computes_in_bf16_and_returns_fp32_gradients():
    seen = []

    def loss(w, x):
        seen.append(w.dtype)
        return (x @ w).square().mean()

    w, x = torch.randn(8, 4), torch.randn(3, 8)
    value, grad = value_and_grad(with_policy(loss, get_policy("bf16")))(w, x.bfloat16())
    assert seen == [torch.bfloat16] and value.dtype == torch.float32 and grad.dtype == torch.float32
    want = value_and_grad(loss)(w.bfloat16(), x.bfloat16())[1].float()
    assert torch.equal(grad, want)  # the cast's backward only changes the dtype
    with pytest.raises(ValueError, match=r"train\.precision: 'fp16' is not a precision; use one of fp32, bf16"):
        get_policy("fp16")


@pytest.mark.slow  # two whole default runs; test_master_weights_... holds bf16 to fp32 in the default suite
def test_bf16_default_run_ends_within_3_percent_of_fp32():
    final = {p: train(load_config(None, [f"train.precision={p}"]), log=lambda line: None).history[-1]["loss"]
             for p in ("fp32", "bf16")}
    assert abs(final["bf16"] - final["fp32"]) <= 0.03 * final["fp32"], final


def _one_device(overrides, steps):
    cfg = load_config("llama_tiny", [*BASE, *overrides])
    model = models.get(cfg.model_name)
    step = build_step(cfg, model, abstract(model.init(cfg.model, 0, device="meta"), "cpu"))
    params, state = step.place(model.init(cfg.model, 0))
    tokens = data.from_config(cfg.data)
    losses = []
    for s in range(steps):
        params, state, m = step(params, state, data.get_batch(tokens, s, batch_size=8, seq_len=32, seed=0))
        losses.append(m["loss"])
    return params, state, torch.stack(losses)


def test_master_weights_and_optimizer_state_stay_fp32_and_training_follows_fp32():
    params, state, losses = _one_device(["train.precision=bf16"], 3)
    assert {x.dtype for x in tree_leaves(params)} == {torch.float32}
    assert {x.dtype for x in tree_leaves(state) if x.is_floating_point()} == {torch.float32}
    _, _, fp32 = _one_device([], 3)
    assert not torch.equal(losses, fp32)  # it did compute in bf16
    torch.testing.assert_close(losses, fp32, rtol=2e-3, atol=0)


def test_a_bf16_run_resumes_bitwise(tmp_path):
    over = ["train.precision=bf16", "train.steps=4", "train.batch_size=4", "train.seq_len=32", "train.log_every=100"]
    straight = [r["loss"] for r in train(load_config(None, over), log=lambda line: None).history]
    d = f"train.checkpoint.dir={tmp_path}"
    first = train(load_config(None, [*over, "train.steps=2", "train.checkpoint.every=2", d]), log=lambda line: None)
    rest = train(load_config(None, [*over, "train.checkpoint.every=2", d]), log=lambda line: None)
    assert [r["loss"] for r in first.history] == straight[:2]
    assert [r["step"] for r in rest.history] == [3, 4] and [r["loss"] for r in rest.history] == straight[2:]


def _comm(lowered, op):
    return sum(r["bytes"] for r in lowered.comm_report() if r["op"] == op and r["axis"] == "fsdp")


@pytest.mark.parametrize("config", ["llama_tiny", "moe_tiny"])
def test_fsdp2_gathers_move_bf16_and_gradients_reduce_in_fp32(config, clean_process_group):
    from shardfn.plan.profile import lower_step

    steps = {p: lower_step(load_config(config, [*BASE, "mesh.fsdp=2", f"train.precision={p}"]))
             for p in ("fp32", "bf16")}
    assert _comm(steps["bf16"], "all_gather") * 2 == _comm(steps["fp32"], "all_gather") > 0
    assert _comm(steps["bf16"], "reduce_scatter") == _comm(steps["fp32"], "reduce_scatter") > 0
    report = steps["bf16"].memory_report()  # the state the step holds is fp32 master weights
    assert report["params"] == steps["fp32"].memory_report()["params"]
    assert report["activations"] < steps["fp32"].memory_report()["activations"]


# ------------------------------------------------------------------ real ranks: layouts and the plan


def _steps(config, overrides, steps=2):
    """``config`` built for its layout and stepped ``steps`` times: the step, its state, the losses."""
    cfg = load_config(config, [*BASE, *overrides])
    model = models.get(cfg.model_name)
    step = build_step(cfg, model, abstract(model.init(cfg.model, 0, device="meta"), "cpu"))
    params, state = step.place(model.init(cfg.model, 0))
    tokens = data.from_config(cfg.data)
    losses = []
    for s in range(steps):
        params, state, m = step(params, state, data.get_batch(tokens, s, batch_size=8, seq_len=32, seed=0))
        losses.append(float(m["loss"]))
    return step, params, state, losses


def _ranks_worker(runs):
    """Each ``(config, overrides, steps)`` on these ranks: losses, dtypes, reports."""
    from torch.distributed.tensor import DTensor

    from shardfn.runtime.launch import progress

    out = []
    for i, (config, overrides, steps) in enumerate(runs):
        progress(i)  # the launcher's timeout counts from the last run started, not from the first
        step, params, state, losses = _steps(config, overrides, steps)
        local = [x.to_local() if isinstance(x, DTensor) else x for x in tree_leaves((params, state))]
        out.append({"losses": losses, "dtypes": {str(x.dtype) for x in local if x.is_floating_point()},
                    "memory": step.memory_report(), "comm": step.comm_report()})
    return out


LAYOUTS = [("llama_tiny", ["mesh.fsdp=2", "train.precision=bf16"]),
           ("llama_tiny", ["mesh.pp=2", "pipeline.microbatches=2", "train.precision=bf16"]),
           ("moe_tiny", ["mesh.ep=2", "train.precision=bf16"])]
LAYOUT_STEPS = 4


DEFAULT_PLANS = {("llama_tiny", "fp32", "none"), ("llama_tiny", "bf16", "selective"), ("moe_tiny", "bf16", "full")}
"""The precision and remat combinations the default suite holds the plan to; the other nine are slow."""


def _plan_runs(default: bool) -> list:
    return [(c, ["mesh.fsdp=2", f"train.precision={p}", f"train.remat={r}"])
            for c in ("llama_tiny", "moe_tiny") for p, r in COMBOS if ((c, p, r) in DEFAULT_PLANS) == default]


def _on_two_ranks(runs, layouts=0):
    """Every ``(config, overrides)`` of ``runs`` in one 2-rank spawn: the first ``layouts`` for
    ``LAYOUT_STEPS`` steps, the others 2."""
    from shardfn.runtime.launch import spawn

    per_rank = spawn(_ranks_worker, 2, args=([(c, o, LAYOUT_STEPS if i < layouts else 2)
                                               for i, (c, o) in enumerate(runs)],), timeout_s=900)
    return {(c, *o): [rank[i] for rank in per_rank] for i, (c, o) in enumerate(runs)}


@pytest.fixture(scope="module")
def ranks():
    return _on_two_ranks(LAYOUTS + _plan_runs(default=True), layouts=len(LAYOUTS))


@pytest.fixture(scope="module")
def slow_ranks():
    return _on_two_ranks(_plan_runs(default=False))


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["fsdp2", "pp2", "moe-ep2"])
def test_bf16_trains_on_every_layout_with_fp32_state(ranks, index):
    config, overrides = LAYOUTS[index]
    want = _steps(config, ["train.precision=bf16"], LAYOUT_STEPS)[3]  # the same run on one device
    assert want[-1] < want[0] - 0.5  # each step moves the loss by ~5%, far above the tolerance below
    for rank in ranks[(config, *overrides)]:
        assert rank["dtypes"] == {"torch.float32"}
        # a layout sums in another order than one device: ~5e-5 apart after 4 bf16 steps (measured)
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(want), rtol=1e-3, atol=0)


@pytest.mark.parametrize("config, precision, remat", [
    (c, p, r) if (c, p, r) in DEFAULT_PLANS else pytest.param(c, p, r, marks=pytest.mark.slow)
    for c in ("llama_tiny", "moe_tiny") for p, r in COMBOS])
def test_the_plan_is_the_run_for_every_precision_and_remat(request, config, precision, remat, clean_process_group):
    ranks = request.getfixturevalue("ranks" if (config, precision, remat) in DEFAULT_PLANS else "slow_ranks")
    overrides = ["mesh.fsdp=2", f"train.precision={precision}", f"train.remat={remat}"]
    plan = pl.make_plan(load_config(config, [*BASE, *overrides]))
    assert (plan.precision, plan.remat) == (precision, remat)
    for rank in ranks[(config, *overrides)]:
        memory = rank["memory"]
        assert (plan.per_rank["params_bytes"], plan.per_rank["grads_bytes"], plan.per_rank["opt_state_bytes"],
                plan.per_rank["step_temporary_bytes"]) == \
            (memory["params"], memory["grads"], memory["opt_state"], memory["activations"])
        key = lambda r: (r["op"], r["axis"])  # noqa: E731
        planned = sorted(({k: r[k] for k in ("op", "axis", "bytes", "count")} for r in plan.comm
                          if r["source"] == "trace"), key=key)
        # counted per tensor: buckets merge gradient reductions at run time, bytes unchanged
        static = [{**{k: r[k] for k in ("op", "axis", "bytes")}, "count": r.get("tensors", r["count"])}
                  for r in rank["comm"]]
        assert planned == sorted(static, key=key)
