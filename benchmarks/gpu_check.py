"""One short check of shardfn on one GPU (or, small, on CPU): speed against plain PyTorch, and the
CUDA-only pieces.

Sections (each one's result, or the error that stopped it, goes into the JSON; one failing does
not stop the others, and the exit status is 1 if any failed):

    step        one training step at a Llama-3-8B layer shape (the real dim, heads, kv heads, ffn
                and vocab; ``--layers`` layers, bf16 compute over fp32 master weights, batch 1 x
                ``--seq`` tokens): shardfn's functional step eager and under torch.compile,
                against the same model as an ``nn.Module`` (benchmarks/bench_core.py's Llama)
                under torch.compile with autocast and fused AdamW. Median ms per step, tokens/s,
                the ratio functional / module, MFU (6 N T + 12 L H hd S T model FLOPs, N without
                the embedding table, over the card's bf16 peak), peak memory, first-step losses.
    moe         a routed-expert SwiGLU at DeepSeek-V3's expert shapes (dim 7168, expert ffn
                2048; 8 local experts, as on one rank of EP 32, 32768 routed rows) forward and
                backward through ``core.moe.expert_compute`` (our grouped GEMM), in bf16 and in
                fp32 (or the error the kernel gives), against a loop of per-expert matmuls.
    gqa         the per-rank program of the step on a one-rank mesh (NCCL on cuda): which fused
                attention op the trace holds, the key/value head count each one reads, and that
                no repeated key/value copy (``clone`` of an ``expand``) or group sum is left
                (``partition/passes/grouped_heads.py``).
    gemm        achieved bf16 GEMM rates at the shapes of the planner's rate table
                (``partition.cost.hardware.EFFICIENCY``: a smallest dim of 64 ... 8192, the others
                8192) and a causal flash attention forward + backward (head dim 128), side by
                side with the table's shares of peak.
    tests       (cuda only) the ``cuda``-marked tests: ``python -m pytest -q -m cuda tests``.

``--device cpu`` runs every section at a small size (dim 64, 8 heads over 2 kv heads, 1 layer,
seq 64; ``torch.compile`` with the ``eager`` backend, i.e. Dynamo's capture without AOTAutograd
or inductor, unless ``--backend``) in well under a minute: the suite runs it as a smoke test
(tests/test_gpu_check.py). CPU numbers check that the script runs, not speed. ``--device cuda`` is sized to finish in
under 8 minutes on one H100 (most of it compiling).

    python benchmarks/gpu_check.py --device cuda --out benchmarks/results/gpu_check_h100.json
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check.json
    python benchmarks/gpu_check.py --device cuda --sections step,gemm --seq 4096
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTIONS = ("step", "moe", "gqa", "gemm", "tests")

# Llama 3 8B's layer (models/llama.py's table) and DeepSeek-V3's routed expert; the CPU sizes keep
# their proportions (4 query heads per kv head, ffn 3.5 dim) at a size two cores run in seconds.
SIZES = {
    "cuda": dict(model=dict(vocab_size=128256, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                            rope_theta=500000.0), layers=2, seq=8192, warmup=2, timed=5,
                 moe=dict(dim=7168, ffn=2048, experts=8, rows=32768),
                 gemm_other=8192, attention=dict(batch=1, heads=32, seq=8192, head_dim=128)),
    "cpu": dict(model=dict(vocab_size=256, dim=64, n_heads=8, n_kv_heads=2, ffn_dim=224, rope_theta=500000.0),
                layers=1, seq=64, warmup=1, timed=2,
                moe=dict(dim=128, ffn=32, experts=4, rows=256),
                gemm_other=256, attention=dict(batch=1, heads=4, seq=128, head_dim=32)),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Seconds per call of ``fn`` after ``warmup`` calls, each synchronized."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - tic)
    return times


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def card_profile(device: torch.device) -> str | None:
    """The bundled hardware profile of this card (``h100``, ``h200``, ``a100``, ``b200``), or None."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).upper()
    for key, profile in (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("B200", "b200")):
        if key in name:
            return profile
    return None


def _peak(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    from shardfn.partition.cost.hardware import load_hardware

    profile = card_profile(device)
    return load_hardware(profile).peak_flops(dtype) if profile else None


# ----------------------------------------------------------------------------- step


def _config(size: dict, layers: int, seq: int, **model):
    from shardfn.config import load_config

    m = {**size["model"], **model}
    overrides = [f"model.{k}={v}" for k, v in m.items()] + [
        f"model.n_layers={layers}", f"train.seq_len={seq}", "train.batch_size=1", "train.precision=bf16",
        "train.steps=100", "train.warmup_steps=10", "mesh.fsdp=1"]
    return load_config("llama3_8b", overrides)


def model_flops_per_token(cfg) -> float:
    """``6 N + 12 L H hd S`` (PaLM's, TorchTitan's): ``N`` the matmul parameters (the embedding
    table left out), the second term attention's score and value matmuls, no causal discount."""
    m, s = cfg.model, cfg.train.seq_len
    hd = m.dim // m.n_heads
    per_layer = m.dim * (m.n_heads + 2 * m.n_kv_heads) * hd + m.n_heads * hd * m.dim + 3 * m.dim * m.ffn_dim
    n = m.n_layers * per_layer + m.dim * m.vocab_size  # + the output head
    return 6.0 * n + 12.0 * m.n_layers * m.n_heads * hd * s


def _batches(cfg, device, n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
        out.append({"inputs": t[:, :-1].contiguous().to(device), "targets": t[:, 1:].contiguous().to(device)})
    return out


class _Functional:
    """shardfn's one-device step (what ``shardfn train`` runs), bf16 compute over fp32 params."""

    def __init__(self, cfg, model, device, backend):
        from shardfn.runtime.train_step import make_optimizer, make_train_step, precision_policy

        opt = make_optimizer(cfg.train, model)
        fn = make_train_step(model, cfg.model, opt, precision=precision_policy(cfg.train))
        self.fn = torch.compile(fn, backend=backend) if backend else fn
        self.params = model.init(cfg.model, cfg.train.seed, device=device)
        self.state = opt.init(self.params)

    def step(self, batch):
        self.params, self.state, metrics = self.fn(self.params, self.state, batch)
        return metrics["loss"]


class _Module:
    """The same model as an ``nn.Module``: torch.compile'd forward + loss under bf16 autocast,
    fp32 parameters, gradient clipping and fused AdamW (the PyTorch recipe)."""

    def __init__(self, cfg, model, device, backend):
        sys.path.insert(0, str(HERE))
        from bench_core import Llama

        t = cfg.train
        params = model.init(cfg.model, t.seed, device=device)
        with torch.device(device):  # built on the device: 1.5e9 parameters at the 8B shape
            self.module = Llama(cfg.model).load_functional(params)
        del params
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=t.lr, betas=(t.b1, t.b2), eps=t.eps,
                                     weight_decay=t.weight_decay, fused=True)
        self.clip, self.device = t.grad_clip, device
        self.loss = torch.compile(self._loss, backend=backend) if backend else self._loss

    def _loss(self, inputs, targets):
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.module(inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def step(self, batch):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(batch["inputs"], batch["targets"])
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip, foreach=True)
        self.opt.step()
        return loss.detach()


def check_step(device: torch.device, size: dict, args) -> dict:
    from shardfn import models

    cfg = _config(size, args.layers or size["layers"], args.seq or size["seq"])
    model = models.get("llama")
    warmup, timed = size["warmup"], args.timed or size["timed"]
    batches = _batches(cfg, device, warmup + timed)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    flops = model_flops_per_token(cfg) * tokens
    peak = _peak(device)
    variants = {
        "functional/eager": lambda: _Functional(cfg, model, device, None),
        "functional/compiled": lambda: _Functional(cfg, model, device, args.backend),
        "module/compiled+fused_adamw": lambda: _Module(cfg, model, device, args.backend),
    }
    out = {"shape": {**{k: getattr(cfg.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                                            "vocab_size")},
                     "batch": cfg.train.batch_size, "seq": cfg.train.seq_len, "precision": "bf16 (fp32 master)"},
           "model_flops_per_step": flops, "peak_flops": peak, "variants": {}}
    for name, make in variants.items():  # one at a time: at the 8B shape two would not fit together
        _free(device)
        tic = time.perf_counter()
        v = make()
        losses = [float(v.step(b)) for b in batches[:warmup]]
        first = time.perf_counter() - tic
        times = []
        for b in batches[warmup:]:
            t0 = time.perf_counter()
            losses.append(float(v.step(b)))  # float(): synchronized
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out["variants"][name] = {
            "ms_per_step": 1e3 * med, "ms_min": 1e3 * min(times), "tokens_per_s": tokens / med,
            "tflops": flops / med / 1e12, "mfu": flops / med / peak if peak else None,
            "warmup_s": first, "losses": losses, "peak_memory_gb": _peak_gb(device)}
        del v
        print(f"  step {name:<30} {1e3 * med:9.1f} ms  {tokens / med:10.0f} tok/s"
              + (f"  MFU {flops / med / peak:.3g}" if peak else "") + f"  (warm-up {first:.1f}s)", flush=True)
    v = out["variants"]
    ref = v["module/compiled+fused_adamw"]["ms_per_step"]
    out["ratio_vs_module"] = {k: v[k]["ms_per_step"] / ref for k in ("functional/eager", "functional/compiled")}
    out["first_loss_diff"] = max(abs(v[k]["losses"][0] - v["functional/eager"]["losses"][0]) for k in v)
    return out


# ----------------------------------------------------------------------------- moe


def _expert_loop(x, counts, w1, w2, w3):
    """The routed experts as one matmul chain per expert (the baseline a grouped GEMM replaces)."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        outs.append((F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e])
        start += n
    return torch.cat(outs)


def _moe_case(device, dtype, m: dict, reps: int) -> dict:
    from shardfn.core.moe import expert_compute

    g = torch.Generator(device="cpu").manual_seed(0)
    e, d, f, r = m["experts"], m["dim"], m["ffn"], m["rows"]
    counts = torch.bincount(torch.randint(e, (r,), generator=g), minlength=e).to(device)  # uneven, as routed
    x = (torch.randn(r, d, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w1, w3 = ((torch.randn(e, d, f, generator=g) * d ** -0.5).to(device, dtype).requires_grad_() for _ in range(2))
    w2 = (torch.randn(e, f, d, generator=g) * f ** -0.5).to(device, dtype).requires_grad_()
    dy = torch.randn(r, d, generator=g).to(device, dtype)
    flops = 3 * 3 * 2.0 * r * d * f   # three GEMMs, forward + two backward GEMMs each
    res = {}
    outs = {}
    for name, fn in (("grouped", expert_compute), ("loop", _expert_loop)):
        def run(fn=fn):
            y = fn(x, counts, w1, w2, w3)
            torch.autograd.backward(y, dy)
            return y
        outs[name] = run().detach().float()
        x.grad = w1.grad = w2.grad = w3.grad = None
        times = _timed(run, device, 1, reps)
        med = statistics.median(times)
        res[name] = {"ms": 1e3 * med, "tflops": flops / med / 1e12}
    res["speedup_grouped_vs_loop"] = res["loop"]["ms"] / res["grouped"]["ms"]
    res["max_abs_diff"] = float((outs["grouped"] - outs["loop"]).abs().max())
    return res


def check_moe(device: torch.device, size: dict, args) -> dict:
    m = size["moe"]
    out = {"shape": {**m, "swiglu": "w1, w3 [E, dim, ffn], w2 [E, ffn, dim]"}}
    reps = 1 if device.type == "cpu" else 10
    for dtype in (torch.bfloat16, torch.float32):
        _free(device)
        try:
            out[str(dtype).removeprefix("torch.")] = _moe_case(device, dtype, m, reps)
        except Exception as e:  # fp32 grouped GEMM is not on every card: say so and go on
            out[str(dtype).removeprefix("torch.")] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        r = out[str(dtype).removeprefix("torch.")]
        print(f"  moe {str(dtype):<16} " + (f"grouped {r['grouped']['ms']:.2f} ms ({r['grouped']['tflops']:.3g} "
              f"TFLOP/s), loop {r['loop']['ms']:.2f} ms: {r['speedup_grouped_vs_loop']:.2f}x"
              if "error" not in r else r["error"][:160]), flush=True)
    if "error" in out["bfloat16"]:
        raise RuntimeError(f"bf16 grouped GEMM failed: {out['bfloat16']['error']}")
    return out


# ----------------------------------------------------------------------------- gqa


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _one_rank_env(device: torch.device) -> dict:
    """Describe a one-rank process group as torchrun would (NCCL needs the variables); returns
    what to restore afterwards."""
    saved = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    if device.type == "cuda" and "RANK" not in os.environ:
        from shardfn.runtime.launch import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(device.index or 0), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    return saved


def _restore_env(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def check_gqa(device: torch.device, size: dict, args) -> dict:
    import torch.distributed as dist

    from shardfn import models
    from shardfn.partition.passes.grouped_heads import KERNELS
    from shardfn.runtime.partitioned import mesh_step
    from shardfn.runtime.train_step import make_optimizer

    aten = torch.ops.aten
    # one layer and a small vocabulary: the program's attention is what is looked at
    cfg = _config(size, 1, min(args.seq or size["seq"], 2048), vocab_size=min(size["model"]["vocab_size"], 1024))
    model = models.get("llama")
    import shardfn as sf

    saved = _one_rank_env(device)
    try:
        mesh = sf.Mesh({"dp": 1}, device=device.type)
        params = model.init(cfg.model, cfg.train.seed, device=device)
        opt = make_optimizer(cfg.train, model)
        step = mesh_step(cfg, model, opt, params, mesh, backend=None)
        lowered = step.jitted.lower(params, opt.init(params), _batches(cfg, device, 1)[0])
        nodes = list(lowered.graph_module.graph.nodes)
        ops = {k.forward: k for k in KERNELS} | {k.backward: k for k in KERNELS}
        kernels = []
        for n in nodes:
            if n.target in ops:
                at = 2 if n.target is ops[n.target].backward else 1
                q, k = n.args[at - 1].meta["val"], n.args[at].meta["val"]
                kernels.append({"op": n.target.name(), "q_heads": q.shape[1], "kv_heads": k.shape[1],
                                "dtype": str(q.dtype)})
        repeats = [n.name for n in nodes if n.target is aten.clone.default
                   and getattr(n.args[0], "target", None) is aten.expand.default]
        backend = dist.get_backend()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _restore_env(saved)
    grouped = all(k["kv_heads"] == cfg.model.n_kv_heads for k in kernels)
    out = {"kernels": kernels, "repeated_kv_copies": repeats, "process_group": backend,
           "heads": (cfg.model.n_heads, cfg.model.n_kv_heads), "ok": bool(kernels) and grouped and not repeats}
    print(f"  gqa {', '.join(sorted({k['op'] for k in kernels}))}: kv heads read "
          f"{sorted({k['kv_heads'] for k in kernels})} of {cfg.model.n_heads} query heads, "
          f"{len(repeats)} repeated copies ({backend})", flush=True)
    if not out["ok"]:
        raise RuntimeError(f"the per-rank program still repeats key/value heads: {json.dumps(out)}")
    return out


# ----------------------------------------------------------------------------- gemm


def check_gemm(device: torch.device, size: dict, args) -> dict:
    from shardfn.partition.cost.hardware import efficiency

    profile = card_profile(device)
    eff = efficiency(profile or "")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = _peak(device, dtype)
    other = size["gemm_other"]
    rows = []
    for small, share in eff.matmul if eff.matmul != ((1, 1.0),) else ((64, None), (128, None), (256, None),
                                                                        (512, None)):
        m = min(small, 8192)
        a = torch.randn(m, other, device=device, dtype=dtype)
        b = torch.randn(other, other, device=device, dtype=dtype)
        times = _timed(lambda: a @ b, device, 2, 10 if device.type == "cuda" else 3)
        rate = 2.0 * m * other * other / statistics.median(times)
        rows.append({"m": m, "n": other, "k": other, "tflops": rate / 1e12,
                     "share_of_peak": rate / peak if peak else None, "table_share": share,
                     "measured_over_table": rate / peak / share if peak and share else None})
        print(f"  gemm [{m} x {other}] @ [{other} x {other}] {rate / 1e12:8.3g} TFLOP/s"
              + (f"  {rate / peak:.3g} of peak (table {share})" if peak else ""), flush=True)
    a = size["attention"]
    q = torch.randn(a["batch"], a["heads"], a["seq"], a["head_dim"], device=device, dtype=dtype, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)
    dy = torch.randn_like(q)

    def attention():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.backward(y, dy)

    times = _timed(attention, device, 2, 10 if device.type == "cuda" else 3)
    # causal forward 2 B H S^2 D (half of QK^T and PV), backward twice that: the planner's count
    # (docs/plan.md, attention_s), so the share compares with the table's as the run model uses it
    flops = 3 * 2.0 * a["batch"] * a["heads"] * a["seq"] ** 2 * a["head_dim"]
    rate = flops / statistics.median(times)
    att = {**a, "tflops": rate / 1e12, "share_of_peak": rate / peak if peak else None,
           "table_share": eff.attention if profile not in (None, "cpu") else None}
    print(f"  attention causal fwd+bwd {rate / 1e12:8.3g} TFLOP/s"
          + (f"  {rate / peak:.3g} of peak (table {att['table_share']})" if peak else ""), flush=True)
    return {"profile": profile, "dtype": str(dtype), "peak_flops": peak, "table_source": eff.source,
            "matmul": rows, "attention": att}


# ----------------------------------------------------------------------------- tests


def check_tests(device: torch.device, size: dict, args) -> dict:
    if device.type != "cuda":
        return {"skipped": "the cuda-marked tests need a GPU"}
    tic = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    tail = proc.stdout.strip().splitlines()[-15:]
    print("  tests " + (tail[-1] if tail else "(no output)"), flush=True)
    out = {"returncode": proc.returncode, "summary": tail, "wall_s": time.perf_counter() - tic}
    if proc.returncode != 0:
        raise RuntimeError("cuda-marked tests failed:\n" + "\n".join(tail))
    return out


CHECKS = {"step": check_step, "moe": check_moe, "gqa": check_gqa, "gemm": check_gemm, "tests": check_tests}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"of {', '.join(SECTIONS)}")
    parser.add_argument("--layers", type=int, default=None, help="step: layers (default 2)")
    parser.add_argument("--seq", type=int, default=None, help="step: sequence length (default 8192 on cuda)")
    parser.add_argument("--timed", type=int, default=None, help="step: timed steps per variant")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default: inductor on cuda, eager on cpu)")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in CHECKS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; valid: {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "eager")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    size = SIZES[args.device]
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "profile": card_profile(device), "torch": torch.__version__,
              "cuda": torch.version.cuda, "backend": args.backend, "sections": {}}
    print(f"gpu_check on {result['device']} (torch {torch.__version__}, compile backend {args.backend})", flush=True)
    failed = []
    for name in names:
        tic = time.perf_counter()
        try:
            result["sections"][name] = CHECKS[name](device, size, args)
        except Exception as e:
            failed.append(name)
            result["sections"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        result["sections"][name]["wall_s"] = time.perf_counter() - tic
        _free(device)
    result["wall_s"] = time.perf_counter() - start
    result["failed"] = failed
    print(f"gpu_check done in {result['wall_s']:.1f}s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
