"""The programs in examples/ run as they are, and print what they say they do."""

import contextlib
import io
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TESTED = {"jit_layouts.py", "graph_pass.py", "autoshard.py", "plan_1t.py"}


def _main(name: str):
    return runpy.run_path(str(EXAMPLES / name), run_name="example")["main"]


def _run(name: str, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = _main(name)(*args)
    return out.getvalue(), result


def test_every_example_program_is_run_here():
    assert {p.name for p in EXAMPLES.glob("*.py")} <= TESTED


def _jit_layouts_on_a_rank():
    return _run("jit_layouts.py")


# What examples/jit_layouts.py prints on rank 0 (fp32, batch 32, 4 gloo ranks)
JIT_LAYOUTS_PRINTS = """\
dp [{'op': 'all_reduce', 'axis': 'dp', 'bytes': 131076, 'count': 2, 'tensors': 3}]
tp [{'op': 'all_reduce', 'axis': 'tp', 'bytes': 8192, 'count': 1}]
fsdp [{'op': 'all_gather', 'axis': 'fsdp', 'bytes': 196608, 'count': 3}, \
{'op': 'all_reduce', 'axis': 'fsdp', 'bytes': 4, 'count': 1}, \
{'op': 'reduce_scatter', 'axis': 'fsdp', 'bytes': 131072, 'count': 1, 'tensors': 2}]
{'params': 32768, 'opt_state': 65548, 'batch': 4096, 'grads': 32768, 'activations': 262148, 'total': 397328}
""".splitlines()


def test_jit_layouts_runs_dp_tp_fsdp_on_4_ranks():
    from shardfn.runtime.launch import spawn

    results = spawn(_jit_layouts_on_a_rank, 4, timeout_s=300)
    text, loss = results[0]
    assert all(line in text.splitlines() for line in JIT_LAYOUTS_PRINTS), text
    assert 0 < loss < 4  # the loss after 3 steps (1.93)
    assert len({r[1] for r in results}) == 1  # the same on every rank
    assert all(r[0] == "" for r in results[1:])  # only rank 0 prints


def test_graph_pass_rewrites_after_propagate_and_counts_after_lower(clean_process_group):
    text, r = _run("graph_pass.py")
    assert [(exp, pl) for _, exp, pl in r["seen"]] == [(2, r["seen"][0][2]), (1.0, r["seen"][1][2])]
    assert "aten.pow" not in r["text"] and "rewritten" in text
    assert r["counts"]["inputs"] == ["0.w1", "0.w2", "1"] and r["counts"]["gflop"] > 0
    assert r["counts"]["collectives"] == sum(c["count"] for c in r["comm"])


def test_autoshard_fits_the_budget_and_beats_the_hand_layouts(clean_process_group):
    _, r = _run("autoshard.py")
    result, rows = r["result"], {row["name"]: row for row in r["rows"]}
    assert result.status == "optimal" and result.cost.memory_bytes <= result.memory_budget
    assert not rows["dp"]["fits"]  # replicated weights and Adam state do not fit 48 MiB
    assert all(rows["auto"]["step_s"] <= row["step_s"] for row in rows.values() if row.get("fits"))
    assert r["lowered"].comm_report()  # sf.jit(in_specs=sf.AUTO) lowers the plan


def test_plan_1t_quick(clean_process_group):
    text, r = _run("plan_1t.py", ["--quick"])
    assert "1.03T parameters" in text
    config = r["states"]["pp16 fsdp8 ep16 (the config's)"]
    assert config["opt_state"] > 2 * config["params"]  # AdamW's two moments and counters
    assert r["refused"] == {"ep 256": "mesh.ep", "1024 ranks": "mesh"}
    assert r["plan"] is None


@pytest.mark.slow
def test_plan_1t_full(clean_process_group):
    text, r = _run("plan_1t.py", [])
    assert r["plan"].fits and "fits" in text
