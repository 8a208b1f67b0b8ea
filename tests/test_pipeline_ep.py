"""Pipeline stages with expert-parallel MoE layers (pp x ep): moe_tiny on real gloo ranks gives
the one-device losses, first-step gradients and parameters after 3 steps (router-bias balancing
included), for several schedules, from the library and from the train command."""

import json
import re

import pytest
import torch
from parity import assert_matches, reference, setup

from shardfn.config import load_config, resolve_path
from shardfn.core.pytree import flatten_with_paths, tree_leaves
from shardfn.runtime.launch import spawn
from shardfn.runtime.pipeline_step import build_pipeline_step

MOE = str(resolve_path("moe_tiny"))
SCHEDULES = ("1f1b", "zbh1", "interleaved_1f1b", "dualpipev", "dualpipev:turns")
FOUR_LAYERS = ["model.n_layers=4"]  # interleaved_1f1b on pp2 runs 4 stages, and a stage holds whole layers


@pytest.fixture(scope="module")
def ref():
    return reference(MOE, FOUR_LAYERS)


def _pipeline_ep_worker(overrides, schedules):
    """Per schedule: the losses, the first step's gradients and the final params, all full trees
    (``"name:turns"``: the schedule with its overlapped pairs taking turns at their exchanges)."""
    out = {}
    for name in schedules:
        schedule, _, turns = name.partition(":")
        cfg, model, params, _, batches = setup([*FOUR_LAYERS, *overrides, f"pipeline.schedule={schedule}",
                                                f"pipeline.overlap_pairs={bool(turns)}"], MOE)
        step = build_pipeline_step(cfg, model, params, record=bool(turns))  # the pairs' trace: EP waits
        local = step.scatter(params)
        state = step.optimizer.init(local)
        losses, grads, loads = [], None, []
        for b in batches:
            local, state, metrics = step(local, state, b)
            grads = step.gather(step.last_grads) if grads is None else grads
            losses.append(metrics["loss"])
            loads.append(metrics["expert_load_max_over_mean/0"])
        held = {p: tuple(t.shape) for p, t in flatten_with_paths(local) if ".experts." in p}
        parts = {(s, k): [str(n.target) for n in getattr(step.pipe.stages[s], k).graph_module.graph.nodes
                          if str(n.target).startswith("shardfn.ep_experts")] for s in step.stages for k in "FIW"}
        turns = [(f, b, [(who, event) for who, event, _ in log]) for f, b, log in step.last_run.turns]
        exchange_waits = [e["name"] for e in step.last_run.events if e["kind"] == "EP"]
        out[name] = {"losses": torch.stack(losses), "grads": grads, "params": step.gather(local), "loads": loads,
                     "held": held, "parts": parts, "turns": turns, "exchange_waits": exchange_waits}
    return out


def _max_diff(out, ref):
    ref_grads, ref_params = ref.grads, ref.params
    worst = {"losses": (out["losses"] - ref.losses).abs().max().item()}
    for key, tree in (("grads", ref_grads), ("params", ref_params)):
        worst[key] = max((a - b).abs().max().item() for a, b in zip(tree_leaves(out[key]), tree_leaves(tree)))
    return worst


def check_parity(ref, overrides, nproc, schedules):
    per_rank = spawn(_pipeline_ep_worker, nproc, args=(overrides, schedules), timeout_s=600)
    for name in schedules:
        got = [r[name] for r in per_rank]
        assert_matches(got, ref)
        print(name, overrides, _max_diff(got[0], ref))
    return per_rank


@pytest.fixture(scope="module")
def pp2_ep2_runs(ref):
    return check_parity(ref, ["mesh.pp=2", "mesh.ep=2", "pipeline.microbatches=4"], 4, SCHEDULES)


@pytest.mark.slow  # every schedule; the train command's pp2 x ep2 run below holds the default one in the default suite
def test_pp2_ep2_matches_one_device(pp2_ep2_runs):
    per_rank = pp2_ep2_runs
    held = [shape for r in per_rank for shape in r["1f1b"]["held"].values()]
    assert held and all(shape[1] == 8 // 2 for shape in held)   # [layers, E / ep, ...] on every ep rank
    # the exchange is one opaque op in F and its backward (expert weight grads included) one in I;
    # on stage 0, which has no input gradient, the backward is in W
    parts = {key: ops for r in per_rank for key, ops in r["zbh1"]["parts"].items()}
    moe_stages = {s for (s, k), ops in parts.items() if ops}
    assert moe_stages == {0, 1}
    for s in moe_stages:
        backward = ["shardfn.ep_experts_backward.default"] * len(parts[(s, "F")])
        assert parts[(s, "F")] == ["shardfn.ep_experts.default"] * len(parts[(s, "F")])
        assert (parts[(s, "I")], parts[(s, "W")]) == ((backward, []) if s else ([], backward))


@pytest.mark.slow
def test_pp2_ep2_dualpipev_pairs_compute_while_the_other_members_all_to_all_is_in_flight(pp2_ep2_runs):
    """DualPipeV's overlapped pairs (an F and the other chunk's B) take turns at their MoE
    exchange waits: the B starts once the F has issued its first all-to-all and is waiting on
    it, and so on, in the same order on every rank. Results are bitwise those of running the
    two one after the other."""
    per_rank = pp2_ep2_runs
    for r in per_rank:
        overlapped, serial = r["dualpipev:turns"], r["dualpipev"]
        assert torch.equal(overlapped["losses"], serial["losses"])
        for key in ("grads", "params"):
            assert all(torch.equal(a, b) for a, b in zip(tree_leaves(overlapped[key]), tree_leaves(serial[key])))
        assert serial["turns"] == []
    # pp rank 1 (global ranks 2, 3) runs F2@s1 + B0@s2 first: a one-layer MoE stage each
    turns = {f"{f}+{b}": log for f, b, log in per_rank[2]["dualpipev:turns"]["turns"]}
    assert set(turns) == {"F2@s1+B0@s2", "F2@s2+B0@s1", "F3@s1+B1@s2"}
    assert [r["dualpipev:turns"]["turns"] for r in per_rank[2:]] == [per_rank[2]["dualpipev:turns"]["turns"]] * 2
    log = turns["F2@s1+B0@s2"]
    # F: counts exchange, dispatch, combine; B: the two gradient exchanges. Each wait hands the turn over.
    assert log[:4] == [(0, "start"), (0, "handoff"), (1, "start"), (1, "handoff")]
    assert [e for who, e in log if who == 0].count("handoff") == 3
    assert [e for who, e in log if who == 1].count("handoff") == 2
    assert log.index((1, "start")) < log.index((0, "end")) and log.index((0, "start")) < log.index((1, "end"))
    # the trace shows them: one EP stretch per handoff that the member's program resumed after
    waits = per_rank[2]["dualpipev:turns"]["exchange_waits"]
    assert waits.count("EXCHANGE_F2@s1") == 3 and waits.count("EXCHANGE_B0@s2") == 2


@pytest.mark.slow
def test_pp2_dp2_moe_matches_one_device(ref):
    """Without ep every stage holds whole experts (grouped GEMMs in its programs); the router bias
    is balanced from the counts of both dp replicas."""
    per_rank = check_parity(ref, ["mesh.pp=2", "mesh.dp=2", "pipeline.microbatches=2"], 4, ("zbh1",))
    assert all(shape[1] == 8 for r in per_rank for shape in r["zbh1"]["held"].values())


@pytest.mark.slow
def test_pp2_dp2_ep2_matches_one_device(ref):
    check_parity(ref, ["mesh.pp=2", "mesh.dp=2", "mesh.ep=2", "pipeline.microbatches=2"], 8, ("1f1b",))


@pytest.mark.parametrize("overrides, key, words", [
    (["mesh.pp=2", "mesh.ep=3", "train.batch_size=12"], "mesh.ep",
     r"3 does not divide model\.n_experts = 8.*\[1, 2, 4, 8\]"),
    (["mesh.pp=2", "pipeline.schedule=interleaved_1f1b", "pipeline.microbatches=2"], "mesh.pp",
     r"2 ranks x 2 stages each = 4 stages for 3 layers"),
    (["mesh.pp=2", "mesh.fsdp=2", "pipeline.microbatches=3"], "pipeline.microbatches", r"does not divide"),
    (["mesh.pp=2", "rules.layers=fsdp", "mesh.fsdp=2"], "rules.layers", r"pipeline stages split the layers"),
])
def test_a_bad_pipeline_layout_is_refused_before_any_rank_starts(overrides, key, words, capsys):
    from shardfn import cli

    code = cli.main(["train", "--config", "moe_tiny", "--nproc", str(_world(overrides)), *overrides])
    err = capsys.readouterr().err
    assert code == 2 and err.count(f"{key}:") == 1 and "Traceback" not in err
    assert re.search(words, err), err


def _world(overrides):
    n = 1
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith("mesh."):
            n *= int(value)
    return n


def test_train_command_pp2_ep2_matches_one_device(tmp_path, capfd):
    from shardfn import cli
    from shardfn.runtime.train import train

    common = ["train.steps=3", "train.seq_len=32", "train.warmup_steps=1", "train.log_every=1"]
    want = train(load_config(MOE, common), log=lambda line: None).history
    metrics = tmp_path / "m.jsonl"
    code = cli.main(["train", "--config", "moe_tiny", "--nproc", "4", "--metrics", str(metrics), *common,
                     "mesh.pp=2", "mesh.ep=2", "pipeline.schedule=1f1b", "pipeline.microbatches=4"])
    assert code == 0
    got = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", "lr", "expert_load_max_over_mean/0", "expert_load_max_over_mean/1"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), key
    out = capfd.readouterr().out
    assert out.count("step 3/3") == 1   # rank 0 logs, the other ranks stay quiet
