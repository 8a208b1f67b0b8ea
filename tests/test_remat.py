"""Activation checkpointing (partition/passes/remat.py): the same bits as no remat, less memory held.

fp32 results of ``train.remat: full`` and ``selective`` equal ``none`` bitwise, on one device
(the step's traced graph, rewritten, against that graph as traced) and on 2 gloo ranks with fsdp
(the pass runs after trace, before propagation); the memory report's activations fall as the policy saves less.
"""

import dataclasses

import pytest
import torch
from parity import BASE

from shardfn import models
from shardfn.config import load_config
from shardfn.core.pytree import tree_leaves
from shardfn.partition.passes.remat import check_policy, remat, rematerialized, saves_matmuls
from shardfn.partition.spmd.trace import trace
from shardfn.runtime import data
from shardfn.runtime.build import build_step
from shardfn.runtime.param_source import abstract

POLICIES = ("none", "selective", "full")


def run_config(config, overrides, steps=3, *, traced=False):
    """Three steps of ``config``; ``traced``: one device's step run as its traced graph with no
    rewrite (remat ``none`` otherwise runs eagerly, where the optimizer's foreach forms round its
    norm and moments apart from the traced ones by ~1e-9)."""
    cfg = load_config(config, [*BASE, *overrides])
    model = models.get(cfg.model_name)
    step = build_step(cfg, model, abstract(model.init(cfg.model, 0, device="meta"), "cpu"))
    if traced:
        step = dataclasses.replace(step, run=rematerialized(step.run, "none"))
    params, state = step.place(model.init(cfg.model, cfg.train.seed))
    tokens = data.from_config(cfg.data)
    metrics = []
    for s in range(steps):
        batch = data.get_batch(tokens, s, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0)
        params, state, m = step(params, state, batch)
        metrics.append(m)
    return step.full_params(params), state, metrics


@pytest.mark.parametrize("config", ["llama_tiny", "moe_tiny"])
def test_remat_is_bitwise_none_on_one_device(config):
    runs = {policy: run_config(config, [f"train.remat={policy}"], traced=policy == "none") for policy in POLICIES}
    params, state, metrics = runs["none"]
    for policy in ("selective", "full"):
        p, s, m = runs[policy]
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(p), tree_leaves(params))), policy
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(s), tree_leaves(state))), policy
        for got, want in zip(m, metrics):
            assert all(torch.equal(got[k], want[k]) for k in want), policy


def _fsdp_worker(runs):
    import torch.distributed as dist

    from shardfn.runtime.partitioned import full

    out = []
    for config, overrides in runs:
        params, _, metrics = run_config(config, overrides)
        threads = dist.group.WORLD._get_backend(torch.device("cpu")).options._threads
        out.append({"params": full(params), "losses": torch.stack([m["loss"] for m in metrics]), "threads": threads})
    return out


@pytest.mark.slow  # the one-device and CLI tests hold remat bitwise in the default suite
def test_remat_is_bitwise_none_on_fsdp2():
    from shardfn.runtime.launch import spawn

    runs = [(c, ["mesh.fsdp=2", f"train.remat={p}"]) for c in ("llama_tiny", "moe_tiny") for p in POLICIES]
    out = spawn(_fsdp_worker, 2, args=(runs,), timeout_s=600)
    for rank in out:
        # the overlap pass is on under fsdp: its collectives in flight together need gloo's one
        # worker thread (two corrupted the heap)
        assert {run["threads"] for run in rank} == {1}
        for i in range(0, len(runs), len(POLICIES)):
            ref = rank[i]
            for got in rank[i + 1:i + len(POLICIES)]:
                assert torch.equal(got["losses"], ref["losses"])
                assert all(torch.equal(a, b) for a, b in zip(tree_leaves(got["params"]), tree_leaves(ref["params"])))


def _activations(config, remat_policy, mesh=("mesh.fsdp=2",)):
    from shardfn.plan.profile import lower_step

    # the unscheduled program: the overlap pass's prefetched gathers would add their own bytes
    cfg = load_config(config, ["train.batch_size=8", "train.seq_len=128", *mesh, f"train.remat={remat_policy}",
                               "partition.overlap=false"])
    return lower_step(cfg).memory_report()["activations"]


@pytest.mark.slow  # test_one_device_program_holds_less_with_each_policy holds it in the default suite
def test_memory_report_activations_fall_with_the_policy(clean_process_group):
    # peak bytes of the values one fsdp2 rank's step program makes (8 x 128 tokens, fp32);
    # full keeps only each layer's input across the forward, selective also its matmul outputs
    measured = {policy: _activations("llama_tiny", policy) for policy in POLICIES}
    assert measured == {"none": 8562692, "selective": 5538052, "full": 5279748}
    # moe_tiny on fsdp2 (each value's bytes held until the last use of it or of a view of it)
    moe = {policy: _activations("moe_tiny", policy) for policy in POLICIES}
    assert moe == {"none": 13859468, "selective": 11000460, "full": 7561100}


def test_one_device_program_holds_less_with_each_policy():
    from shardfn.partition.spmd.report import peak_temporary_bytes
    from shardfn.runtime.train_step import make_optimizer, make_train_step

    cfg = load_config("moe_tiny", ["train.batch_size=8", "train.seq_len=128"])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    opt = make_optimizer(cfg.train, model)
    batch = data.get_batch(data.from_config(cfg.data), 0, batch_size=8, seq_len=128, seed=0)
    step = make_train_step(model, cfg.model, opt)
    peak = {p: peak_temporary_bytes(remat(trace(step, (params, opt.init(params), batch)).graph_module, p))
            for p in POLICIES}
    assert peak == {"none": 31035596, "selective": 21471500, "full": 13660396}


def _toy_step():
    from shardfn.core.transforms import value_and_grad

    def loss(p, x):
        for i in range(3):
            x = torch.tanh(x @ p["w"][i]) + x
        return (x ** 2).mean()

    def step(p, x):
        value, grads = value_and_grad(loss)(p, x)
        return value, grads

    return step, {"w": torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(0)) * 0.3}, torch.randn(4, 8)


def _backward_reads(gm):
    """Forward values (computed before the gradient seed) that nodes after the seed read."""
    nodes = list(gm.graph.nodes)
    seed = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.ones_like.default)
    before = set(nodes[:seed])
    return {a.target for n in nodes[seed:] for a in n.all_input_nodes if a in before and a.op == "call_function"}


def test_policies_save_what_they_name():
    step, params, x = _toy_step()
    graphs = {p: remat(trace(step, (params, x)).graph_module, p) for p in ("none", "selective", "full")}
    aten = torch.ops.aten
    assert aten.tanh.default in _backward_reads(graphs["none"])        # kept for tanh's backward
    assert aten.tanh.default not in _backward_reads(graphs["full"])    # recomputed from the layer input
    assert aten.mm.default in _backward_reads(graphs["selective"])     # the matmul outputs are saved
    assert aten.mm.default not in _backward_reads(graphs["full"])
    for gm in graphs.values():
        got = gm(params["w"], x)
        want = graphs["none"](params["w"], x)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    only_tanh = remat(trace(step, (params, x)).graph_module, lambda n: n.target is aten.tanh.default)
    assert aten.tanh.default in _backward_reads(only_tanh) and aten.mm.default not in _backward_reads(only_tanh)
    assert saves_matmuls(next(n for n in graphs["none"].graph.nodes if n.target is aten.mm.default))


def test_a_bad_policy_names_the_key():
    with pytest.raises(ValueError, match=r"remat: 'some' is not a remat policy; use one of none, full, selective"):
        check_policy("some")
    with pytest.raises(ValueError, match=r"train\.remat must be one of none, full, selective, got 'all'"):
        load_config(None, ["train.remat=all"])


def test_shardfn_train_remat_full_gives_none_losses_to_the_bit(tmp_path, monkeypatch, capsys):
    # remat none runs the model eagerly, full as its traced graph rewritten: the same ops, so the
    # same losses (at these shapes an eager-only RMSNorm backward parts the third loss by 4.8e-7)
    import json

    from shardfn import cli

    monkeypatch.chdir(tmp_path)
    losses = {}
    for policy in ("none", "full"):
        path = tmp_path / f"{policy}.jsonl"
        assert cli.main(["train", "train.steps=3", "train.batch_size=16", "train.seq_len=32",
                         f"train.remat={policy}", "--metrics", str(path)]) == 0
        losses[policy] = [json.loads(line)["loss"] for line in path.read_text().splitlines()]
    assert len(losses["none"]) == 3 and losses["none"][2] < losses["none"][0]
    assert losses["full"] == losses["none"]
