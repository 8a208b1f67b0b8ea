"""`import shardfn as sf`: one namespace, each name one meaning, and what importing it loads."""

import json
import subprocess
import sys

import pytest
import torch

import shardfn as sf
from shardfn.core import optim, precision, transforms
from shardfn.partition.passes import remat as remat_module

NAMES = ("jit", "P", "AUTO", "Mesh", "specs_like", "constrain", "local_map", "pipeline_split",
         "register_autograd", "value_and_grad", "grad", "stop_gradient", "optim", "remat", "checkpoint",
         "remat_pass", "checkpoint_policies", "with_policy", "PrecisionPolicy", "precision_policy")


def test_every_name_is_listed_and_resolves():
    assert set(NAMES) <= set(sf.__all__) <= set(dir(sf))
    for name in sf.__all__:
        assert getattr(sf, name) is not None, name


def test_names_are_the_library_objects():
    assert sf.value_and_grad is transforms.value_and_grad and sf.grad is transforms.grad
    assert sf.optim is optim
    assert sf.remat is sf.checkpoint is remat_module.rematerialized
    assert sf.remat_pass is remat_module.remat_pass
    assert sf.with_policy is precision.with_policy and sf.PrecisionPolicy is precision.Policy
    assert sf.precision_policy("bf16").compute_dtype == torch.bfloat16


def test_remat_and_precision_policies_do_not_share_a_name():
    assert "Policy" not in dir(sf) and "policy" not in dir(sf)
    names = (sf.checkpoint_policies.none, sf.checkpoint_policies.full, sf.checkpoint_policies.selective)
    assert names == remat_module.POLICIES
    assert sf.checkpoint_policies.saves_matmuls is remat_module.saves_matmuls


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'jitt'"):
        sf.jitt


def test_remat_transform_changes_no_bit():
    def loss(p, x):
        return (torch.tanh(x @ p["w1"]) @ p["w2"]).pow(2).mean()

    opt = sf.optim.adamw(1e-2)

    def step(p, s, x):
        value, grads = sf.value_and_grad(loss)(p, x)
        updates, s = opt.update(grads, s, p)
        return sf.optim.apply_updates(p, updates), s, value

    g = torch.Generator().manual_seed(0)
    p = {"w1": torch.randn(8, 16, generator=g), "w2": torch.randn(16, 4, generator=g)}
    x = torch.randn(4, 8, generator=g)
    s = opt.init(p)
    want = step(p, s, x)
    for policy in ("full", "selective"):
        got = sf.remat(step, policy)(p, s, x)
        assert torch.equal(got[2], want[2])
        assert all(torch.equal(got[0][k], want[0][k]) for k in p)


def _loaded(code: str) -> dict:
    """The modules (shardfn's, and whether torch's partitioner pieces) a fresh process has
    loaded after ``code``."""
    probe = code + (
        "\nimport json, sys\n"
        "print(json.dumps({'shardfn': sorted(m for m in sys.modules if m.startswith('shardfn')),"
        " 'torch': 'torch' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_shardfn_loads_nothing_else():
    loaded = _loaded("import shardfn")
    assert loaded == {"shardfn": ["shardfn"], "torch": False}


# The layout facts a config is checked against live in these partition modules (mesh axes,
# rules, schedules, remat policy names) and the sub-packages holding them, whose __init__ imports
# nothing; tracing, propagation, lowering and compiling do not.
CONFIG_FACTS = {"shardfn.partition", "shardfn.partition.errors", "shardfn.partition.spec",
                "shardfn.partition.spmd", "shardfn.partition.spmd.fx",
                "shardfn.partition.layouts", "shardfn.partition.layouts.axes",
                "shardfn.partition.passes", "shardfn.partition.passes.remat",
                "shardfn.partition.pipeline", "shardfn.partition.pipeline.schedules",
                *(f"shardfn.partition.pipeline.schedules.{m}" for m in (
                    "types", "generators", "dependencies", "simulate", "validate", "communication", "files", "text"))}


def test_shardfn_params_loads_no_partitioner_runtime_or_planner():
    loaded = _loaded("import contextlib, io\nfrom shardfn.cli.main import main\n"
                     "with contextlib.redirect_stdout(io.StringIO()):\n    main(['params', '--json'])")
    modules = set(loaded["shardfn"])
    assert "shardfn.cli.params" in modules and "shardfn.models.llama" in modules
    partition = {m for m in modules if m.startswith("shardfn.partition")}
    assert partition <= CONFIG_FACTS, sorted(partition - CONFIG_FACTS)
    assert not {m for m in modules if m.startswith(("shardfn.runtime", "shardfn.plan"))}
