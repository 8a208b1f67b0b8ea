"""moe_tiny under expert-parallel layouts: parity with one device on real gloo ranks, and the
all-to-all bytes of each MoE layer against the routing decisions of the step."""

import pytest
import torch
from parity import assert_matches, reference, run_layout

from shardfn.config import resolve_path

MOE = str(resolve_path("moe_tiny"))

LAYOUTS = {
    "ep2": (["mesh.ep=2"], 2),
    "ep4": (["mesh.ep=4"], 4),
    "dp2xep2": (["mesh.dp=2", "mesh.ep=2"], 4),
    "fsdp2xep2": (["mesh.fsdp=2", "mesh.ep=2"], 4),
}
SLOW = ("ep4", "dp2xep2")  # four ranks each; ep2 and fsdp2 x ep2 stay in the default suite


@pytest.fixture(scope="module")
def ref():
    return reference(MOE)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_expert_parallel_layout_matches_one_device(name, ref):
    overrides, nproc = LAYOUTS[name]
    out = run_layout(overrides, nproc, MOE)
    assert_matches(out, ref)
    ep = int(overrides[-1].split("=")[1])
    # routed experts [L, E, D, F] are split over ep: each rank holds E / ep of them
    assert out[0]["local"]["moe_layers.experts.w1"][1] == 8 // ep


def _eager_and_compiled_worker():
    from parity import setup

    from shardfn.runtime.build import build_step

    losses = {}
    for compiled in (False, True):
        cfg, model, params, _, batches = setup(["mesh.ep=2", f"train.compile={str(compiled).lower()}"], MOE)
        step = build_step(cfg, model, params)
        p, s = step.place(params)
        per_step = []
        for b in batches[:2]:
            p, s, metrics = step(p, s, b)
            per_step.append(metrics["loss"])
        losses["compiled" if compiled else "eager"] = torch.stack(per_step)
    return losses


@pytest.mark.slow
def test_ep2_under_train_compile_matches_eager():
    """ep2's per-rank program through inductor: its bucketed gradient all-reduce goes in as the
    functional op (inductor takes no in-place collective), the MoE exchange as its opaque op."""
    from shardfn.runtime.launch import spawn

    for rank in spawn(_eager_and_compiled_worker, 2, timeout_s=2400):
        torch.testing.assert_close(rank["compiled"], rank["eager"], rtol=1e-5, atol=1e-6)


def _in_place_worker():
    from parity import setup

    from shardfn.partition.passes.inplace import count_targets
    from shardfn.runtime.build import build_step

    cfg, model, params, _, batches = setup(["mesh.ep=2"], MOE)
    step = build_step(cfg, model, params)
    p, s = step.place(params)
    p, s, _ = step(p, s, batches[0])  # moments and step counts not zero
    lowered = step.jitted.lower(p, s, batches[1])
    local = lowered.local_inputs(p, s, batches[1])
    before = [x.clone() for x in local]
    functional = lowered.graph_module(*local)
    in_place = lowered.compile(None)(*local)
    counts = {name: (count_targets(lowered.graph_module)[f"aten.{name}.Tensor"],
                     count_targets(lowered.compile(None))[f"aten.{name}.Tensor"]) for name in ("add", "div")}
    # what `shardfn train` runs: params and optimizer state donated, the update written over them
    donating = build_step(cfg, model, params, donate=True).jitted.lower(p, s, batches[1])
    given = [x.clone() for x in local]
    donated = donating.compile(None)(*given)
    n_state = sum(donating.donated)
    written = {x.data_ptr() for x, d in zip(given, donating.donated) if d} & {y.data_ptr() for y in donated}
    return {"same": len(functional) == len(in_place) and all(torch.equal(a, b) for a, b in zip(functional, in_place)),
            "inputs_kept": all(torch.equal(a, b) for a, b in zip(local, before)), "counts": counts,
            "donated_same": all(torch.equal(a, b) for a, b in zip(functional, donated)),
            "written_over": (len(written), n_state)}


@pytest.mark.slow
def test_ep2_program_written_in_place_gives_the_functional_programs_bits():
    """The per-rank program an eager ep2 step runs (partition.inplace) against the functional
    one it was made from, on the same inputs: the same bits, fewer out-of-place adds and
    divisions, the inputs untouched (the MoE exchange's and the collectives' inputs are left
    alone); and with params and state donated, the same bits written over the old state."""
    from shardfn.runtime.launch import spawn

    for rank in spawn(_in_place_worker, 2, timeout_s=1200):
        assert rank["same"] and rank["inputs_kept"]
        # out-of-place adds and divisions (moe_tiny, 3 layers): the optimizer's chain per parameter
        # and the backward's sums write in place; what stays reads an input (the moments' first
        # links, the step counts) or a value used later (m / (1 - b1^t): m is the new moment)
        assert rank["counts"] == {"add": (167, 8), "div": (137, 34)}
        assert rank["donated_same"]
        written, n_state = rank["written_over"]
        # 92 of the 100 donated leaves come back in their old memory (parameters, moments, step
        # counts); the other 8 are new values or pass through (among them the router bias, moved
        # by its own rule, its frozen moments, the clip's norm and the learning rate)
        assert (written, n_state) == (92, 100)
