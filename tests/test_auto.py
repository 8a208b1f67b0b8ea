"""Auto-sharding: hardware profiles, the cost model, the ILP's choices, presets, YAML, parity."""


import pytest
import torch
import torch.nn.functional as F
from fixtures import fake_train_step
from torch.distributed.tensor import Partial, Replicate, Shard

import shardfn as sf
from shardfn import P
from shardfn.partition import auto
from shardfn.partition.api import jit_auto
from shardfn.partition.cost.hardware import Hardware, available_hardware, load_hardware
from shardfn.partition.cost.model import CostModel
from shardfn.partition.spmd.trace import trace
from shardfn.runtime.launch import spawn

# ------------------------------------------------------------------ hardware and cost model


def test_every_profile_loads_and_unknown_names_list_the_valid_ones():
    assert {"h100", "h200", "b200", "gb200", "cpu"} <= set(available_hardware())
    for name in available_hardware():
        hw = load_hardware(name)
        assert isinstance(hw, Hardware) and hw.name == name and hw.hbm_bytes > 0
    assert load_hardware("h200").hbm_bytes > load_hardware("h100").hbm_bytes
    with pytest.raises(ValueError, match=r"unknown hardware 'h1000'; valid names are \['a100', 'b200', 'cpu', "
                                         r"'gb200', 'h100', 'h100_96gb', 'h200'\]"):
        load_hardware("h1000")


def test_profile_file_errors_name_the_key(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\npeak_flops_bf16: 1e15\n")
    with pytest.raises(ValueError, match=r"mine.yaml: missing key\(s\) \['gpus_per_node'"):
        load_hardware(path)


def test_collective_time_is_the_ring_alpha_beta_model():
    hw = load_hardware("h100")
    bw, alpha = hw.intra_node_bandwidth, hw.intra_node_latency
    b, n = 1 << 30, 8
    assert hw.collective_time("all_reduce", b, n, True) == pytest.approx(2 * (n - 1) / n * b / bw + 2 * (n - 1) * alpha)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert hw.collective_time(op, b, n, True) == pytest.approx((n - 1) / n * b / bw + (n - 1) * alpha)
    assert hw.collective_time("all_gather", b, n, False) > 8 * hw.collective_time("all_gather", b, n, True)
    assert hw.collective_time("all_reduce", b, 1, True) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        hw.collective_time("broadcast", b, n, True)


def test_cost_model_transitions_and_compute():
    model = CostModel((2, 4), load_hardware("h100"))
    assert model.intra_node == (True, True)
    assert CostModel((8, 8), load_hardware("h100")).intra_node == (False, True)
    x = torch.empty(64, 128)
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    assert model.transition(x, (R, R), (S0, S1)).seconds == 0.0          # local slices
    ar = model.transition(x, (Partial(), R), (R, R))
    assert ar.collectives == (("all_reduce", 0, 64 * 128 * 4),) and ar.comm_s > 0 and ar.reshard_s == 0
    ag = model.transition(x, (R, S1), (R, R))
    assert ag.collectives == (("all_gather", 1, 64 * 128 * 4),) and ag.reshard_s > 0
    # reduce-scatter first (the buffer shrinks), then the gather on the other dim
    rs = model.transition(x, (Partial(), S1), (S0, R))
    assert [c[0] for c in rs.collectives] == ["reduce_scatter", "all_gather"]
    mm = torch.ops.aten.mm.default
    a, w, out = torch.empty(64, 32), torch.empty(32, 128), torch.empty(64, 128)
    hw = model.hardware
    # a GEMM whose smallest dim is 32 reaches 12% of peak on Hopper; streams at 80% of HBM
    full = model.compute_time(mm, (a, w), {}, out, [(R, R), (R, R)], (R, R))
    assert full == pytest.approx(
        2 * 64 * 32 * 128 / (0.12 * hw.peak_flops_fp32) + (64 * 32 + 32 * 128 + 64 * 128) * 4 / (0.8 * hw.hbm_bandwidth)
    )
    # rows over the 2-way dim, columns over the 4-way dim: 1/8 of the FLOPs on local shapes
    split = model.compute_time(mm, (a, w), {}, out, [(S0, R), (R, S1)], (S0, S1))
    assert split == pytest.approx(
        2 * 32 * 32 * 32 / (0.12 * hw.peak_flops_fp32) + (32 * 32 + 32 * 32 + 32 * 32) * 4 / (0.8 * hw.hbm_bandwidth)
    )
    # addmm's GEMM is its second and third argument
    bias = torch.empty(128)
    assert model.compute_time(torch.ops.aten.addmm.default, (bias, a, w), {}, out, [(R, R)] * 3, (R, R)) > full
    assert model.compute_time(torch.ops.aten.view.default, (a, [2048]), {}, torch.empty(2048), [(R, R)], (R, R)) == 0.0


def test_transitions_follow_dtensors_plan_on_a_device_mesh(clean_process_group):
    mesh = sf.Mesh({"dp": 2, "tp": 2}, fake=True)
    model = CostModel((2, 2), load_hardware("h100"), mesh.device_mesh)
    x = torch.empty(2, 64, 64)
    R, S0, S2 = Replicate(), Shard(0), Shard(2)
    # tp holds halves of dim 2; dp splitting it first needs them whole again: not a free slice
    nested = model.transition(x, (R, S2), (S2, S2))
    assert nested.collectives == (("all_gather", 1, 2 * 64 * 64 * 4),)
    assert CostModel((2, 2), load_hardware("h100")).transition(x, (R, S2), (S2, S2)).collectives == ()
    # tp regathers dim 0 first, then dp moves its split from dim 2 to dim 0: an all-to-all of
    # what one rank holds, or on a gloo mesh the all-gather DTensor issues instead
    a2a = model.transition(x, (S2, S0), (S0, R))
    assert a2a.collectives == (("all_gather", 1, 2 * 64 * 32 * 4), ("all_to_all", 0, 2 * 64 * 32 * 4))
    gloo = CostModel((2, 2), load_hardware("h100"), mesh.device_mesh, gathers_for_all_to_all=True)
    assert gloo.transition(x, (S2, S0), (S0, R)).collectives[1] == ("all_gather", 0, 2 * 64 * 64 * 4)
    assert model.transition(x, (Partial(), R), (Partial("max"), R)).comm_s == float("inf")
    # DTensor's redistribute makes no partial sum, so no plan may ask for one
    assert model.transition(x, (S0, R), (Partial(), R)).comm_s == float("inf")
    assert model.transition(x, (R, R), (R, Partial())).comm_s == float("inf")


def test_a_stacked_gradient_may_take_any_layout_its_parts_share(clean_process_group):
    def step(w, x):  # two layers' weights in one stacked tensor, as models store them
        def loss(w):
            h = x
            for i in range(w.shape[0]):
                h = torch.tanh(h @ w[i])
            return h.pow(2).mean()

        g, value = torch.func.grad_and_value(loss)(w)
        return w - 0.1 * g, value

    mesh = sf.Mesh({"dp": 2, "tp": 2}, fake=True)
    args = (fake(2, 64, 64), fake(16, 64))
    traced = trace(step, args)
    stacks = [n for n in traced.graph_module.graph.nodes if n.target is torch.ops.aten.stack.default]
    assert len(stacks) == 1
    result = auto.solve(traced, mesh, fixed_specs=(P(None, None, "tp"), P("dp")))
    prob = result._problem
    options = prob.opts[prob.index[stacks[0]]]
    assert len(options) == 16  # every layout of a 2-D gradient over 2 x 2, moved one dim on
    assert (Partial(), Shard(2)) in options and (Replicate(), Replicate()) in options


# ------------------------------------------------------------------ the MLP


def mlp_loss(p, x):
    return (F.gelu(x @ p["w1"]) @ p["w2"]).pow(2).mean()


def mlp_step(p, x):
    g, loss = torch.func.grad_and_value(mlp_loss)(p, x)
    return {k: p[k] - 0.1 * g[k] for k in p}, loss


def fake(*shape):
    return torch.empty(*shape, device="meta")


def mlp_args(d, h, tokens):
    return {"w1": fake(d, h), "w2": fake(h, d)}, fake(tokens // 8, 8, d)


def weight_bytes(p):
    return sum(v.numel() * v.element_size() for v in p.values())


MLP_AXES = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}


def test_wide_mlp_with_tight_memory_is_megatron(clean_process_group):
    mesh = sf.Mesh({"dp": 1, "tp": 4}, fake=True)  # a size-1 axis is named but has no mesh dim
    p, x = mlp_args(1024, 16384, tokens=64)
    traced = trace(mlp_step, (p, x))
    # params, their gradients and the new params replicated would need 3x the weights
    result = auto.solve(traced, mesh, memory_budget=1.5 * weight_bytes(p), arg_names=("params", "x"))
    w1, w2, xs = result.in_specs
    assert (w1, w2, xs) == (P(None, "tp"), P("tp"), P())
    # column-parallel w1, row-parallel w2: nothing moves between the two matmuls, the only
    # collective of the forward is the all-reduce of the row-parallel output
    forward = ["mm", "_unsafe_view", "gelu", "view_1", "mm_1"]
    assert not [r for r in result.reshards if r.consumer in forward]
    assert result.placements["mm_1"] == (Partial(),)
    assert result.status == "optimal" and result.cost.memory_bytes <= 1.5 * weight_bytes(p)


def test_small_model_is_data_parallel_and_tight_memory_makes_it_fsdp(clean_process_group):
    mesh = sf.Mesh({"dp": 4}, fake=True)
    p, x = mlp_args(256, 1024, tokens=8192)
    traced = trace(mlp_step, (p, x))
    batch_split = (Shard(0),)
    roomy = auto.solve(traced, mesh)
    # batch split, every matmul data parallel on whole weights, w2 replicated (it is used
    # forward and backward, so an all-reduce of its gradient beats gathering it twice); w1 may
    # be stored sharded (ZeRO): x needs no gradient, so w1 is gathered once, which costs what
    # the all-reduce would, and its update runs on a quarter
    assert roomy.in_specs[1:] == [P(), P("dp")]
    assert roomy.placements["mm"] == batch_split and roomy.placements["mm_1"] == batch_split
    tight = auto.solve(traced, mesh, memory_budget=roomy.cost.memory_bytes - weight_bytes(p) // 2)
    w1, w2, xs = tight.in_specs
    assert xs == P("dp") and w1 != P() and w2 != P()  # every weight stored sharded: ZeRO-3
    assert tight.placements["mm"] == batch_split and tight.placements["mm_1"] == batch_split
    assert tight.cost.memory_bytes < roomy.cost.memory_bytes - weight_bytes(p) // 2
    assert tight.cost.step_s >= roomy.cost.step_s


def test_never_worse_than_the_best_preset(clean_process_group):
    mesh = sf.Mesh({"dp": 2, "tp": 2}, fake=True)
    p, x = mlp_args(512, 2048, tokens=1024)
    traced = trace(mlp_step, (p, x))
    result = auto.solve(traced, mesh, arg_names=("params", "x"))
    rows = result.compare(auto.presets(mesh, (p, x), MLP_AXES))
    assert [r["name"] for r in rows] == ["auto", "dp", "fsdp", "tp", "fsdp_tp"]
    best = min(r["step_s"] for r in rows[1:] if r["fits"])
    assert rows[0]["step_s"] <= best * (1 + 1e-6)
    table = result.comparison_table(auto.presets(mesh, (p, x), MLP_AXES))
    assert table.splitlines()[0].split()[:3] == ["layout", "step", "compute"] and "fsdp_tp" in table


def test_presets_and_rules(clean_process_group):
    mesh = sf.Mesh({"dp": 2, "tp": 2}, fake=True)
    assert auto.preset_rules("dp", mesh) == {"batch": ["dp", "tp"]}
    assert auto.preset_rules("fsdp_tp", mesh)["mlp"] == "tp"
    p, x = mlp_args(64, 256, tokens=64)
    specs = auto.presets(mesh, (p, x), MLP_AXES)
    assert specs["fsdp_tp"] == ({"w1": P("dp", "tp"), "w2": P("tp", "dp")}, P("dp"))
    assert specs["tp"] == ({"w1": P(None, ("dp", "tp")), "w2": P(("dp", "tp"))}, P())
    with pytest.raises(ValueError, match="unknown preset 'zero'; valid presets are dp, fsdp, tp, fsdp_tp"):
        auto.preset_rules("zero", mesh)


def test_fixed_specs_yaml_round_trip_and_errors(clean_process_group):
    mesh = sf.Mesh({"dp": 2, "tp": 2}, fake=True)
    p, x = mlp_args(256, 1024, tokens=256)
    traced = trace(mlp_step, (p, x))
    fixed = auto.solve(traced, mesh, fixed_specs={"params": P(None, "tp"), "x": P("dp")}, arg_names=("params", "x"))
    assert fixed.in_specs == [P(None, "tp"), P(None, "tp"), P("dp")]
    text = fixed.to_rules_yaml()
    assert "params.w1: [null, tp]\n" in text and "x: [dp]\n" in text
    again = auto.solve(traced, mesh, fixed_specs=auto.load_specs_yaml(text), arg_names=("params", "x"))
    assert again.in_specs == fixed.in_specs
    tree = auto.solve(traced, mesh, fixed_specs=({"w1": sf.AUTO, "w2": P("tp")}, P("dp")))
    assert tree.in_specs[1:] == [P("tp"), P("dp")]
    with pytest.raises(ValueError, match=r"fixed_specs: no input at path\(s\) \['params.w9'\]; the inputs are "
                                         r"\['params.w1'"):
        auto.solve(traced, mesh, fixed_specs={"params.w9": P()}, arg_names=("params", "x"))
    with pytest.raises(ValueError, match=r"fixed_specs for input '1': P\('dp'\) does not divide its shape "
                                         r"\(1, 8, 256\)"):
        auto.solve(trace(mlp_step, mlp_args(256, 1024, tokens=8)), mesh, fixed_specs={"1": P("dp")})


def test_memory_budget_too_small_says_how_to_fix(clean_process_group):
    mesh = sf.Mesh({"tp": 2}, fake=True)
    p, x = mlp_args(256, 1024, tokens=64)
    with pytest.raises(ValueError, match=r"no layout fits memory_budget=1.00 KiB per rank.*Raise memory_budget"):
        auto.solve(trace(mlp_step, (p, x)), mesh, memory_budget=1024)


# ------------------------------------------------------------------ tied layers


def stacked_loss(p, x):
    h = x
    for i in range(p["w1"].shape[0]):
        h = h + F.gelu(h @ p["w1"][i]) @ p["w2"][i]
    return h.pow(2).mean()


def stacked_step(p, x):
    g, loss = torch.func.grad_and_value(stacked_loss)(p, x)
    return {k: p[k] - 0.1 * g[k] for k in p}, loss


def test_repeated_layers_share_one_choice(clean_process_group):
    mesh = sf.Mesh({"dp": 2, "tp": 2}, fake=True)
    results, traced = {}, {}
    for n_layers in (8, 16):
        args = ({"w1": fake(n_layers, 256, 1024), "w2": fake(n_layers, 1024, 256)}, fake(16, 8, 256))
        traced[n_layers] = trace(stacked_step, args)
        results[n_layers] = auto.solve(traced[n_layers], mesh)
    assert results[16].stats["nodes"] > 1.9 * results[8].stats["nodes"]
    assert results[16].stats["classes"] == results[8].stats["classes"]  # 16 layers cost what 8 do
    untied = auto.solve(traced[8], mesh, tie_layers=False)
    assert untied.stats["classes"] > 2 * results[8].stats["classes"]
    assert results[8].cost.step_s <= untied.cost.step_s * 1.02  # tying gives up (almost) nothing


# ------------------------------------------------------------------ end to end on 4 gloo ranks


def parity_loss(p, x):
    h = F.silu(x @ p["w1"]) * (x @ p["w3"])
    y = h @ p["w2"] + x
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
    return F.cross_entropy(y.reshape(-1, y.shape[-1]), torch.zeros(y.shape[0] * y.shape[1], dtype=torch.long))


def parity_step(p, x):
    g, loss = torch.func.grad_and_value(parity_loss)(p, x)
    return {k: p[k] - 0.1 * g[k] for k in p}, loss


def parity_data():
    g = torch.Generator().manual_seed(0)
    p = {k: torch.randn(*s, generator=g) for k, s in [("w1", (16, 64)), ("w3", (16, 64)), ("w2", (64, 16))]}
    return p, torch.randn(8, 8, 16, generator=g)


# Small enough that the cost model would replicate everything, so each plan pins one or two
# inputs and the solver picks every other spec and every intermediate placement.
PLANS = {
    "megatron": {"params.w2": P("tp"), "x": P("dp")},
    "w1_split": {"params.w1": P(None, ("dp", "tp"))},
}


def _auto_worker():
    mesh = sf.Mesh({"dp": 2, "tp": 2})
    p, x = parity_data()
    out = {}
    for name, fixed in PLANS.items():
        step, result = jit_auto(parity_step, mesh, (p, x), arg_names=("params", "x"), fixed_specs=fixed)
        new_p, loss = step(p, x, backend=None)
        out[name] = {"loss": loss.full_tensor(), "params": {k: v.full_tensor() for k, v in new_p.items()},
                     "in_specs": result.in_specs, "estimated": result.collectives(), "comm": step.comm_report()}
    return out


def test_auto_layouts_match_one_device_on_four_ranks():
    p, x = parity_data()
    ref_p, ref_loss = parity_step(p, x)
    out = spawn(_auto_worker, 4, timeout_s=300)
    for rank_out in out:
        for name, res in rank_out.items():
            torch.testing.assert_close(res["loss"], ref_loss, rtol=1e-5, atol=1e-6, msg=name)
            for k in ref_p:
                torch.testing.assert_close(res["params"][k], ref_p[k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
            assert res["comm"] == res["estimated"], name  # the program runs exactly the plan
            assert res["comm"], name
    megatron = out[0]["megatron"]
    assert megatron["in_specs"][:3] == [P(None, "tp"), P("tp"), P(None, "tp")]


# ------------------------------------------------------------------ the real models, planned


def model_step(name, mesh, overrides=()):
    """``(train_step, (params, opt_state, batch), param_axes)`` of a packaged config, on fake tensors
    (tests/fixtures.py)."""
    return fake_train_step(name, overrides, mesh)


@pytest.mark.parametrize(
    "name,axes,overrides",
    [
        # one-axis meshes keep the ILPs small (the MLP test above covers a dp x tp mesh)
        ("llama_tiny", {"dp": 4}, ()),
        ("moe_tiny", {"ep": 4}, ()),  # routed experts in all-to-all regions over ep
        # Llama 3 8B's shapes with 2 of its 32 layers and 1024-token sequences, to keep the test
        # fast (benchmarks/bench_autoshard.py plans all 32 layers on an 8x8 mesh)
        ("llama3_8b", {"fsdp": 8}, ("model.n_layers=2", "train.seq_len=1024")),
    ],
)
def test_models_never_worse_than_the_best_preset(clean_process_group, name, axes, overrides):
    from shardfn.partition.local_map import mesh_scope

    mesh = sf.Mesh(axes, fake=True)
    step, args, param_axes = model_step(name, mesh, overrides)
    with mesh_scope(mesh):
        traced = trace(step, args)
    result = auto.solve(traced, mesh, arg_names=("params", "opt_state", "batch"))
    rows = result.compare(auto.presets(mesh, args, param_axes))
    fitting = [r["step_s"] for r in rows[1:] if r.get("fits")]
    assert fitting and rows[0]["step_s"] <= min(fitting) * (1 + 1e-6)
    assert result.cost.memory_bytes <= load_hardware("h100").hbm_bytes


def _llama_tiny_step():
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime.train_step import make_optimizer, make_train_step

    cfg = load_config("llama_tiny", ["train.batch_size=4", "train.seq_len=16"])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    opt = make_optimizer(cfg.train, model)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    return make_train_step(model, cfg.model, opt), (params, opt.init(params), batch)


def _llama_tiny_worker():
    from shardfn.core.pytree import tree_map

    step, args = _llama_tiny_step()
    fixed = {"batch": P("dp"), "params.layers.mlp": P(None, None, "tp"), "params.layers.attn.wq": P(None, None, "tp")}
    lowered, result = jit_auto(step, sf.Mesh({"dp": 2, "tp": 2}), args, fixed_specs=fixed,
                                    arg_names=("params", "opt_state", "batch"))
    params, _, metrics = lowered(*args, backend=None)
    return {"params": tree_map(lambda t: t.full_tensor(), params), "loss": metrics["loss"].full_tensor(),
            "comm": lowered.comm_report(), "estimated": result.collectives()}


@pytest.mark.slow
def test_llama_tiny_auto_layout_matches_one_device():
    from shardfn.core.pytree import tree_leaves

    step, args = _llama_tiny_step()
    ref_params, _, ref_metrics = step(*args)
    for out in spawn(_llama_tiny_worker, 4, timeout_s=600):
        torch.testing.assert_close(out["loss"], ref_metrics["loss"], rtol=1e-5, atol=1e-6)
        # one Adam step (lr up to 3e-3): where a gradient is near Adam's eps, summing it in another
        # order moves its update by ~1e-6; a wrong layout moves whole rows by a full step
        for got, want in zip(tree_leaves(out["params"]), tree_leaves(ref_params)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-6)
        assert out["comm"] == out["estimated"] and any(r["axis"] == "tp" for r in out["comm"])


def test_auto_keeps_every_other_option_of_sf_jit(clean_process_group, monkeypatch):
    """``in_specs=sf.AUTO`` chooses the specs and nothing else: the passes at every point, bucketing
    and the stored (fsdp) arguments apply as they do with specs written by hand."""
    from shardfn.partition import api
    from shardfn.partition.passes import bucket as bucket_module

    ran, bucketed = [], []

    def noting(point):
        def note(gm):
            ran.append(point)
            return gm
        return note

    def bucket(gm, nbytes):
        bucketed.append(nbytes)
        return gm

    monkeypatch.setattr(bucket_module, "bucket_collectives", bucket)  # the default after_lower pass calls it
    p, x = mlp_args(256, 1024, tokens=64)
    step = sf.jit(mlp_step, sf.Mesh({"dp": 2, "tp": 2}, fake=True), in_specs=sf.AUTO, fsdp_argnums=(0,),
                  passes={point: [noting(point)] for point in api.PASS_POINTS}, bucket_bytes=1 << 20, backend=None)
    lowered = step.lower(p, x)
    assert ran == list(api.PASS_POINTS)
    assert bucketed == [1 << 20]
    assert lowered.auto.in_specs is not None and lowered.memory_report()["grads"] > 0
