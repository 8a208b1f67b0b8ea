"""benchmarks/gpu_check.py: the one GPU check, run here at its CPU size as a smoke test (every
section runs and reports; the per-rank program reads grouped key/value heads), and its FLOP count."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_the_model_flops_are_six_n_t_plus_attention_at_the_llama3_8b_shape():
    from gpu_check import model_flops_per_token

    from shardfn import models
    from shardfn.config import load_config
    from shardfn.core.pytree import count

    cfg = load_config("llama3_8b")
    m = cfg.model
    shapes = models.get("llama").init(m, 0, device="meta")
    n = count(shapes) - m.vocab_size * m.dim - (2 * m.n_layers + 1) * m.dim  # no embedding table, no norms
    assert n == pytest.approx(7.50e9, rel=1e-3)
    assert model_flops_per_token(cfg) == 6 * n + 12 * 32 * 32 * 128 * 8192


def test_gpu_check_runs_every_section_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["failed"] == [] and set(r["sections"]) == {"step", "moe", "gqa", "gemm", "tests"}
    step = r["sections"]["step"]
    assert set(step["variants"]) == {"functional/eager", "functional/compiled", "module/compiled+fused_adamw"}
    assert step["first_loss_diff"] < 0.05                       # the same model and batch: the same first loss
    assert set(step["ratio_vs_module"]) == {"functional/eager", "functional/compiled"}
    moe = r["sections"]["moe"]
    assert moe["bfloat16"]["max_abs_diff"] < 0.1 and moe["float32"]["max_abs_diff"] < 1e-4  # grouped == loop
    gqa = r["sections"]["gqa"]
    assert gqa["ok"] and gqa["repeated_kv_copies"] == []
    assert {k["kv_heads"] for k in gqa["kernels"]} == {2} and {k["q_heads"] for k in gqa["kernels"]} == {8}
    assert len(r["sections"]["gemm"]["matmul"]) >= 4 and r["sections"]["gemm"]["attention"]["tflops"] > 0
