"""One training step of llama_tiny: shardfn's functional step vs an ``nn.Module`` reference.

Four variants (a fifth on request) run side by side in one process, from the same weights, on the same batches:

    functional/eager      make_train_step(llama, ...) called directly
    functional/compiled   the same function under torch.compile
    functional/regional   (on request) what ``train.compile=true`` runs: the repeated layer
                          compiled once and run by every layer, the rest eager
    reference/eager       an nn.Module Llama (below) + clip_grad_norm_ + torch.optim.AdamW
    reference/compiled    torch.compile'd forward + loss (AOTAutograd compiles the backward too)
                          and a torch.compile'd clip-and-step (the PyTorch "compiling the
                          optimizer" recipe, learning rate as a tensor)

Both sides do identical math: forward, cross-entropy, backward, global-norm clipping and AdamW
on the same warmup-cosine schedule. The script first checks that all four agree on the losses
and the parameters after the warm-up steps, then times the variants round-robin (so background
load hits them alike) and reports the median time per step and the ratios functional /
reference. Target: functional compiled <= 1.0x reference compiled.

``--eager-pairs`` instead compares the two eager steps (what ``shardfn train`` runs on one
device, and what a user of an ``nn.Module`` with ``torch.optim.AdamW`` runs) at two sizes, on one
thread: ``S`` (llama_tiny: dim 64, 2 layers, batch 16 x 128) and ``M`` (dim 256, 4 layers, batch
8 x 256). Each timed pair steps both once on the same batch, in alternating order (functional
first, then reference first), and the result is the median over pairs of the per-pair ratio
functional / reference, so load that comes and goes hits both sides of a pair alike (the ratio of
the process CPU times is reported beside it). Target: <= 1.0 at both sizes.

    python benchmarks/bench_core.py                       # llama_tiny, writes benchmarks/results/bench_core.json
    python benchmarks/bench_core.py --out /tmp/b.json train.batch_size=32
    python benchmarks/bench_core.py --variants functional/regional,reference/compiled model.n_layers=32
    python benchmarks/bench_core.py --eager-pairs         # S and M, writes benchmarks/results/bench_core_eager.json
    python benchmarks/bench_core.py --first-step          # first compiled step cold/warm, 2 -> 8 -> 32 layers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardfn import models
from shardfn.config import load_config
from shardfn.core import optim
from shardfn.core.pytree import tree_leaves
from shardfn.core.regional import with_compiled_layers
from shardfn.runtime import data
from shardfn.runtime.train_step import make_optimizer, make_train_step

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_core.json"
EAGER_OUT = Path(__file__).resolve().parent / "results" / "bench_core_eager.json"
SIZES = {
    "S": [],  # llama_tiny as its config has it
    "M": ["model.dim=256", "model.n_layers=4", "train.seq_len=256", "train.batch_size=8"],
}
"""``--eager-pairs`` sizes: overrides of the llama_tiny config."""


# ----------------------------------------------------------------------------- reference model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, S, hd]
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, S, hd]
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.n_kv_heads != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, hd]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(cfg.dim, cfg.norm_eps), Attention(cfg)
        self.ffn_norm, self.feed_forward = RMSNorm(cfg.dim, cfg.norm_eps), FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama 3 as an ``nn.Module`` (gpt-fast / TorchTitan layout), for comparison only."""

    def __init__(self, cfg):
        super().__init__()
        assert not cfg.tie_embeddings, "the reference model has an untied output head"
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        s, hd = tokens.shape[1], self.cfg.head_dim
        inv_freq = 1.0 / (
            self.cfg.rope_theta ** (torch.arange(0, hd, 2, device=tokens.device, dtype=torch.float32) / hd)
        )
        angles = torch.outer(torch.arange(s, device=tokens.device, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [S, hd]
        cos, sin = angles.cos(), angles.sin()
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def load_functional(self, params):
        """Copy a ``shardfn.models.llama`` parameter tree in (``[in, out]`` -> ``nn.Linear``'s ``[out, in]``)."""
        self.tok_embeddings.weight.copy_(params["embed"])
        self.norm.weight.copy_(params["norm"])
        self.output.weight.copy_(params["out"].t())
        stack = params["layers"]
        for i, layer in enumerate(self.layers):
            layer.attention_norm.weight.copy_(stack["attn_norm"][i])
            layer.ffn_norm.weight.copy_(stack["mlp_norm"][i])
            for name in ("wq", "wk", "wv", "wo"):
                getattr(layer.attention, name).weight.copy_(stack["attn"][name][i].t())
            for name in ("w1", "w2", "w3"):
                getattr(layer.feed_forward, name).weight.copy_(stack["mlp"][name][i].t())
        return self


# ----------------------------------------------------------------------------- variants


class Functional:
    def __init__(self, cfg, model, params, compiled):
        opt = make_optimizer(cfg.train, model)
        self.step_fn = make_train_step(model, cfg.model, opt)
        if compiled == "regional":  # what train.compile=true runs: one layer compiled, reused by all
            self.step_fn = with_compiled_layers(self.step_fn)
        elif compiled:
            self.step_fn = torch.compile(self.step_fn)
        self.params, self.state = params, opt.init(params)

    def step(self, batch):
        self.params, self.state, metrics = self.step_fn(self.params, self.state, batch)
        return metrics["loss"]

    def flat_params(self):
        p = self.params
        stack = p["layers"]
        out = [p["embed"]]
        for i in range(stack["attn_norm"].shape[0]):
            out += [stack["attn_norm"][i], stack["mlp_norm"][i]]
            out += [stack["attn"][n][i] for n in ("wq", "wk", "wv", "wo")]
            out += [stack["mlp"][n][i] for n in ("w1", "w2", "w3")]
        return out + [p["norm"], p["out"]]


class Reference:
    def __init__(self, cfg, params, compiled):
        t = cfg.train
        self.module = Llama(cfg.model).load_functional(params)
        self.schedule = optim.warmup_cosine(t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        lr = torch.tensor(float(self.schedule(0))) if compiled else float(self.schedule(0))
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=lr, betas=(t.b1, t.b2), eps=t.eps,
                                     weight_decay=t.weight_decay)
        self.clip, self.compiled, self.count = t.grad_clip, compiled, 0
        self.forward_loss = torch.compile(self._forward_loss) if compiled else self._forward_loss
        self.update = torch.compile(self._update) if compiled else self._update

    def _forward_loss(self, inputs, targets):
        logits = self.module(inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def _update(self):
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.opt.step()

    def step(self, batch):
        lr = float(self.schedule(self.count))
        for group in self.opt.param_groups:
            if self.compiled:
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward_loss(batch["inputs"], batch["targets"])
        loss.backward()
        self.update()
        self.count += 1
        return loss.detach()

    def flat_params(self):
        m = self.module
        out = [m.tok_embeddings.weight.detach()]
        for layer in m.layers:
            out += [layer.attention_norm.weight.detach(), layer.ffn_norm.weight.detach()]
            out += [getattr(layer.attention, n).weight.detach().t() for n in ("wq", "wk", "wv", "wo")]
            out += [getattr(layer.feed_forward, n).weight.detach().t() for n in ("w1", "w2", "w3")]
        return out + [m.norm.weight.detach(), m.output.weight.detach().t()]


# ----------------------------------------------------------------------------- eager pairs


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def eager_pairs(sizes: dict[str, list[str]], *, config: str, warmup: int, pairs: int, overrides: list[str]) -> dict:
    """Per size: the eager functional step and the eager ``nn.Module`` step from the same weights,
    checked to agree after ``warmup`` steps, then ``pairs`` alternated pairs on one thread."""
    torch.set_num_threads(1)
    out = {}
    for size, size_overrides in sizes.items():
        cfg = load_config(config, [*size_overrides, *overrides])
        t = cfg.train
        model = models.get("llama")
        params = model.init(cfg.model, t.seed, device=torch.device(cfg.runtime.device))
        tokens = data.from_config(cfg.data)
        batches = [data.get_batch(tokens, s, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed,
                                  device=torch.device(cfg.runtime.device)) for s in range(warmup + pairs)]
        sides = {"functional": Functional(cfg, model, params, compiled=False),
                 "reference": Reference(cfg, params, compiled=False)}
        losses = {n: [float(v.step(batches[i])) for i in range(warmup)] for n, v in sides.items()}
        dp = max(float((a - b).abs().max())
                 for a, b in zip(sides["functional"].flat_params(), sides["reference"].flat_params()))
        dl = max(abs(a - b) for a, b in zip(losses["functional"], losses["reference"]))
        times, cpu_times = {n: [] for n in sides}, {n: [] for n in sides}
        ratios, cpu_ratios = [], []
        for k in range(pairs):
            batch = batches[warmup + k]
            order = ("functional", "reference") if k % 2 == 0 else ("reference", "functional")
            for name in order:
                tic, cpu = time.perf_counter(), time.process_time()
                float(sides[name].step(batch))  # sync: the step is done
                times[name].append(time.perf_counter() - tic)
                cpu_times[name].append(time.process_time() - cpu)
            ratios.append(times["functional"][-1] / times["reference"][-1])
            cpu_ratios.append(cpu_times["functional"][-1] / max(cpu_times["reference"][-1], 1e-9))
        n_params = sum(x.numel() for x in tree_leaves(params))
        out[size] = {
            "model": {k: getattr(cfg.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                                            "vocab_size")},
            "batch_size": t.batch_size, "seq_len": t.seq_len, "params": n_params,
            "functional_ms": 1e3 * statistics.median(times["functional"]),
            "reference_ms": 1e3 * statistics.median(times["reference"]),
            "ratio_median": statistics.median(ratios),
            "ratio_q25": _quantile(ratios, 0.25), "ratio_q75": _quantile(ratios, 0.75),
            # CPU time of the process: what each step computed, without the time it waited for a core
            "cpu_ratio_median": statistics.median(cpu_ratios),
            "functional_cpu_ms": 1e3 * statistics.median(cpu_times["functional"]),
            "reference_cpu_ms": 1e3 * statistics.median(cpu_times["reference"]),
            "pairs": pairs,
            "parity": {"max_abs_param_diff": dp, "max_abs_loss_diff": dl, "after_steps": warmup},
        }
        r = out[size]
        print(f"{size}: dim {cfg.model.dim}, {cfg.model.n_layers} layers, batch {t.batch_size}x{t.seq_len}, "
              f"{n_params:,} params: functional {r['functional_ms']:.1f} ms, reference {r['reference_ms']:.1f} ms, "
              f"ratio {r['ratio_median']:.3f} (quartiles {r['ratio_q25']:.3f}..{r['ratio_q75']:.3f}, {pairs} pairs; "
              f"CPU time {r['cpu_ratio_median']:.3f}); "
              f"parity after {warmup} steps: params {dp:.1e}, loss {dl:.1e}", flush=True)
    return out


def main_eager_pairs(args) -> dict:
    sizes = {k: SIZES[k] for k in args.sizes.split(",")}
    results = eager_pairs(sizes, config=args.config, warmup=args.warmup, pairs=args.pairs, overrides=args.overrides)
    out = {
        "benchmark": "bench_core --eager-pairs",
        "what": "eager one-device step: shardfn make_train_step vs nn.Module + clip_grad_norm_ + "
                "torch.optim.AdamW (foreach), same weights and batches",
        "method": "alternated pairs (order flips every pair), one thread; ratio = median of per-pair ratios",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},  # glibc tuning, if any
        "sizes": results,
        "ratios_functional_over_reference": {k: v["ratio_median"] for k, v in results.items()},
        "target": "ratio <= 1.0 at every size",
        "target_met": all(v["ratio_median"] <= 1.0 for v in results.values()),
    }
    print("functional / reference (eager): "
          + ", ".join(f"{k} {v:.3f}x" for k, v in out["ratios_functional_over_reference"].items()))
    path = Path(args.out or EAGER_OUT)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


# ----------------------------------------------------------------------------- first steps

FIRST_OUT = Path(__file__).resolve().parent / "results" / "bench_core_first_step.json"
FIRST_VARIANTS = ("reference/compiled", "functional/compiled", "functional/regional")


def first_step_worker(variant: str, overrides: list[str]) -> dict:
    """One process: build ``variant``, time its first step (compilation included) and the median
    of 5 later ones. Run with ``TORCHINDUCTOR_CACHE_DIR`` set by the caller (cold or warm)."""
    torch.set_num_threads(1)
    cfg = load_config("llama_tiny", overrides)
    t = cfg.train
    model = models.get("llama")
    params = model.init(cfg.model, t.seed)
    tokens = data.from_config(cfg.data)
    batches = [data.get_batch(tokens, s, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed) for s in range(6)]
    factory = {"reference/compiled": lambda: Reference(cfg, params, compiled=True),
               "functional/compiled": lambda: Functional(cfg, model, params, compiled=True),
               "functional/regional": lambda: Functional(cfg, model, params, compiled="regional")}[variant]
    tic = time.perf_counter()
    runner = factory()
    float(runner.step(batches[0]))
    first = time.perf_counter() - tic
    later = []
    for b in batches[1:]:
        tic = time.perf_counter()
        float(runner.step(b))
        later.append(time.perf_counter() - tic)
    return {"first_s": first, "steady_ms": 1e3 * statistics.median(later)}


def first_steps(series: list[int], whole_up_to: int) -> dict:
    """Each variant's first step, cold (an empty inductor cache) then warm (the same cache
    again), in its own process, for llama_tiny with ``n_layers`` in ``series``; the whole-step
    compile only up to ``whole_up_to`` layers (it unrolls every layer into one graph)."""
    out: dict = {}
    for n in series:
        for variant in FIRST_VARIANTS:
            if variant == "functional/compiled" and n > whole_up_to:
                continue
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
                row = {}
                for start in ("cold", "warm"):
                    done = subprocess.run([sys.executable, __file__, "--first-step-worker", variant,
                                           f"model.n_layers={n}"], env=env, capture_output=True, text=True,
                                          check=True)
                    row[start] = json.loads(done.stdout.strip().splitlines()[-1])
                out.setdefault(variant, {})[n] = row
                print(f"{variant:<22} {n:>2} layers: first step cold {row['cold']['first_s']:6.1f} s, "
                      f"warm {row['warm']['first_s']:5.1f} s; steady {row['warm']['steady_ms']:.1f} ms", flush=True)
    return out


def main_first_steps(args) -> dict:
    series = [int(n) for n in args.layers.split(",")]
    results = first_steps(series, args.whole_up_to)
    regional, reference = results["functional/regional"], results["reference/compiled"]
    lo, hi = min(series), max(series)
    out = {
        "benchmark": "bench_core --first-step",
        "what": "llama_tiny's first training step (compilation included) and its steady step, one thread: "
                "nn.Module under torch.compile with a compiled optimizer step; shardfn's whole step compiled "
                "(train.compile=whole); shardfn's repeated layer compiled once (train.compile=true)",
        "method": "each in a fresh process; cold = empty TORCHINDUCTOR_CACHE_DIR, warm = the same directory again",
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "first_step": results,
        "regional_over_reference_cold": {n: regional[n]["cold"]["first_s"] / reference[n]["cold"]["first_s"]
                                         for n in series},
        "regional_depth_ratio_cold": regional[hi]["cold"]["first_s"] / regional[lo]["cold"]["first_s"],
        "target": "regional cold first step <= reference's; depth ratio (first -> last of the series) <= 2.5",
    }
    print("regional / reference, cold first step: "
          + ", ".join(f"{n} layers {r:.2f}x" for n, r in out["regional_over_reference_cold"].items())
          + f"; regional {lo} -> {hi} layers: {out['regional_depth_ratio_cold']:.2f}x")
    path = Path(args.out or FIRST_OUT)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


# ----------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama_tiny", help="run config (default: llama_tiny)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (compilation)")
    parser.add_argument("--rounds", type=int, default=6, help="round-robin rounds over the variants")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--variants", default="functional/eager,functional/compiled,reference/eager,reference/compiled")
    parser.add_argument("--out", default=None, help=f"JSON results (default: {DEFAULT_OUT}, or {EAGER_OUT} "
                                                    "with --eager-pairs)")
    parser.add_argument("--eager-pairs", action="store_true",
                        help="compare the eager steps at the sizes of --sizes in alternated pairs")
    parser.add_argument("--sizes", default="S,M", help=f"with --eager-pairs: of {', '.join(SIZES)} (default: S,M)")
    parser.add_argument("--pairs", type=int, default=30, help="with --eager-pairs: timed pairs per size")
    parser.add_argument("--first-step", action="store_true",
                        help="first compiled step, cold and warm, of each compiled variant over --layers")
    parser.add_argument("--layers", default="2,8,32", help="with --first-step: n_layers series (default 2,8,32)")
    parser.add_argument("--whole-up-to", type=int, default=8,
                        help="with --first-step: the largest n_layers to compile as one whole step (default 8)")
    parser.add_argument("--first-step-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    if args.first_step_worker:
        print(json.dumps(first_step_worker(args.first_step_worker, args.overrides)))
        return {}
    if args.first_step:
        return main_first_steps(args)
    if args.eager_pairs:
        unknown = [k for k in args.sizes.split(",") if k not in SIZES]
        if unknown:
            parser.error(f"unknown size {unknown[0]!r}; valid: {', '.join(SIZES)}")
        return main_eager_pairs(args)
    args.out = args.out or str(DEFAULT_OUT)

    cfg = load_config(args.config, args.overrides)
    if cfg.model_name != "llama":
        parser.error(f"the reference module is a Llama; {args.config} is a {cfg.model_name!r} model")
    torch.manual_seed(0)
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)  # llama_tiny: 1 (see its config); runtime.threads=2 to change
    device = torch.device(cfg.runtime.device)
    t = cfg.train
    model = models.get("llama")
    params = model.init(cfg.model, t.seed, device=device)
    tokens = data.from_config(cfg.data)
    n_batches = args.warmup + args.rounds * args.steps
    batches = [data.get_batch(tokens, s, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed, device=device)
               for s in range(n_batches)]

    factories = {
        "functional/eager": lambda: Functional(cfg, model, params, compiled=False),
        "functional/compiled": lambda: Functional(cfg, model, params, compiled=True),
        "functional/regional": lambda: Functional(cfg, model, params, compiled="regional"),
        "reference/eager": lambda: Reference(cfg, params, compiled=False),
        "reference/compiled": lambda: Reference(cfg, params, compiled=True),
    }
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in factories]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; valid: {', '.join(factories)}")
    variants = {n: factories[n]() for n in names}

    # Warm-up (compiles), and a parity check: same losses and parameters from the same start.
    warm = {}
    losses = {}
    for name, v in variants.items():
        tic = time.perf_counter()
        losses[name] = [float(v.step(batches[i])) for i in range(args.warmup)]
        warm[name] = time.perf_counter() - tic
        print(f"warm-up {name:<20} {warm[name]:7.2f}s  losses {[round(x, 4) for x in losses[name]]}", flush=True)
    base = names[0]
    parity = {}
    for name in names[1:]:
        dp = max(float((a - b).abs().max()) for a, b in zip(variants[base].flat_params(), variants[name].flat_params()))
        dl = max(abs(a - b) for a, b in zip(losses[base], losses[name]))
        parity[name] = {"max_abs_param_diff": dp, "max_abs_loss_diff": dl}

    # Timing, round-robin.
    times = {n: [] for n in names}
    i = args.warmup
    for _ in range(args.rounds):
        for name, v in variants.items():
            for k in range(args.steps):
                batch = batches[i + k]
                tic = time.perf_counter()
                float(v.step(batch))  # sync: the step is done
                times[name].append(time.perf_counter() - tic)
        i += args.steps

    tokens_per_step = t.batch_size * t.seq_len
    results = {}
    for name in names:
        med = statistics.median(times[name])
        results[name] = {"ms_per_step": 1e3 * med, "tokens_per_s": tokens_per_step / med,
                         "ms_per_step_min": 1e3 * min(times[name]), "warmup_s": warm[name]}
    ratios, ratios_min, ratios_paired = {}, {}, {}
    for mode, (f, r) in {"eager": ("functional/eager", "reference/eager"),
                         "compiled": ("functional/compiled", "reference/compiled"),
                         # what train.compile=true runs: the repeated layer compiled once
                         "regional": ("functional/regional", "reference/compiled")}.items():
        if f in results and r in results:
            ratios[mode] = results[f]["ms_per_step"] / results[r]["ms_per_step"]
            ratios_min[mode] = results[f]["ms_per_step_min"] / results[r]["ms_per_step_min"]
            # the i-th timed step of each side ran in the same round: the median of those pairs' ratios
            ratios_paired[mode] = statistics.median(a / b for a, b in zip(times[f], times[r]))

    print(f"\n{cfg.model_name} {cfg.source and Path(cfg.source).stem}: batch {t.batch_size}x{t.seq_len}, "
          f"{sum(x.numel() for x in tree_leaves(params)):,} params, {device}, {torch.get_num_threads()} threads")
    print(f"{'variant':<22}{'ms/step':>10}{'min':>10}{'tok/s':>12}{'warm-up s':>11}")
    for name, r in results.items():
        print(f"{name:<22}{r['ms_per_step']:>10.2f}{r['ms_per_step_min']:>10.2f}{r['tokens_per_s']:>12,.0f}{r['warmup_s']:>11.1f}")
    for mode, x in ratios.items():
        print(f"functional / reference ({mode}): {x:.3f}x median, {ratios_paired[mode]:.3f}x median of "
              f"same-round pairs, {ratios_min[mode]:.3f}x best step")
    for name, p in parity.items():
        print(f"parity {base} vs {name}: params {p['max_abs_param_diff']:.2e}, loss {p['max_abs_loss_diff']:.2e}")

    compiled_modes = [m for m in ("compiled", "regional") if m in ratios]
    out = {
        "benchmark": "bench_core",
        "config": cfg.source,
        "model": cfg.model_name,
        "batch_size": t.batch_size,
        "seq_len": t.seq_len,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "timed_steps_per_variant": args.rounds * args.steps,
        "variants": results,
        "ratios_functional_over_reference": ratios,  # of the median step times
        "ratios_functional_over_reference_best_step": ratios_min,
        "ratios_functional_over_reference_paired": ratios_paired,  # median of per-round pair ratios
        "load_average_1min": os.getloadavg()[0],  # other work on the machine skews the medians
        "target": "functional/compiled (and functional/regional) <= 1.0x reference/compiled",
        "target_met": all(ratios[m] <= 1.0 for m in compiled_modes) if compiled_modes else None,
        "parity_vs_" + base.replace("/", "_"): parity,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
