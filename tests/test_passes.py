"""Graph passes at the named points of sf.jit's flow (docs/passes.md): each runs once per
lowering, sees what its point promises (placements after propagate, collectives after lower),
and its rewrite is in the per-rank program."""

import pytest
import torch

import shardfn as sf
from shardfn import P
from shardfn.partition.passes.remat import remat_pass

aten = torch.ops.aten


def _step(w, x):
    return torch.relu(x @ w).sum(-1)


@pytest.fixture
def mesh(clean_process_group):
    return sf.Mesh({"dp": 2, "tp": 2}, fake=True)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_pass_after_propagate_runs_once_and_its_rewrite_is_in_the_program(mesh):
    calls = []

    def relu_to_gelu(gm):
        placed = {n.name: n.meta.get("sf_placements") for n in gm.graph.nodes if n.op == "call_function"}
        calls.append(placed)
        for n in gm.graph.nodes:
            if n.target is aten.relu.default:
                n.target = aten.gelu.default
        gm.recompile()
        return gm

    w, x = torch.randn(8, 4), torch.randn(6, 8)
    jitted = sf.jit(_step, mesh, in_specs=(P(None, "tp"), P("dp")), out_specs=P("dp"), backend=None,
                    passes={"after_propagate": [relu_to_gelu]})
    lowered = jitted.lower(w, x)
    jitted.lower(w, x)  # cached: no second lowering, no second call
    assert len(calls) == 1
    assert any(p is not None for p in calls[0].values())  # it saw placements
    assert aten.gelu.default in _targets(lowered.graph_module)
    assert aten.relu.default not in _targets(lowered.graph_module)
    assert "gelu" in lowered.as_text()


def test_passes_after_trace_and_after_lower(mesh):
    seen = {}

    def count(point):
        def run(gm):
            seen[point] = seen.get(point, 0) + 1
            seen[point + "_collectives"] = sum("_c10d_functional" in str(t) for t in _targets(gm))
            return gm
        return run

    w, x = torch.randn(8, 4), torch.randn(6, 8)
    sf.jit(_step, mesh, in_specs=(P("tp", None), P("dp", "tp")), out_specs=P("dp"), backend=None,
           passes={"after_trace": count("after_trace"), "after_lower": [count("after_lower")]}).lower(w, x)
    assert seen["after_trace"] == seen["after_lower"] == 1
    assert seen["after_trace_collectives"] == 0 and seen["after_lower_collectives"] > 0


def test_remat_is_a_pass():
    def loss(w, x):
        return torch.tanh(torch.tanh(x @ w[0]) @ w[1]).square().mean()

    def step(w, x):
        return torch.func.grad(loss)(w, x)

    from shardfn.partition.spmd.trace import trace

    w, x = torch.randn(2, 8, 8), torch.randn(4, 8)
    gm = remat_pass("full")(trace(step, (w, x)).graph_module)
    assert any("sf_remat" in n.meta for n in gm.graph.nodes)
    assert torch.equal(gm(w, x)[0], torch.func.grad(loss)(w, x))


def test_a_bad_pass_names_the_point_and_the_pass(mesh):
    with pytest.raises(ValueError, match=r"unknown point 'after_compile'; passes run at after_trace, after_propagate"):
        sf.jit(_step, mesh, passes={"after_compile": [lambda gm: gm]})
    w, x = torch.randn(8, 4), torch.randn(6, 8)

    def forgets(gm):
        return None

    with pytest.raises(TypeError, match=r"sf.jit pass 'forgets' at after_trace returned NoneType"):
        sf.jit(_step, mesh, backend=None, passes={"after_trace": [forgets]}).lower(w, x)


def test_the_pass_pipeline_runs_the_defaults_then_the_users(mesh):
    from shardfn.partition.passes.points import PassPipeline

    def mine(gm):
        return gm

    jit_passes = PassPipeline.of({"after_lower": mine}, bucket_bytes=1 << 20)
    assert [fn.__name__ for fn in jit_passes.at("after_lower")] == ["read_grouped_heads", "bucket_1048576", "mine"]
    run_passes = PassPipeline(remat="full", overlap=True, user={"after_trace": [mine]})
    assert [fn.__name__ for fn in run_passes.at("after_trace")] == ["remat_full", "mine"]
    assert [fn.__name__ for fn in run_passes.at("after_lower")] == ["read_grouped_heads", "overlap"]
    assert run_passes.at("after_propagate") == []
    with pytest.raises(ValueError, match=r"remat: 'most' is not a remat policy; use one of none, full, selective"):
        PassPipeline.of(PassPipeline(remat="most"))

    def loss(w, x):
        return torch.tanh(torch.tanh(x @ w[0]) @ w[1]).square().mean()

    def step(w, x):
        return torch.func.grad(loss)(w, x)

    def program(passes):
        jitted = sf.jit(step, mesh, in_specs=(P(), P("dp")), out_specs=P(), backend=None, passes=passes)
        return jitted.lower(torch.randn(2, 8, 8), torch.randn(4, 8)).graph_module.code

    as_pipeline = program(PassPipeline(remat="full"))
    assert as_pipeline == program({"after_trace": [remat_pass("full")]}) != program(None)
