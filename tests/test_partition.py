"""Partitioner on small functions: specs, errors, parity and exact collective bytes on gloo."""

from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import shardfn as sf
from shardfn import P
from shardfn.partition.spec import broadcast_specs, to_placements
from shardfn.partition.spmd.propagate import ShardingError
from shardfn.runtime.launch import spawn

# ------------------------------------------------------------------ a two-matmul MLP train step


def mlp_loss(p, x):
    h = F.silu(x @ p["w1"]) * (x @ p["w3"])  # [B, S, H]
    y = h @ p["w2"] + x                       # [B, S, D]
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
    return F.cross_entropy(y.reshape(-1, y.shape[-1]), torch.zeros(y.shape[0] * y.shape[1], dtype=torch.long))


def make_step(grad_specs):
    def step(p, x):
        g, loss = torch.func.grad_and_value(mlp_loss)(p, x)
        g = sf.constrain(g, grad_specs)
        return {k: p[k] - 0.1 * g[k] for k in p}, loss

    return step


def mlp_data():
    g = torch.Generator().manual_seed(0)
    p = {k: torch.randn(*s, generator=g) for k, s in [("w1", (16, 64)), ("w3", (16, 64)), ("w2", (64, 16))]}
    return p, torch.randn(4, 8, 16, generator=g)


LAYOUTS = {
    "tp2": ({"tp": 2}, {"w1": P(None, "tp"), "w3": P(None, "tp"), "w2": P("tp")}, P(), ()),
    "dp2": ({"dp": 2}, {"w1": P(), "w3": P(), "w2": P()}, P("dp"), ()),
    "fsdp2": ({"fsdp": 2}, {"w1": P("fsdp"), "w3": P("fsdp"), "w2": P("fsdp")}, P("fsdp"), (0,)),
}


def _mlp_worker(layout, backend):
    axes, pspecs, xspec, fsdp = LAYOUTS[layout]
    mesh = sf.Mesh(axes)
    p, x = mlp_data()
    step = sf.jit(make_step(pspecs), mesh, in_specs=(pspecs, xspec), out_specs=(pspecs, P()),
                  fsdp_argnums=fsdp, backend=backend)
    lowered = step.lower(p, x)
    new_p, loss = step(p, x)
    return {"loss": loss.full_tensor(), "params": {k: v.full_tensor() for k, v in new_p.items()},
            "comm": lowered.comm_report(), "local_shape": tuple(new_p["w1"].to_local().shape)}


# bytes: one [4, 8, 16] fp32 activation = 2048 B; each weight = 4096 B.
EXPECTED_COMM = {
    # Megatron: the row-parallel output is all-reduced once; x needs no gradient here.
    "tp2": [{"op": "all_reduce", "axis": "tp", "bytes": 2048, "count": 1}],
    # one all-reduce per gradient, plus the loss and nll's total weight (scalars).
    "dp2": [{"op": "all_reduce", "axis": "dp", "bytes": 3 * 4096 + 8, "count": 5}],
    # ZeRO-3: every weight gathered for the forward, w2 again for the input gradient (w1, w3
    # are not needed backward since x has no gradient), one reduce-scatter per gradient.
    "fsdp2": [
        {"op": "all_gather", "axis": "fsdp", "bytes": 4 * 4096, "count": 4},
        {"op": "all_reduce", "axis": "fsdp", "bytes": 8, "count": 2},
        {"op": "reduce_scatter", "axis": "fsdp", "bytes": 3 * 4096, "count": 3},
    ],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mlp_parity_and_bytes(layout):
    p, x = mlp_data()
    ref_p, ref_loss = make_step(None)(p, x)
    out = spawn(_mlp_worker, 2, args=(layout, None), timeout_s=600)
    for rank_out in out:
        torch.testing.assert_close(rank_out["loss"], ref_loss, rtol=1e-5, atol=1e-6)
        for k in ref_p:
            torch.testing.assert_close(rank_out["params"][k], ref_p[k], rtol=1e-5, atol=1e-6)
        assert rank_out["comm"] == EXPECTED_COMM[layout]
    if layout == "tp2":
        assert out[0]["local_shape"] == (16, 32)


@pytest.mark.slow
def test_mlp_tp2_inductor():
    p, x = mlp_data()
    ref_p, ref_loss = make_step(None)(p, x)
    out = spawn(_mlp_worker, 2, args=("tp2", "inductor"), timeout_s=300)
    torch.testing.assert_close(out[0]["loss"], ref_loss, rtol=1e-5, atol=1e-6)
    for k in ref_p:
        torch.testing.assert_close(out[1]["params"][k], ref_p[k], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ local_map


def _region(x, w):
    return torch.tanh(x @ w)


def region_step(w, x):
    region = sf.local_map(_region, in_specs=(P("dp"), P()), out_specs=P("dp"))
    g, loss = torch.func.grad_and_value(lambda w: (region(x, w) ** 2).mean())(w)
    return w - 0.1 * g, loss


def _local_map_worker():
    mesh = sf.Mesh({"dp": 2})
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(8, 8, generator=g), torch.randn(4, 8, generator=g)
    step = sf.jit(region_step, mesh, in_specs=(P(), P("dp")), out_specs=(P(), P()), backend=None)
    new_w, loss = step(w, x)
    assert step.programs() == [step.lower(w, x)]  # the one program that call lowered
    # donate_argnums: the first argument's memory takes the new value; one tensor given as two
    # donated arguments is refused by name
    donating = sf.jit(lambda a, b: (a * 2, b + 1), mesh, donate_argnums=(0, 1), backend=None)
    a, b = w.clone(), x.clone()
    a_memory = a.data_ptr()
    doubled, _ = donating(a, b)
    assert doubled.to_local().data_ptr() == a_memory and torch.equal(doubled.full_tensor(), w * 2)
    try:
        donating(a, a)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return new_w.full_tensor(), loss.full_tensor(), step.lower(w, x).comm_report(), refused


def test_local_map_parity():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(8, 8, generator=g), torch.randn(4, 8, generator=g)
    ref_w, ref_loss = region_step(w, x)
    new_w, loss, comm, refused = spawn(_local_map_worker, 2, timeout_s=600)[1]
    assert "inputs arg0 and arg1 share one memory" in refused and "clone one" in refused
    torch.testing.assert_close(new_w, ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    # the weight's cotangent is a partial sum over dp: one all-reduce of 8x8 fp32, plus the loss
    assert comm == [{"op": "all_reduce", "axis": "dp", "bytes": 256 + 4, "count": 2}]


# ------------------------------------------------------------------ specs and errors


def test_spec_translation():
    assert to_placements(P("dp", None, "tp"), 3, ("dp", "tp")) == (Shard(0), Shard(2))
    assert to_placements(P(("dp", "tp")), 2, ("dp", "tp")) == (Shard(0), Shard(0))
    assert to_placements(None, 2, ("dp",)) == (Replicate(),)
    x = torch.zeros(2)
    assert broadcast_specs((P("dp"), None), (x, {"a": x, "b": x})) == [P("dp"), P(), P()]


def test_spec_errors():
    with pytest.raises(ValueError, match=r"unknown mesh axis 'mp'.*axes \('dp', 'tp'\)"):
        to_placements(P("mp"), 2, ("dp", "tp"))
    with pytest.raises(ValueError, match="used twice"):
        to_placements(P("dp", "dp"), 2, ("dp", "tp"))
    with pytest.raises(ValueError, match="must follow the mesh order"):
        to_placements(P(("tp", "dp")), 2, ("dp", "tp"))


@pytest.fixture
def fake_mesh(clean_process_group):
    return sf.Mesh({"dp": 2, "tp": 2}, fake=True)


def test_a_global_input_is_cut_to_the_shard_distribute_tensor_gives(fake_mesh):
    """An input every rank holds is cut to this rank's shard by slicing, as
    ``distribute_tensor(x, mesh, placements, src_data_rank=None)`` cuts it (uneven and empty
    shards too); a placement that is not a plain Shard or Replicate keeps distribute_tensor."""
    from torch.distributed.tensor import Partial, distribute_tensor

    from shardfn.core._torch_private import local_shard_slices

    x = torch.arange(5 * 6 * 3.0).reshape(5, 6, 3)
    dmesh = fake_mesh.device_mesh
    for placements in [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Shard(0)),
                       (Shard(2), Shard(0)), (Replicate(), Replicate())]:
        want = distribute_tensor(x, dmesh, placements, src_data_rank=None).to_local()
        torch.testing.assert_close(x[local_shard_slices(x.shape, dmesh, placements)], want, rtol=0, atol=0)
    assert local_shard_slices(x.shape, dmesh, (Partial(), Replicate())) is None


def test_indivisible_dim_names_input(fake_mesh):
    f = sf.jit(lambda w, x: x @ w, fake_mesh, in_specs=({"w": P(None, "tp")}["w"], P("dp")))
    with pytest.raises(ValueError, match=r"input 0: dim 1 of size 3 is not divisible by mesh axes \('tp',\)"):
        f.lower(torch.zeros(4, 3), torch.zeros(2, 4))


def test_unknown_axis_in_in_specs(fake_mesh):
    f = sf.jit(lambda p, x: x @ p["w"], fake_mesh, in_specs=({"w": P("mp")}, P()), arg_names=("params", "x"))
    with pytest.raises(ValueError, match=r"input params\.w: unknown mesh axis 'mp'"):
        f.lower({"w": torch.zeros(4, 4)}, torch.zeros(2, 4))


def test_conflicting_constrain(fake_mesh):
    def fn(x):
        return sf.constrain(x, P("dp")) + sf.constrain(x, P(None, "dp"))

    with pytest.raises(ShardingError, match=r"conflicting constraints on graph node 'arg0_1'.*P\('dp'\).*P\(None, "
                                            r"'dp'\)"):
        sf.jit(fn, fake_mesh, in_specs=P()).lower(torch.zeros(4, 4))


@torch.library.custom_op("shardfn_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_mystery.register_fake
def _(x):
    return torch.empty_like(x)


def test_op_without_sharding_rule_names_node_and_op(fake_mesh):
    f = sf.jit(lambda x: torch.ops.shardfn_test.mystery(x * 3), fake_mesh, in_specs=P("dp"))
    with pytest.raises(ShardingError, match=r"graph node 'mystery'.*shardfn_test\.mystery\.default.*no sharding rule"):
        f.lower(torch.zeros(4, 4))


def test_mesh_world_size_mismatch(clean_process_group):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"has 4 devices but the world size is 1"):
        sf.Mesh({"dp": 2, "tp": 2})


def test_mesh_without_launcher_says_how(clean_process_group, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"torchrun --nproc-per-node"):
        sf.Mesh({"dp": 2})


def test_as_text_shows_placements_and_collectives(fake_mesh):
    def fn(w, x):
        return (x @ w).sum()

    text = (
        sf.jit(fn, fake_mesh, in_specs=(P("tp"), P(None, "tp"))).lower(torch.zeros(4, 4), torch.zeros(2, 4)).as_text()
    )
    assert "input 0 [4, 4] : tp:S(0)" in text
    assert "tp:P(sum)" in text
    assert "^ all_reduce[tp]" in text


def test_as_text_shows_keyword_arguments(fake_mesh):
    def fn(x):
        return x.to(torch.bfloat16).sum()

    text = sf.jit(fn, fake_mesh, in_specs=P("dp")).lower(torch.zeros(4, 4)).as_text()
    assert "_to_copy = aten._to_copy.default(arg0_1, dtype=torch.bfloat16) [4, 4] : dp:S(0)" in text


def test_constrain_inside_a_differentiated_function(fake_mesh):
    """A constraint in the forward constrains the cotangent the same way (JAX semantics)."""

    def loss_grad(w, x):
        return torch.func.grad(lambda w: (sf.constrain(x @ w, P("dp", "tp")) ** 2).sum())(w)

    lowered = sf.jit(loss_grad, fake_mesh, in_specs=(P(), P()), out_specs=P()).lower(
        torch.zeros(4, 4), torch.zeros(4, 4)
    )
    constrained = [line for line in lowered.as_text().splitlines() if "shardfn.constrain" in line]
    assert len(constrained) == 2 and all(line.endswith("dp:S(0) tp:S(1)") for line in constrained)


# ------------------------------------------------------------------ partial sums: reduced once, to what is needed


def test_fsdp_argnums_alone_reduce_scatters_gradients(clean_process_group):
    mesh = sf.Mesh({"fsdp": 2}, fake=True)

    def loss(p, x):
        return (torch.relu(x @ p["w1"]) @ p["w2"]).square().mean()

    def step(p, x):  # no constraint on the gradients: the update's stored operand asks for a shard
        g = torch.func.grad(loss)(p, x)
        return {k: p[k] - 0.1 * g[k] for k in p}

    p = {"w1": torch.randn(16, 32), "w2": torch.randn(32, 16)}
    specs = {"w1": P("fsdp"), "w2": P("fsdp")}
    rows = sf.jit(step, mesh, in_specs=(specs, P("fsdp")), out_specs=specs, fsdp_argnums=(0,),
                  backend=None).lower(p, torch.randn(8, 16)).comm_report()
    by_op = {r["op"]: (r["bytes"], r["count"]) for r in rows}
    assert by_op["reduce_scatter"] == (2 * 16 * 32 * 4, 2)  # each gradient once, onto its shard
    assert "all_reduce" not in by_op


def test_a_second_fake_mesh_of_the_same_axes_lowers_on_its_own_groups(clean_process_group):
    def step(p, x):
        g = torch.func.grad(lambda p, x: (x @ p["w"]).square().mean())(p, x)
        return {"w": p["w"] - 0.1 * g["w"]}

    p, x = {"w": torch.randn(16, 32)}, torch.randn(8, 16)
    reports = []
    for _ in range(2):  # equal meshes, each on subgroups of its own
        mesh = sf.Mesh({"dp": 2, "fsdp": 2}, fake=True)
        rows = sf.jit(step, mesh, in_specs=({"w": P("fsdp")}, P(("dp", "fsdp"))), out_specs={"w": P("fsdp")},
                      backend=None).lower(p, x).comm_report()
        reports.append(sorted((r["op"], r["axis"], r["bytes"]) for r in rows))
    assert reports[0] == reports[1] and {axis for _, axis, _ in reports[0]} == {"dp", "fsdp"}


def test_a_partial_sum_used_twice_is_reduced_once(clean_process_group):
    mesh = sf.Mesh({"tp": 2}, fake=True)

    def f(w1, w2, x):
        y = (x @ w1) @ w2                               # row-parallel: a partial sum over tp
        return (y * y).sum() + torch.cat([y, y]).sum()  # one op reads it twice, another twice more

    rows = sf.jit(f, mesh, in_specs=(P(None, "tp"), P("tp", None), P()), out_specs=P(),
                  backend=None).lower(torch.randn(16, 32), torch.randn(32, 16), torch.randn(8, 16)).comm_report()
    assert rows == [{"op": "all_reduce", "axis": "tp", "bytes": 8 * 16 * 4, "count": 1}]


def test_a_partial_sum_is_reduce_scattered_only_onto_even_unsplit_dims(clean_process_group):
    def f(w1, w2, x):
        y = (x @ w1) @ w2                      # row-parallel: a partial sum over tp
        return torch.exp(y).reshape(-1).sum()  # exp would take it as a shard of rows

    def rows(axes, x_spec, batch):
        mesh = sf.Mesh(axes, fake=True)
        return sf.jit(f, mesh, in_specs=(P(None, "tp"), P("tp", None), x_spec), out_specs=P(), backend=None).lower(
            torch.randn(16, 32), torch.randn(32, 16), torch.randn(batch, 16)).comm_report()

    # rows already split over dp are not split over tp as well (6 rows over dp x tp would be
    # shards of 2 and 1 rows, which the reshape cannot address): one all-reduce of the dp shard
    for batch in (8, 6):
        reduced = rows({"dp": 2, "tp": 2}, P("dp"), batch)
        assert {"op": "all_reduce", "axis": "tp", "bytes": batch // 2 * 16 * 4, "count": 1} in reduced
        assert not any(r["op"] == "reduce_scatter" for r in reduced)


def test_strided_shards_are_shown_as_such():
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardfn.partition.spec import describe

    assert describe([_StridedShard(1, split_factor=2), Shard(0)], ["tp", "dp"]) == "tp:S(1,strided 2) dp:S(0)"
    assert describe([Replicate(), Replicate()], ["tp", "dp"]) == "R"


# ------------------------------------------------------------------ specs of a state that mirrors the parameters


def _adamw_state():
    from shardfn.core import optim

    params = {"wte": torch.zeros(8, 4), "h": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}}
    specs = {"wte": P("tp"), "h": {"w": P(None, "tp"), "b": None}}
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    return params, specs, opt.init(params)


def test_specs_like_gives_moments_the_param_specs_and_scalars_p():
    from shardfn.core.optim import ClipByGlobalNormState, EmptyState, ScaleByAdamState, ScaleByLearningRateState

    _, specs, state = _adamw_state()
    ps = {"wte": P("tp"), "h": {"w": P(None, "tp"), "b": P()}}
    assert sf.specs_like(state, specs) == (ClipByGlobalNormState(P()), (ScaleByAdamState(P(), ps, ps), EmptyState(),
                                                                         ScaleByLearningRateState(P(), P())))


def test_specs_like_refuses_a_partial_spec_tree_naming_the_missing_leaves():
    _, _, state = _adamw_state()
    partial = {"wte": P("tp"), "h": {"w": P(None, "tp")}}  # no spec for h.b
    with pytest.raises(ValueError, match=r"covers only part of the state at 1.0.1: no spec for \['1.0.1.h.b'\]; give "
                                         r"the full spec tree"):
        sf.specs_like(state, partial)


def test_specs_like_refuses_a_single_spec():
    _, _, state = _adamw_state()
    with pytest.raises(TypeError, match=r"param_specs must be the parameters' spec tree.*the single spec P\('tp'\)"):
        sf.specs_like(state, P("tp"))


def test_a_wrong_state_spec_tree_prints_structure_not_values():
    params, specs, state = _adamw_state()
    wrong = (P(), ({"mu": specs}, P(), P()))  # a dict where the state has a ScaleByAdamState
    with pytest.raises(ValueError) as e:
        broadcast_specs((specs, wrong), (params, state))
    text = str(e.value)
    assert "float32[8, 4]" in text and "count=int32[]" in text and "tensor(" not in text


# ------------------------------------------------------------------ a custom op with its own backward and sharding rule


@torch.library.custom_op("shardfn_test::scaled_tanh", mutates_args=())
def _scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@_scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_tanh_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _scaled_tanh_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return grad * (ctx.scale - y * y / ctx.scale), None  # d(s tanh x)/dx = s (1 - tanh^2 x)


scaled_tanh = sf.register_autograd(_scaled_tanh, _scaled_tanh_backward, setup_context=_scaled_tanh_setup)


def _elementwise_rule(x, scale):
    # any one sharding of x carries through (a partial sum is reduced first: tanh is not linear)
    return [([Replicate()], [Replicate(), None])] + [([Shard(d)], [Shard(d), None]) for d in range(x.ndim)]


def _scaled_tanh_loss(w, x):
    return scaled_tanh(x @ w, 2.0).square().mean()


def test_custom_op_under_value_and_grad_and_sf_jit(fake_mesh):
    from torch.distributed.tensor.experimental import register_sharding

    from shardfn.core.transforms import value_and_grad

    register_sharding(torch.ops.shardfn_test.scaled_tanh.default)(_elementwise_rule)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 8, generator=g), torch.randn(4, 8, generator=g)
    wr = w.clone().requires_grad_()
    expected = torch.autograd.grad(((torch.tanh(x @ wr) * 2.0).square().mean()), wr)[0]
    loss, grad = value_and_grad(_scaled_tanh_loss)(w, x)                          # eager autograd
    func_grad, func_loss = torch.func.grad_and_value(_scaled_tanh_loss)(w, x)     # torch.func
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(func_grad, expected, rtol=1e-6, atol=1e-7)
    lowered = sf.jit(value_and_grad(_scaled_tanh_loss), fake_mesh, in_specs=(P(), P("dp")),
                     out_specs=(P(), P()), backend=None).lower(w, x)
    assert "shardfn_test.scaled_tanh.default(mm, 2.0) [4, 8] : dp:S(0)" in lowered.as_text()
    # the loss and the weight's gradient, partial sums over dp: one all-reduce each
    assert lowered.comm_report() == [{"op": "all_reduce", "axis": "dp", "bytes": 4 + 8 * 8 * 4, "count": 2}]


@torch.library.custom_op("shardfn_test::scale_and_product", mutates_args=())
def _scale_and_product(xs: List[torch.Tensor], scale: float) -> List[torch.Tensor]:
    a, b = xs
    return [a * scale, a * b]


@_scale_and_product.register_fake
def _(xs, scale):
    return [torch.empty_like(xs[0]), torch.empty_like(xs[0])]


def _scale_and_product_setup(ctx, inputs, output):
    xs, scale = inputs
    assert isinstance(xs, list) and isinstance(output, list)  # the op's own arguments and result
    ctx.save_for_backward(*xs)
    ctx.scale = scale


def _scale_and_product_backward(ctx, grads):
    a, b = ctx.saved_tensors
    ga, gab = grads
    assert ctx.needs_input_grad[0] == [True, True] and not ctx.needs_input_grad[1]
    return [ga * ctx.scale + gab * b, gab * a], None


scale_and_product = sf.register_autograd(_scale_and_product, _scale_and_product_backward,
                                         setup_context=_scale_and_product_setup)


def test_register_autograd_takes_and_returns_lists_of_tensors():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, generator=g), torch.randn(3, generator=g)

    def loss(a, b, f):
        s, p = f([a, b], 3.0)
        return (s * s).sum() + (p * p).sum()

    expected = torch.func.grad(loss, argnums=(0, 1))(a, b, lambda xs, scale: [xs[0] * scale, xs[0] * xs[1]])
    out = scale_and_product([a, b], 3.0)
    assert isinstance(out, list) and len(out) == 2
    got = torch.func.grad(loss, argnums=(0, 1))(a, b, scale_and_product)                  # torch.func
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    plain = torch.autograd.grad(loss(ar, br, torch.ops.shardfn_test.scale_and_product), (ar, br))  # the op's own
    for x, y, z in zip(got, plain, expected):
        torch.testing.assert_close(x, z)
        torch.testing.assert_close(y, z)


# ------------------------------------------------------------------ LayerNorm's bias, unnamed reports, announcements


def _ln_loss(p, x):
    h = F.layer_norm(x, (16,), p["ln_w"], p["ln_b"])  # [4, 16]
    return (h @ p["w"]).square().mean()


def _ln_step(p, x):
    g = torch.func.grad(_ln_loss)(p, x)
    return {k: p[k] - 0.1 * g[k] for k in p}


LN_SPECS = {"ln_w": P("fsdp"), "ln_b": P("fsdp"), "w": P("fsdp")}


def _ln_data():
    g = torch.Generator().manual_seed(0)
    return ({"ln_w": 1 + 0.1 * torch.randn(16, generator=g), "ln_b": torch.randn(16, generator=g),
             "w": torch.randn(16, 8, generator=g)}, torch.randn(4, 16, generator=g))


def _ln_jit(mesh, **kwargs):
    return sf.jit(_ln_step, mesh, in_specs=(LN_SPECS, P("fsdp")), out_specs=LN_SPECS, fsdp_argnums=(0,),
                  backend=None, **kwargs)


def test_layer_norm_bias_is_not_gathered_for_its_backward(clean_process_group, monkeypatch):
    from shardfn.partition.spmd import propagate

    mesh = sf.Mesh({"fsdp": 2}, fake=True)
    rows = _ln_jit(mesh).lower(*_ln_data()).comm_report()
    # forward: ln_w, ln_b (64 B each), w (512 B); backward: ln_w (read by d_input) and w, not ln_b
    assert rows[0] == {"op": "all_gather", "axis": "fsdp", "bytes": 3 * 64 + 2 * 512, "count": 5}
    monkeypatch.setattr(propagate, "_SHAPE_ONLY_ARGS", {})
    gathered_bias = _ln_jit(mesh).lower(*_ln_data()).comm_report()
    assert gathered_bias[0] == {"op": "all_gather", "axis": "fsdp", "bytes": 4 * 64 + 2 * 512, "count": 6}


def _ln_worker():
    p, x = _ln_data()
    new_p = _ln_jit(sf.Mesh({"fsdp": 2}))(p, x)
    return {k: v.full_tensor() for k, v in new_p.items()}


def test_layer_norm_without_its_bias_gathered_matches_one_device():
    ref = _ln_step(*_ln_data())
    for rank in spawn(_ln_worker, 2, timeout_s=600):
        for k in ref:
            torch.testing.assert_close(rank[k], ref[k], rtol=1e-5, atol=1e-6)


def test_memory_report_without_arg_names_has_grads(clean_process_group):
    report = _ln_jit(sf.Mesh({"fsdp": 2}, fake=True)).lower(*_ln_data()).memory_report()
    params = (16 + 16 + 16 * 8) * 4 // 2  # the fsdp_argnums argument, sharded over 2
    assert (report["arg0"], report["grads"], report["arg1"]) == (params, params, 4 * 16 * 4 // 2)


def test_first_lowering_and_compile_are_announced_with_their_time(clean_process_group, capsys, caplog):
    import logging

    mesh = sf.Mesh({"fsdp": 2}, fake=True)
    _ln_jit(mesh, verbose=True).lower(*_ln_data())
    line = capsys.readouterr().err.strip()
    assert line.startswith("sf.jit: lowered _ln_step for Mesh(fsdp=2, fake) in ") and line.endswith(
        " s (8 collectives)")
    with caplog.at_level(logging.INFO, logger="shardfn.jit"):
        jitted = _ln_jit(mesh)
        jitted.lower(*_ln_data())
        jitted.lower(*_ln_data())  # cached: said once
    said = [r.getMessage().split(" in ")[0] for r in caplog.records if r.name == "shardfn.jit"]
    assert said == ["sf.jit: lowered _ln_step for Mesh(fsdp=2, fake)"]
    assert capsys.readouterr().err == ""  # not verbose: nothing printed


# ------------------------------------------------------------------ a fused qkv projection split over tp

QKV_D, QKV_H = 16, 4


def _qkv_loss(p, x, head_major):
    qkv = x @ p["qkv"]                                                        # [B, 3D]
    if head_major:  # columns ordered (head, q/k/v, head_dim): a tp shard holds whole heads
        q, k, v = qkv.view(x.shape[0], QKV_H, 3, QKV_D // QKV_H).unbind(2)  # [B, H, hd] each
        y = (q * k + v).reshape(x.shape[0], QKV_D)
    else:           # columns ordered (q/k/v, head, head_dim): a tp shard holds q and half of k
        q, k, v = qkv.split(QKV_D, dim=-1)                                    # [B, D] each
        y = q * k + v
    return (y @ p["o"]).square().mean()


def _qkv_step(head_major):
    def step(p, x):
        g = torch.func.grad(_qkv_loss)(p, x, head_major)
        return {k: p[k] - 0.1 * g[k] for k in p}

    return step


QKV_SPECS = {"qkv": P(None, "tp"), "o": P("tp")}


def _qkv_data():
    g = torch.Generator().manual_seed(0)
    return ({"qkv": torch.randn(QKV_D, 3 * QKV_D, generator=g), "o": torch.randn(QKV_D, QKV_D, generator=g)},
            torch.randn(4, QKV_D, generator=g))


def _qkv_lowered(mesh, head_major):
    return sf.jit(_qkv_step(head_major), mesh, in_specs=(QKV_SPECS, P()), out_specs=QKV_SPECS,
                  backend=None).lower(*_qkv_data())


def test_fused_qkv_split_gathers_only_when_the_layout_needs_it(clean_process_group):
    mesh = sf.Mesh({"tp": 2}, fake=True)
    # head-major: q, k, v of a shard's heads are on that shard; Megatron's one all-reduce of [B, D]
    assert _qkv_lowered(mesh, True).comm_report() == [{"op": "all_reduce", "axis": "tp", "bytes": 4 * 16 * 4,
                                                       "count": 1}]
    # qkv-major: the [B, 3D] projection is gathered before the split, and the text says so
    lowered = _qkv_lowered(mesh, False)
    assert {"op": "all_gather", "axis": "tp", "bytes": 1536, "count": 4} in lowered.comm_report()
    lines = lowered.as_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("split = aten.split.Tensor"))
    assert lines[at + 1:at + 3] == ["    ^ all_gather[tp] 768 B",
                                    "    ! split of a value sharded along the split dim: gathered first (768 B); lay "
                                    "the fused dim out head-major ([..., heads, 3, head_dim], then unbind) to split "
                                    "without communication"]


def _qkv_worker():
    p, x = _qkv_data()
    new_p = sf.jit(_qkv_step(True), sf.Mesh({"tp": 2}), in_specs=(QKV_SPECS, P()), out_specs=QKV_SPECS,
                   backend=None)(p, x)
    return {k: v.full_tensor() for k, v in new_p.items()}


def test_head_major_qkv_on_tp2_matches_one_device():
    ref = _qkv_step(True)(*_qkv_data())
    for rank in spawn(_qkv_worker, 2, timeout_s=600):
        for k in ref:
            torch.testing.assert_close(rank[k], ref[k], rtol=1e-5, atol=1e-5)


def test_outputs_are_what_from_local_gives_and_keep_autograd(clean_process_group):
    """A call wraps its local outputs with specs built on the first call; each is the DTensor
    ``DTensor.from_local`` would give, a fresh one every call, and one with autograd history
    still passes gradients back."""
    from torch.distributed.tensor import DTensor

    mesh = sf.Mesh({"fsdp": 2}, fake=True)
    jitted = sf.jit(lambda p: {"w": p["w"] * 2, "s": p["w"].sum()}, mesh, in_specs=({"w": P("fsdp")},),
                    out_specs={"w": P("fsdp"), "s": P()}, backend=None)
    x = torch.arange(24.0).reshape(8, 3)
    outs = [jitted({"w": x}) for _ in range(2)]
    for out in outs:
        local = out["w"].to_local()
        ref = DTensor.from_local(local, mesh.device_mesh, (Shard(0),), run_check=False, shape=(8, 3), stride=(3, 1))
        assert (out["w"].placements, out["w"].shape, out["w"].stride(), out["w"].dtype) == (
            ref.placements, ref.shape, ref.stride(), ref.dtype)
        assert torch.equal(local, 2 * x[:4]) and not out["w"].requires_grad
    assert outs[0]["w"].to_local().data_ptr() != outs[1]["w"].to_local().data_ptr()
    w = DTensor.from_local(x[:4].clone(), mesh.device_mesh, (Shard(0),), run_check=False).requires_grad_(True)
    out = jitted({"w": w})["w"]
    assert out.requires_grad
    out.to_local().sum().backward()
    assert torch.equal(w.grad.to_local(), torch.full((4, 3), 2.0))


def test_peak_temporary_bytes_holds_a_value_while_a_view_or_an_in_place_result_of_it_lives():
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardfn.partition.spmd.report import peak_temporary_bytes

    def viewed(x):                   # x: 1024 floats, 4096 B
        a = x * 2                    # 4096 B, alive while its view is
        v = a.view(2, 512)
        b = x + 1                    # 4096 B beside a
        return v.sum() + b.sum()

    def written_in_place(x):
        a = x * 2
        a.add_(1)                    # the same storage as a: no new bytes
        return a.sum()

    x = torch.randn(1024)
    assert peak_temporary_bytes(make_fx(viewed)(x)) == 2 * 4096 + 4
    assert peak_temporary_bytes(make_fx(written_in_place)(x)) == 4096 + 4
