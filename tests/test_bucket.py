"""Gradient bucketing (partition/passes/bucket.py): same bytes in fewer collectives, same results."""

import pytest
import torch
from test_partition import LAYOUTS, make_step, mlp_data

import shardfn as sf
from shardfn import P
from shardfn.config import load_config
from shardfn.core.transforms import value_and_grad
from shardfn.partition.passes.bucket import DEFAULT_BUCKET_BYTES, bucket_pass
from shardfn.runtime.launch import spawn

BUCKETS = (None, DEFAULT_BUCKET_BYTES, 8192)  # off; all gradients in one bucket; 2 weights (4096 B each) per bucket


def _mlp_step(layout, bucket_bytes, mesh):
    axes, pspecs, xspec, fsdp = LAYOUTS[layout]
    return sf.jit(make_step(pspecs), mesh, in_specs=(pspecs, xspec), out_specs=(pspecs, P()),
                  fsdp_argnums=fsdp, backend=None, bucket_bytes=bucket_bytes)


def _rows(layout, bucket_bytes):
    mesh = sf.Mesh(LAYOUTS[layout][0], fake=True)
    return _mlp_step(layout, bucket_bytes, mesh).lower(*mlp_data())


# bytes: each weight's gradient is 4096 B fp32 (3 weights); the loss and nll's total weight 4 B each.
EXPECTED = {
    # the three gradient all-reduces become one ("tensors": what the buckets carry); the two scalars are read before the
    # gradients exist (the total weight) or reduced with another op (the loss's mean)
    ("dp2", None): [{"op": "all_reduce", "axis": "dp", "bytes": 3 * 4096 + 8, "count": 5}],
    ("dp2", DEFAULT_BUCKET_BYTES): [{"op": "all_reduce", "axis": "dp", "bytes": 3 * 4096 + 8, "count": 3,
                                     "tensors": 5}],
    ("dp2", 8192): [{"op": "all_reduce", "axis": "dp", "bytes": 3 * 4096 + 8, "count": 4, "tensors": 5}],
    ("fsdp2", None): [{"op": "all_gather", "axis": "fsdp", "bytes": 4 * 4096, "count": 4},
                      {"op": "all_reduce", "axis": "fsdp", "bytes": 8, "count": 2},
                      {"op": "reduce_scatter", "axis": "fsdp", "bytes": 3 * 4096, "count": 3}],
    ("fsdp2", DEFAULT_BUCKET_BYTES): [{"op": "all_gather", "axis": "fsdp", "bytes": 4 * 4096, "count": 4},
                                      {"op": "all_reduce", "axis": "fsdp", "bytes": 8, "count": 2},
                                      {"op": "reduce_scatter", "axis": "fsdp", "bytes": 3 * 4096, "count": 1,
                                       "tensors": 3}],
    ("fsdp2", 8192): [{"op": "all_gather", "axis": "fsdp", "bytes": 4 * 4096, "count": 4},
                      {"op": "all_reduce", "axis": "fsdp", "bytes": 8, "count": 2},
                      {"op": "reduce_scatter", "axis": "fsdp", "bytes": 3 * 4096, "count": 2, "tensors": 3}],
}


@pytest.mark.parametrize("layout,bucket_bytes", sorted(EXPECTED, key=str))
def test_bucketing_moves_the_same_bytes_in_fewer_collectives(layout, bucket_bytes, clean_process_group):
    assert _rows(layout, bucket_bytes).comm_report() == EXPECTED[(layout, bucket_bytes)]


def test_as_text_names_the_bucket_of_each_gradient(clean_process_group):
    text = _rows("fsdp2", DEFAULT_BUCKET_BYTES).as_text()
    assert text.count("^ reduce_scatter[fsdp] in bucket0 (12288 B for 3 tensors)") == 3


def test_bucket_pass_is_the_same_as_the_option(clean_process_group):
    mesh = sf.Mesh({"dp": 2}, fake=True)
    pspecs = LAYOUTS["dp2"][1]
    step = sf.jit(make_step(pspecs), mesh, in_specs=(pspecs, P("dp")), out_specs=(pspecs, P()), backend=None,
                  passes={"after_lower": [bucket_pass(DEFAULT_BUCKET_BYTES)]})
    assert step.lower(*mlp_data()).comm_report() == EXPECTED[("dp2", DEFAULT_BUCKET_BYTES)]


def _stacked_step(params, x):
    def loss_fn(p):
        h = x
        for i in range(p["w"].shape[0]):  # a stacked weight, one layer per row
            h = torch.tanh(h @ p["w"][i])
        return (h @ p["out"]).pow(2).sum() / 32  # a constant: a sum over the ranks' parts

    loss, grads = value_and_grad(loss_fn)(params)
    return {k: params[k] - 0.1 * torch.tanh(grads[k]) for k in params}, loss.detach()


def test_a_bucket_reduces_its_own_buffer_from_the_layers_gradients_and_takes_the_loss(clean_process_group):
    """One all-reduce a step: the buffer is the bucket's own (read by nothing else), so it is
    reduced in place, not copied first; a stacked weight's gradient goes into it as the layers'
    own gradients, no stack between; and the loss the step returns joins it, since the loss
    exists long before the last gradient."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 16, 16, generator=g), "out": torch.randn(16, 4, generator=g)}
    step = sf.jit(_stacked_step, sf.Mesh({"dp": 2}, fake=True), in_specs=(P(), P("dp")), out_specs=(P(), P()),
                  backend=None, bucket_bytes=DEFAULT_BUCKET_BYTES)
    lowered = step.lower(params, torch.randn(8, 16, generator=g))
    assert lowered.comm_report() == [{"op": "all_reduce", "axis": "dp", "bytes": 4 * (3 * 256 + 64 + 1),
                                      "count": 1, "tensors": 3}]
    nodes = list(lowered.graph_module.graph.nodes)
    (reduce,) = [n for n in nodes if n.target is torch.ops._c10d_functional.all_reduce_.default]
    buffer = reduce.args[0]
    assert buffer.target is torch.ops.aten.cat.default and list(buffer.users) == [reduce]
    assert not [n for n in nodes if n.target is torch.ops.aten.stack.default]
    assert len(buffer.args[0]) == 3 + 1 + 1  # the 3 layers' gradients, the head's, the loss


def test_bad_bucket_bytes_say_what_fits(fake_dp):
    with pytest.raises(ValueError, match=r"bucket_bytes must be an int >= 0.*got -1.*26214400"):
        sf.jit(lambda x: x, fake_dp, bucket_bytes=-1)
    with pytest.raises(ValueError, match=r"partition\.bucket_bytes.*>= 0"):
        load_config("llama_tiny", ["partition.bucket_bytes=-5"])
    assert load_config("llama_tiny", ["partition.bucket_bytes=1MiB"]).partition.bucket_bytes == 2**20
    assert load_config("llama_tiny", []).partition.bucket_bytes == DEFAULT_BUCKET_BYTES


@pytest.fixture
def fake_dp(clean_process_group):
    return sf.Mesh({"dp": 2}, fake=True)


# ------------------------------------------------------------------ on two gloo ranks: the same numbers


def _parity_worker():
    out = {}
    for layout in ("dp2", "fsdp2"):
        mesh = sf.Mesh(LAYOUTS[layout][0])
        for bucket_bytes in BUCKETS:
            p, x = mlp_data()
            step = _mlp_step(layout, bucket_bytes, mesh)
            new_p, loss = step(p, x)
            out[(layout, bucket_bytes)] = {"loss": loss.full_tensor(),
                                           "params": {k: v.full_tensor() for k, v in new_p.items()},
                                           "comm": step.lower(p, x).comm_report()}
    return out  # both layouts' meshes on the one gloo group (a second init on the same port can race)


_RUN: dict = {}


@pytest.fixture(scope="module")
def parity_run():
    """One spawn of two gloo ranks, read by every parity test below."""
    if "out" not in _RUN:
        _RUN["out"] = spawn(_parity_worker, 2, timeout_s=600)
    return _RUN["out"]


@pytest.mark.parametrize("layout", ["dp2", "fsdp2"])
def test_bucketed_step_matches_unbucketed_and_one_device(parity_run, layout):
    ref_p, ref_loss = make_step(None)(*mlp_data())
    for rank in parity_run:
        plain = rank[(layout, None)]
        for bucket_bytes in BUCKETS[1:]:
            got = rank[(layout, bucket_bytes)]
            assert got["comm"] == EXPECTED[(layout, bucket_bytes)]
            # the same elements summed by the same ranks: the same bits
            torch.testing.assert_close(got["loss"], plain["loss"], rtol=0, atol=0)
            for k in ref_p:
                torch.testing.assert_close(got["params"][k], plain["params"][k], rtol=0, atol=0)
                torch.testing.assert_close(got["params"][k], ref_p[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(plain["loss"], ref_loss, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the run config's step (partition.bucket_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["mesh.dp=2"], ["mesh.fsdp=2"]], ids=["dp2", "fsdp2"])
def test_the_config_step_buckets_and_matches_the_unbucketed_step(mesh):
    from parity import run_layout

    bucketed = run_layout(mesh, 2)  # partition.bucket_bytes: 25 MiB by default
    plain = run_layout([*mesh, "partition.bucket_bytes=0"], 2)
    for got, want in zip(bucketed, plain):
        rows = {(r["op"], r["axis"]): r for r in got["comm"]}
        plain_rows = {(r["op"], r["axis"]): r for r in want["comm"]}
        assert rows.keys() == plain_rows.keys()
        assert all(rows[k]["bytes"] == plain_rows[k]["bytes"] for k in rows)
        grads = ("all_reduce", "dp") if "mesh.dp=2" in mesh else ("reduce_scatter", "fsdp")
        assert rows[grads]["count"] < plain_rows[grads]["count"]
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0)
        for k, v in want["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-6, atol=1e-7)


def _inductor_worker():
    import logging

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("shardfn.jit").addHandler(handler)
    logging.getLogger("shardfn.jit").setLevel(logging.INFO)
    axes, pspecs, xspec, fsdp = LAYOUTS["fsdp2"]
    step = sf.jit(make_step(pspecs), sf.Mesh(axes), in_specs=(pspecs, xspec), out_specs=(pspecs, P()),
                  fsdp_argnums=fsdp, backend="inductor", bucket_bytes=DEFAULT_BUCKET_BYTES)
    new_p, loss = step(*mlp_data())
    return {"loss": loss.full_tensor(), "params": {k: v.full_tensor() for k, v in new_p.items()}, "log": lines}


@pytest.mark.slow
def test_bucketed_fsdp_step_compiles_with_inductor_and_says_so():
    ref_p, ref_loss = make_step(None)(*mlp_data())
    for rank in spawn(_inductor_worker, 2, timeout_s=600):
        torch.testing.assert_close(rank["loss"], ref_loss, rtol=1e-5, atol=1e-6)
        for k in ref_p:
            torch.testing.assert_close(rank["params"][k], ref_p[k], rtol=1e-5, atol=1e-6)
        lowered, compiled = rank["log"]  # 4 gathers, 2 scalar all-reduces, 1 bucketed reduce-scatter
        assert lowered.startswith("sf.jit: lowered step for Mesh(fsdp=2) in ") and lowered.endswith("(7 collectives)")
        assert compiled.startswith("sf.jit: compiled step for Mesh(fsdp=2) with inductor and ran it once in ")


def test_the_program_for_inductor_has_the_functional_all_reduce_and_the_eager_one_keeps_it_in_place(
        clean_process_group):
    from shardfn.partition.passes.bucket import functional_collectives

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 16, 16, generator=g), "out": torch.randn(16, 4, generator=g)}
    step = sf.jit(_stacked_step, sf.Mesh({"dp": 2}, fake=True), in_specs=(P(), P("dp")), out_specs=(P(), P()),
                  backend=None, bucket_bytes=DEFAULT_BUCKET_BYTES)
    gm = step.lower(params, torch.randn(8, 16, generator=g)).graph_module
    c10d = torch.ops._c10d_functional
    targets = lambda m: [n.target for n in m.graph.nodes if n.target in (c10d.all_reduce.default,  # noqa: E731
                                                                          c10d.all_reduce_.default)]
    functional = functional_collectives(gm)
    assert targets(functional) == [c10d.all_reduce.default]
    assert targets(gm) == [c10d.all_reduce_.default]  # the program that runs eagerly: as it was
    assert functional_collectives(functional) is functional  # nothing in place left to change
