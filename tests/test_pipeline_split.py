"""Stage split: valid cuts, balance, errors, per-stage programs, and F/I/W against torch.func.vjp."""

import itertools

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import shardfn as sf
from shardfn.core.pytree import tree_leaves
from shardfn.partition.cost import flops
from shardfn.partition.pipeline import split as pl
from shardfn.partition.pipeline.split import PipelineError, build_pipeline, merge_params, stage_params
from shardfn.partition.spmd import fx as fxh

D, H, V, S = 8, 16, 32, 4


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def layer(w, h):
    x = rms_norm(h, w["norm"])
    return h + (F.silu(x @ w["w1"]) * (x @ w["w3"])) @ w["w2"]    # [B, S, D]


def tiny_loss(p, batch, *, split_every=0, tie=False):
    h = p["embed"][batch["inputs"]]                               # [B, S, D]
    n = p["layers"]["w1"].shape[0]
    for i in range(n):
        h = layer({k: v[i] for k, v in p["layers"].items()}, h)
        if split_every and (i + 1) % split_every == 0 and i + 1 < n:
            h = sf.pipeline_split(h)
    head = p["embed"].t() if tie else p["head"]
    logits = rms_norm(h, p["norm"]) @ head                        # [B, S, V]
    return F.cross_entropy(logits.reshape(-1, V), batch["targets"].reshape(-1))


def tiny_params(n_layers, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / s[-2] ** 0.5  # noqa: E731
    return {
        "embed": torch.randn(V, D, generator=g),
        "layers": {"norm": 1 + 0.1 * torch.randn(n_layers, D, generator=g),
                   "w1": r(n_layers, D, H), "w3": r(n_layers, D, H), "w2": r(n_layers, H, D)},
        "norm": torch.ones(D),
        "head": r(D, V),
    }


def tiny_batch(rows=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {
        "inputs": torch.randint(0, V, (rows, S), generator=g),
        "targets": torch.randint(0, V, (rows, S), generator=g),
    }


def run_stages(pipe, params, batch, dy_scale=1.0):
    """Forward through every stage's F, backward through I and W; returns (loss, full grads)."""
    envs, x = [], None
    for st in pipe.stages:
        env = st.inputs_env(stage_params(params, pipe, st.index), x, batch)
        st.F.run(env)
        x = env[st.y_name]
        envs.append(env)
    loss, dy, grads = x, torch.tensor(dy_scale), {}
    for st, env in reversed(list(zip(pipe.stages, envs))):
        env["dy"] = dy
        st.I.run(env)
        st.W.run(env)
        grads[st.index] = dict(zip(st.param_paths, (env[n] for n in st.grad_names)))
        dy = env[st.dx_name] if st.dx_name else None
    return loss, merge_params(grads, pipe)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ cut points


def test_valid_cuts_are_the_residual_stream_between_layers():
    traced = pl.trace_loss(tiny_loss, tiny_params(3), tiny_batch())
    cuts = pl.valid_cuts(pl.activation_order(traced))
    stream = [c for c in cuts if tuple(c.value.meta["val"].shape) == (2, S, D)
              and c.value.target in (torch.ops.aten.index.Tensor, torch.ops.aten.add.Tensor)]
    # after the embedding, then after each of the 3 layers' residual add
    assert [c.value.target for c in stream] == [torch.ops.aten.index.Tensor] + [torch.ops.aten.add.Tensor] * 3
    assert len({c.position for c in cuts}) == len(cuts)
    # nothing inside a layer is a valid cut: the residual input stays live across it
    positions = [c.position for c in stream]
    assert not [c for c in cuts if positions[0] < c.position < positions[-1] and c not in stream]


def test_choose_cuts_minimises_the_largest_stage():
    costs = [5, 1, 1, 1, 4, 2, 2, 3, 1]
    cuts = [pl.CutPoint(k, None) for k in (1, 2, 4, 5, 7, 8)]
    for n in (2, 3, 4):
        chosen = pl.choose_cuts(costs, cuts, n)
        assert len(chosen) == n - 1

        def worst(sel):
            bounds = [0] + [c.position for c in sel] + [len(costs)]
            return max(sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))

        assert worst(chosen) == min(worst(c) for c in itertools.combinations(cuts, n - 1))


def test_balanced_split_of_equal_layers():
    pipe = build_pipeline(tiny_loss, tiny_params(8), tiny_batch(), 4)
    # each stacked leaf is tiled by the stages' layer ranges, two layers per stage
    assert [s.layer_ranges["layers.w1"] for s in pipe.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for s in pipe.stages:
        assert s.param_specs["layers.w1"].shape == (2, D, H)     # a rank holds only its layers
    assert pipe.stages[0].param_paths[0] == "embed" and "head" in pipe.stages[-1].param_paths
    assert pipe.stages[-1].out_spec.shape == () and pipe.stages[0].in_spec is None
    flops = [s.flops for s in pipe.stages]
    assert max(flops) / min(flops) < 1.5
    assert "4 stages" in pipe.describe()


def test_more_stages_than_cut_points_names_the_config_key():
    with pytest.raises(PipelineError, match=r"into 12 pipeline stages: its loss has only 2 layers \(a stage holds "
                                            r"whole layers\).*lower pipeline.stages \(or mesh.pp\) to 2 or fewer"):
        build_pipeline(tiny_loss, tiny_params(2), tiny_batch(), 12)


def test_tied_parameters_are_held_by_every_stage_that_uses_them():
    params = {k: v for k, v in tiny_params(2).items() if k != "head"}  # the head is embed.T
    pipe = build_pipeline(lambda p, b: tiny_loss(p, b, tie=True), params, tiny_batch(), 2)
    assert pipe.tied == {"embed": [0, 1]}
    assert all("embed" in s.param_paths and "embed" not in s.layer_ranges for s in pipe.stages)
    held = {s: stage_params(params, pipe, s) for s in range(2)}
    assert torch.equal(merge_params(held, pipe)["embed"], params["embed"])


def test_markers_fix_the_cuts():
    loss = lambda p, b: tiny_loss(p, b, split_every=2)  # noqa: E731
    pipe = build_pipeline(loss, tiny_params(6), tiny_batch())
    assert pipe.n_stages == 3
    assert [s.layer_ranges["layers.w1"] for s in pipe.stages] == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(PipelineError, match=r"2 sf.pipeline_split markers \(3 stages\) but 2 stages.*pipeline.stages "
                                            r"to 3"):
        build_pipeline(loss, tiny_params(6), tiny_batch(), 2)


def test_marker_where_two_values_cross_is_refused():
    def loss(p, b):
        h = p["embed"][b["inputs"]]
        g = sf.pipeline_split(h * 2)
        return tiny_loss(p, b) + (g + h).mean()  # h is still live after the marker

    with pytest.raises(PipelineError, match=r"pipeline_split at graph node .* is not a valid stage boundary"):
        build_pipeline(loss, tiny_params(2), tiny_batch())


def test_batch_needs_an_inputs_leaf():
    with pytest.raises(PipelineError, match=r"exactly one leaf named 'inputs'"):
        build_pipeline(lambda p, b: tiny_loss(p, {"inputs": b["tokens"], "targets": b["targets"]}),
                       tiny_params(2), {"tokens": tiny_batch()["inputs"], "targets": tiny_batch()["targets"]}, 2)


# ------------------------------------------------------------------ stage programs and F / I / W


def test_stage_params_round_trip():
    params = tiny_params(4)
    pipe = build_pipeline(tiny_loss, params, tiny_batch(), 3, split=())
    held = {s: stage_params(params, pipe, s) for s in range(3)}
    for a, b in zip(tree_leaves(merge_params(held, pipe)), tree_leaves(params)):
        assert torch.equal(a, b)
    assert all(s.F is None for s in pipe.stages)  # split=() builds no F/I/W programs


@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_stages_compose_to_the_whole_loss_and_grads(n_stages):
    params, batch = tiny_params(4), tiny_batch()
    pipe = build_pipeline(tiny_loss, params, batch, n_stages)
    loss, grads = run_stages(pipe, params, batch)
    ref_grads, ref_loss = torch.func.grad_and_value(tiny_loss)(params, batch)
    _close(loss, ref_loss)
    for a, b in zip(tree_leaves(grads), tree_leaves(ref_grads)):
        _close(a, b)
    # the forward programs alone compose to the loss as well
    x = None
    for st in pipe.stages:
        x = st.run_forward(stage_params(params, pipe, st.index), x, batch)
    _close(x, ref_loss)


def test_fiw_equals_vjp_of_each_stage():
    params, batch = tiny_params(4), tiny_batch()
    pipe = build_pipeline(tiny_loss, params, batch, 3)
    g = torch.Generator().manual_seed(2)
    x = None
    for st in pipe.stages:
        held = stage_params(params, pipe, st.index)
        names = st.param_paths

        def f(ps, *xs):
            return st.run_forward(dict(zip(names, ps)), xs[0] if xs else None, batch)

        primals = ([held[n] for n in names],) + ((x,) if x is not None else ())
        y, vjp_fn = torch.func.vjp(f, *primals)
        dy = torch.randn(y.shape, generator=g)
        cot = vjp_fn(dy)

        env = st.inputs_env(held, x, batch)
        st.F.run(env)
        _close(env[st.y_name], y)
        env["dy"] = dy
        st.I.run(env)
        st.W.run(env)
        for name, want in zip(st.grad_names, cot[0]):
            _close(env[name], want)
        if x is not None:
            _close(env[st.dx_name], cot[1])
        else:
            assert st.I.num_nodes == 0 and st.I.outputs == () and st.dx_name is None  # stage 0: no dx
        x = y


def test_fiw_parts_cut_the_joint_by_dependency():
    pipe = build_pipeline(tiny_loss, tiny_params(4), tiny_batch(), 2)
    st = pipe.stages[1]
    assert "dy" not in st.F.inputs and "dy" in st.I.inputs
    assert st.dx_name in st.I.outputs
    assert set(st.grad_names) <= set(st.W.outputs) | set(st.I.outputs) | set(st.F.outputs)
    # W needs no incoming activation that I does not hand over: only saved values and parameters
    assert all(not n.startswith("data:inputs") for n in st.W.inputs)
    # parameter views (w[i], w.t()) are re-made in each part, never saved from F
    assert not [n for n in st.F.outputs if n.startswith("select") or n.startswith("t_")]


def test_stacked_grads_are_one_stack_not_a_sum_of_zero_padded_slices():
    pipe = build_pipeline(tiny_loss, tiny_params(4), tiny_batch(), 2)
    for st in pipe.stages:
        targets = {n.target for n in st.W.graph_module.graph.nodes}
        assert torch.ops.aten.select_backward.default not in targets
        assert torch.ops.aten.stack.default in targets


def test_extract_subgraph():
    def f(x, w):
        return torch.relu(x @ w) + 1

    gm = fx.symbolic_trace(f)
    nodes = {n.name: n for n in gm.graph.nodes}
    sub = fxh.extract_subgraph(
        gm, [nodes["matmul"], nodes["relu"]], [nodes["x"], nodes["w"]], [nodes["relu"], nodes["x"]]
    )
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    relu, x_out = sub(x, w)
    assert torch.equal(relu, torch.relu(x @ w)) and x_out is x
    with pytest.raises(AssertionError, match="neither an input nor in the subgraph"):
        fxh.extract_subgraph(gm, [nodes["relu"]], [nodes["x"]], [nodes["relu"]])


def test_node_flops_of_a_matmul():
    traced = pl.trace_loss(tiny_loss, tiny_params(1), tiny_batch())
    mms = [n for n in traced.graph_module.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert flops.node_flops(mms[0]) == 2 * (2 * S) * D * H       # [8, 8] @ [8, 16]


@pytest.mark.parametrize("count", [None, lambda x, w: 7.0 * x.shape[0]])
def test_node_flops_of_a_local_map_region_is_its_own_count(count):
    # a region is one node whose work is hidden (an MoE exchange): stages are balanced by what it says
    region = sf.local_map(lambda x, w: x @ w, in_specs=(sf.P(), sf.P()), out_specs=sf.P(), flops=count)
    traced = pl.trace_loss(lambda p, b: region(p["embed"][b["inputs"]], p["head"]).sum(), tiny_params(1), tiny_batch())
    node = next(n for n in traced.graph_module.graph.nodes if n.target is torch.ops.shardfn.local_region.default)
    assert flops.node_flops(node) == (7.0 * 2 if count else 2 * S * V)    # x: [2, S, D]; output [2, S, V]


def test_llama_tiny_split_matches_the_model():
    from shardfn import models

    llama = models.get("llama")
    cfg = llama.Config(n_layers=2)
    params = llama.init(cfg, 0)
    g = torch.Generator().manual_seed(0)
    batch = {"inputs": torch.randint(0, cfg.vocab_size, (2, 8), generator=g),
             "targets": torch.randint(0, cfg.vocab_size, (2, 8), generator=g)}
    loss_fn = lambda p, b: llama.loss(p, b, cfg)  # noqa: E731
    pipe = build_pipeline(loss_fn, params, batch, 2)
    # stages hold whole layers (the cut is between layer 0 and layer 1): each leaf's layers are held once
    for path, spec in pipe.param_specs.items():
        held = [pipe.stages[s].layer_ranges.get(path, (0, spec.shape[0])) for s in pipe.owner[path]]
        assert sum(b - a for a, b in held) == spec.shape[0], path
    loss, grads = run_stages(pipe, params, batch)
    ref_grads, ref_loss = torch.func.grad_and_value(loss_fn)(params, batch)
    _close(loss, ref_loss)
    for a, b in zip(tree_leaves(grads), tree_leaves(ref_grads)):
        _close(a, b)


def test_split_costs_is_the_best_split_and_never_empties_a_stage():
    # against every split by brute force; (9, 4, 4, 6) into 4 stages once gave [3, 1, 3]
    import random

    assert pl.split_costs([9.46, 3.99, 3.99, 6.13], 4) == [1, 2, 3]
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, 2.0, 5.0, rng.random() * 10]) for _ in range(n)]
        got = pl.split_costs(costs, k)
        assert got == sorted(set(got)) and len(got) == k - 1 and all(0 < c < n for c in got)
        worst = max(sum(costs[a:b]) for a, b in zip([0, *got], [*got, n]))
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *c), (*c, n)))
                   for c in itertools.combinations(range(1, n), k - 1))
        assert worst == pytest.approx(best)
