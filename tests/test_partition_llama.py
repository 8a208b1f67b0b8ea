"""llama_tiny under every layout of the partitioner: parity with one device on real gloo ranks,
and collective bytes against the textbook layouts (on a fake mesh, in this process)."""

import operator

import optree
import pytest
import torch
from parity import assert_matches, layout_worker, reference, setup

import shardfn as sf
from shardfn import P
from shardfn.core.pytree import flatten_with_paths, size_bytes
from shardfn.runtime.launch import spawn
from shardfn.runtime.partitioned import layout, mesh_from_config, mesh_step

LAYOUTS = {
    "dp2": (["mesh.dp=2"], 2, (2, 64, 64)),
    "fsdp2": (["mesh.fsdp=2"], 2, (2, 32, 64)),
    "tp2": (["mesh.tp=2"], 2, (2, 64, 32)),
    "dp2xtp2": (["mesh.dp=2", "mesh.tp=2"], 4, (2, 64, 32)),
    "fsdp2xtp2": (["mesh.fsdp=2", "mesh.tp=2"], 4, (2, 32, 32)),
}


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("dp2xtp2", "fsdp2xtp2") else n
                                  for n in LAYOUTS])
def test_layout_matches_one_device(name, ref):
    overrides, nproc, local_wq = LAYOUTS[name]
    out = spawn(layout_worker, nproc, args=(overrides,), timeout_s=600)
    assert_matches(out, ref)
    assert out[0]["local"]["layers.attn.wq"] == local_wq  # wq [L, D, H*hd] really is split as the layout says


# ------------------------------------------------------------------ textbook bytes (fake mesh)


@pytest.fixture
def planner(clean_process_group):
    def lower(overrides):
        cfg, model, params, opt, batches = setup(overrides)
        state = opt.init(params)
        mesh = mesh_from_config(cfg, fake=True)
        step = mesh_step(cfg, model, opt, params, mesh, backend=None)
        return cfg, model, params, step.specs, step.jitted.lower(params, state, batches[0])
    return lower


def _rows(lowered, op):
    return [r for r in lowered.collectives() if r["op"] == op]


def test_tp2_one_block_is_megatron(clean_process_group):
    """One transformer block under tp2: 2 all-reduces of b*s*h forward, 2 backward."""
    cfg, model, params, _, batches = setup(["mesh.tp=2"])
    mesh = sf.Mesh({"tp": 2}, fake=True)
    b, s, h = 8, 32, cfg.model.dim
    layer = {k: v for k, v in params["layers"].items()}
    layer0 = torch.utils._pytree.tree_map(lambda w: w[0], layer)
    specs = layout(cfg, model, params, None, mesh)["params"]["layers"]
    specs0 = torch.utils._pytree.tree_map(lambda s: P(*s[1:]), specs, is_leaf=lambda x: isinstance(x, P))
    from shardfn.core import layers as L

    cos, sin = L.rope_tables(s, cfg.model.dim // cfg.model.n_heads, cfg.model.rope_theta)

    def block_grads(p, x, g):
        out, pullback = torch.func.vjp(lambda p, x: model.block(p, x, cos, sin, cfg.model), p, x)
        return out, *pullback(g)

    x = torch.randn(b, s, h)
    lowered = sf.jit(block_grads, mesh, in_specs=(specs0, P(), P()), out_specs=(P(), specs0, P())).lower(layer0, x, x)
    act = b * s * h * 4
    rows = lowered.collectives()
    activation_ars = [r for r in rows if r["op"] == "all_reduce" and r["bytes"] == act]
    assert len(activation_ars) == 4  # forward: after attention and after the MLP; backward: the same two
    assert {r["op"] for r in rows} == {"all_reduce"}
    # What remains are the two norm weights' gradient sums (D floats each): the backward keeps
    # the residual-stream gradient partial through the norms and reduces it at the row-parallel
    # matmul that needs it.
    rest = [r["bytes"] for r in rows if r not in activation_ars]
    assert sorted(rest) == [h * 4, h * 4]


def test_fsdp2_gathers_every_param_forward_and_backward_and_reduce_scatters_grads(planner):
    cfg, model, params, specs, lowered = planner(["mesh.fsdp=2"])
    sharded = {
        path
        for path, s in flatten_with_paths(specs["params"], is_leaf=lambda x: isinstance(x, P))
        if "fsdp" in s.axes()
    }
    by_path = dict(flatten_with_paths(params))
    sharded_bytes = sum(by_path[p].numel() * 4 for p in sharded)
    embed_bytes = by_path["embed"].numel() * 4
    gathers = sum(r["bytes"] for r in _rows(lowered, "all_gather"))
    # forward: every sharded param; backward: all of them again but the embedding table, whose
    # gradient needs no weights
    assert gathers == 2 * sharded_bytes - embed_bytes
    assert sum(r["bytes"] for r in _rows(lowered, "reduce_scatter")) == sharded_bytes
    # one gradient each, in buckets of partition.bucket_bytes (25 MiB: one bucket here)
    scattered = _rows(lowered, "reduce_scatter")
    assert len(scattered) == 1 and len(scattered[0]["bucket"]) == len(sharded)


def test_dp2_all_reduces_each_gradient_once(planner):
    cfg, model, params, specs, lowered = planner(["mesh.dp=2"])
    assert not _rows(lowered, "all_gather") and not _rows(lowered, "reduce_scatter")
    # one all-reduce a step: the gradients' bucket, which the loss for the metrics joins (4 bytes;
    # its mean divides by a constant, so no count of targets is all-reduced between the forward
    # and the backward, and the loss exists long before the last gradient)
    (bucket,) = _rows(lowered, "all_reduce")
    assert bucket["bytes"] == size_bytes(params) + 4
    assert len(bucket["bucket"]) == len(optree.tree_leaves(params)) + 1
    # the stacked layers' gradients go into the bucket's buffer from the layers' own, unstacked:
    # the one stack left is the gradient norm's, of one sum per leaf
    stacks = [n for n in lowered.graph_module.graph.nodes if n.target is torch.ops.aten.stack.default]
    assert [len(n.args[0]) for n in stacks] == [len(optree.tree_leaves(params))]
    # the backward is autograd's own kernels (silu's is one op); the one detach left is the loss
    # the step returns for its metrics
    ops = [str(n.target) for n in lowered.graph_module.graph.nodes if n.op == "call_function"]
    assert "aten.silu_backward.default" in ops and "aten.sigmoid.default" not in ops
    assert ops.count("aten.detach.default") == 1


def test_tp2_attention_reads_each_ranks_key_value_group_without_repeating_it(planner):
    """llama_tiny has 4 query heads and 2 key/value heads; under tp2 a rank holds 2 and 1. Its
    flash kernels read that one key/value head for both query heads (partition/passes/grouped_heads.py):
    no repeated copy of k or v, and no group sum of their gradients after the backward."""
    cfg, model, params, specs, lowered = planner(["mesh.tp=2"])
    assert (cfg.model.n_heads, cfg.model.n_kv_heads) == (4, 2)
    kernels = [n for n in lowered.graph_module.graph.nodes
               if "_scaled_dot_product_flash_attention_for_cpu" in str(n.target)]
    assert len(kernels) == 2 * cfg.model.n_layers  # forward and backward per layer
    for n in kernels:
        at = 1 if n.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default else 2
        q, k, v = (n.args[at + i].meta["val"] for i in (-1, 0, 1))
        assert (q.shape[1], k.shape[1], v.shape[1]) == (2, 1, 1)
    aten = torch.ops.aten
    repeats = [n for n in lowered.graph_module.graph.nodes
               if n.target is aten.clone.default and n.args[0].target is aten.expand.default]
    assert not repeats
    summed = [n for n in lowered.graph_module.graph.nodes if n.target is aten.sum.dim_IntList
              and any(a.target is operator.getitem and a.args[0] in kernels for a in n.args[0].args[:1])]
    assert not summed
