"""MoE train steps against the same math written the way TorchTitan writes MoE, like for like.

(a) ``--parts titan`` (the default): ``shardfn train``'s step for moe_tiny at dim 256, 4 layers
    (1 dense, 3 MoE: 8 experts top-2 + 1 shared, expert ffn 256), MLA, seq 256, batch 8, on one
    device and on ``mesh.ep=2`` (2 gloo ranks), against an ``nn.Module`` written here as
    TorchTitan writes MoE: a sigmoid router with a selection bias, tokens sorted by expert,
    stacked expert weights through ``torch._grouped_mm``, scores times outputs ``scatter_add``ed
    onto the shared expert's output; for ep, token counts then tokens exchanged with
    ``all_to_all_single`` (autograd), local experts, and back; non-expert weights under
    ``DistributedDataParallel``, expert gradients divided by the ep degree, clipping over both;
    ``torch.optim.AdamW(foreach=True)``; the selection bias moved by the summed expert counts
    after the step (auxiliary-loss-free balancing). Both sides start from the same weights: the
    first step's loss and gradient norm are compared (parity) before any timing. With
    ``--compile`` the shardfn side also runs under ``train.compile`` (inductor), reported as its
    own row against the same eager module.
(b) ``--parts layouts``: ep against replicated experts on 2 and 4 ranks; ``--parts grouped``:
    one grouped GEMM per projection against a Python loop over experts.

Every timed comparison alternates the two sides in pairs (the order flips every pair), feeds each
side its own previous step's outputs, runs one compute thread per process, and reports the
median of the per-pair ratios (``bench_partition.alternated``).

    python benchmarks/bench_moe.py [--pairs 12] [--out benchmarks/results/bench_moe.json] [--compile]
    python benchmarks/bench_moe.py --parts layouts grouped
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_partition import alternated  # noqa: E402
from fixtures import median_seconds  # noqa: E402  (tests/fixtures.py)

SIZE = ["model.dim=256", "model.n_layers=4", "model.first_k_dense=1", "model.expert_ffn_dim=256",
        "train.seq_len=256", "train.batch_size=8"]


# ----------------------------------------------------------------------------- the nn.Module side


def _linear(w: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` holding ``w [in, out]`` (shardfn's layout) as its ``[out, in]`` weight."""
    layer = nn.Linear(w.shape[0], w.shape[1], bias=False)
    layer.weight = nn.Parameter(w.t().contiguous())
    return layer


def _norm(w: torch.Tensor, eps: float) -> nn.RMSNorm:
    norm = nn.RMSNorm(w.shape[0], eps=eps)
    norm.weight = nn.Parameter(w.clone())
    return norm


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class FeedForward(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.w1, self.w2, self.w3 = _linear(p["w1"]), _linear(p["w2"]), _linear(p["w3"])

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MLA(nn.Module):
    def __init__(self, p, cfg):
        super().__init__()
        self.c = cfg
        self.wq_a, self.wq_b = _linear(p["wq_a"]), _linear(p["wq_b"])
        self.q_norm, self.kv_norm = _norm(p["q_norm"], 1e-6), _norm(p["kv_norm"], 1e-6)
        self.wkv_a, self.wkv_b, self.wo = _linear(p["wkv_a"]), _linear(p["wkv_b"]), _linear(p["wo"])

    def forward(self, x, cos, sin):
        c = self.c
        B, S, _ = x.shape
        n, r, v, H = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.n_heads
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, S, H, n + r).transpose(1, 2)   # [B, H, S, n+r]
        q_nope, q_rope = q.split([n, r], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([c.kv_lora_rank, r], dim=-1)
        kv = self.wkv_b(self.kv_norm(c_kv)).view(B, S, H, n + v).transpose(1, 2)          # [B, H, S, n+v]
        k_nope, val = kv.split([n, v], dim=-1)
        k_rope = _rope(k_rope.unsqueeze(1), cos, sin)                                       # [B, 1, S, r]
        q = torch.cat([q_nope, _rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, H, -1, -1)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, val, is_causal=True, scale=(n + r) ** -0.5)
        return self.wo(out.transpose(1, 2).reshape(B, S, H * v))


class MoE(nn.Module):
    """TorchTitan's MoE: router (sigmoid, selection bias), tokens sorted by expert, grouped GEMMs
    over stacked weights (this rank's experts, tokens exchanged over ``ep_group``), scores
    times outputs scatter-added onto the shared expert's output."""

    def __init__(self, p, cfg, ep_group=None):
        super().__init__()
        import torch.distributed as dist

        self.c, self.group = cfg, ep_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        e_local = cfg.n_experts // self.ep
        lo = (dist.get_rank(ep_group) if ep_group is not None else 0) * e_local
        self.router = _linear(p["router"])
        self.register_buffer("expert_bias", p["router_bias"].clone())
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts))
        e = p["experts"]
        self.w1, self.w2, self.w3 = (nn.Parameter(e[k][lo:lo + e_local].clone()) for k in ("w1", "w2", "w3"))
        self.shared = FeedForward(p["shared"])

    def experts(self, x, counts):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1, offs=offs)) * torch._grouped_mm(x, self.w3, offs=offs)
        return torch._grouped_mm(h, self.w2, offs=offs)

    def exchanged_experts(self, x, counts):
        import torch.distributed._functional_collectives as funcol

        e_local = self.c.n_experts // self.ep
        recv = funcol.all_to_all_single(counts, None, None, self.group).wait()             # [ep * E_local]
        in_splits = counts.view(self.ep, e_local).sum(1).tolist()
        out_splits = recv.view(self.ep, e_local).sum(1).tolist()
        routed = funcol.all_to_all_single_autograd(x, out_splits, in_splits, self.group)
        routed = funcol.wait_tensor(routed) if isinstance(routed, funcol.AsyncCollectiveTensor) else routed
        expert_of_row = torch.arange(e_local).repeat(self.ep).repeat_interleave(recv)
        perm = torch.argsort(expert_of_row, stable=True)                                    # rank-major -> expert-major
        out = self.experts(routed[perm], recv.view(self.ep, e_local).sum(0))
        out = out[torch.argsort(perm)]
        back = funcol.all_to_all_single_autograd(out, in_splits, out_splits, self.group)
        return funcol.wait_tensor(back) if isinstance(back, funcol.AsyncCollectiveTensor) else back

    def forward(self, x):
        c = self.c
        B, S, D = x.shape
        x = x.reshape(-1, D)
        scores = torch.sigmoid(self.router(x).float())                                     # [T, E]
        _, idx = torch.topk(scores + self.expert_bias, c.top_k, dim=-1)
        top = scores.gather(1, idx)
        top = top / (top.sum(-1, keepdim=True) + 1e-20) * c.route_scale
        flat = idx.view(-1)
        counts = torch.bincount(flat, minlength=c.n_experts)
        with torch.no_grad():
            self.tokens_per_expert += counts
        order = torch.argsort(flat, stable=True)
        tok = order // c.top_k
        routed_in = x[tok]                                                                 # [T*k, D]
        routed = self.experts(routed_in, counts) if self.group is None else self.exchanged_experts(routed_in, counts)
        routed = (routed.float() * top.view(-1)[order, None]).to(x.dtype)
        out = self.shared(x).scatter_add(0, tok[:, None].expand(-1, D), routed)
        return out.view(B, S, D)


class Block(nn.Module):
    def __init__(self, p, cfg, moe: bool, ep_group=None):
        super().__init__()
        self.attn_norm, self.mlp_norm = _norm(p["attn_norm"], cfg.norm_eps), _norm(p["mlp_norm"], cfg.norm_eps)
        self.attn = MLA(p["attn"], cfg)
        self.mlp = MoE(p, cfg, ep_group) if moe else FeedForward(p["mlp"])

    def forward(self, h, cos, sin):
        h = h + self.attn(self.attn_norm(h), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """moe_tiny as an ``nn.Module``, loaded from a shardfn parameter tree."""

    def __init__(self, params, cfg, ep_group=None):
        super().__init__()
        self.c = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embed.weight = nn.Parameter(params["embed"].clone())
        layer = lambda stack, i: {k: _at(v, i) for k, v in params[stack].items()}  # noqa: E731
        self.layers = nn.ModuleList(
            [Block(layer("dense_layers", i), cfg, False) for i in range(cfg.first_k_dense)]
            + [Block(layer("moe_layers", i), cfg, True, ep_group) for i in range(cfg.n_moe_layers)])
        self.norm = _norm(params["norm"], cfg.norm_eps)
        self.out = _linear(params["out"])
        r = cfg.qk_rope_head_dim
        inv = cfg.rope_theta ** (-torch.arange(0, r, 2, dtype=torch.float32) / r)
        ang = torch.outer(torch.arange(4096, dtype=torch.float32), inv)
        ang = torch.cat([ang, ang], -1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, tokens):
        S = tokens.shape[1]
        cos, sin = self.cos[:S], self.sin[:S]
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.out(self.norm(h))


def _at(tree, i):
    return {k: _at(v, i) for k, v in tree.items()} if isinstance(tree, dict) else tree[i]


def module_step(cfg, params, ep_group=None):
    """TorchTitan's training step for the module: DDP over the non-expert weights (ep > 1),
    expert gradients divided by the ep degree, clip_grad_norm over both (the expert part's
    square summed over ranks), AdamW (foreach) at the run's hyperparameters and schedule, then
    the selection bias moved by the expert counts summed over ranks. Returns ``(step, module)``;
    ``step(local_batch) -> (loss, grad_norm)``."""
    import torch.distributed as dist

    from shardfn.core import optim

    t, m = cfg.train, cfg.model
    module = Transformer(params, m, ep_group)
    moes = [b.mlp for b in module.layers if isinstance(b.mlp, MoE)]
    experts = [p for moe in moes for p in (moe.w1, moe.w2, moe.w3)]
    expert_ids = {id(p) for p in experts}
    dense = [p for p in module.parameters() if id(p) not in expert_ids]
    ep = moes[0].ep
    model = module
    if ep > 1:
        from torch.nn.parallel import DistributedDataParallel

        names = [n for n, p in module.named_parameters() if id(p) in expert_ids]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
        model = DistributedDataParallel(module, broadcast_buffers=False)
    opt = torch.optim.AdamW(list(module.parameters()), lr=t.lr, betas=(t.b1, t.b2), eps=t.eps,
                            weight_decay=t.weight_decay, foreach=True)
    schedule = optim.warmup_cosine(t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
    count = [0]

    def step(batch):
        for group in opt.param_groups:
            group["lr"] = float(schedule(count[0]))
        opt.zero_grad(set_to_none=True)
        logits = model(batch["inputs"])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1))
        loss.backward()
        grads_e = [p.grad for p in experts]
        if ep > 1:
            torch._foreach_div_(grads_e, ep)
        grads_d = [p.grad for p in dense]
        sq_e = torch.stack(torch._foreach_norm(grads_e)).square().sum()
        if ep > 1:
            dist.all_reduce(sq_e, group=ep_group)
        norm = (torch.stack(torch._foreach_norm(grads_d)).square().sum() + sq_e).sqrt()
        torch._foreach_mul_(grads_d + grads_e, torch.clamp(t.grad_clip / (norm + 1e-6), max=1.0))
        opt.step()
        with torch.no_grad():
            counts = torch.stack([moe.tokens_per_expert for moe in moes])                  # [L, E]
            if ep > 1:
                dist.all_reduce(counts, group=ep_group)
            for moe, c in zip(moes, counts):
                moe.expert_bias += m.bias_update_rate * torch.sign(c.mean() - c)
                moe.tokens_per_expert.zero_()
        count[0] += 1
        return loss.detach(), norm.detach()

    return step, module


# ----------------------------------------------------------------------------- (a) the comparison


def _titan_worker(pairs: int, ep: int, compile_: bool) -> dict:
    import torch.distributed as dist

    from shardfn import models
    from shardfn.config import load_config
    from shardfn.core.pytree import tree_map
    from shardfn.runtime import data
    from shardfn.runtime.build import build_step

    torch.set_num_threads(1)
    layout = [f"mesh.ep={ep}"] if ep > 1 else []
    cfg = load_config("moe_tiny", [*SIZE, *layout, *(["train.compile=true"] if compile_ else [])])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, cfg.train.seed)
    t = cfg.train
    tokens = data.from_config(cfg.data)
    batches = [data.get_batch(tokens, i, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed)
               for i in range(2 * pairs + 4)]
    ours = build_step(cfg, model, params, donate=True)  # as `shardfn train` builds it
    state = [*ours.place(tree_map(torch.clone, params)), 0]  # its own copy: the step writes into it
    ep_group = dist.new_group(list(range(ep))) if ep > 1 else None  # TorchTitan's ep mesh dim: its own group
    theirs, module = module_step(cfg, params, ep_group)
    rank, rows = dist.get_rank(), t.batch_size // ep
    seen = [0]

    def run_ours():
        state[0], state[1], metrics = ours(state[0], state[1], batches[state[2]])
        state[2] += 1
        return metrics

    def run_theirs():
        batch = {k: v[rank * rows:(rank + 1) * rows] for k, v in batches[seen[0]].items()}
        seen[0] += 1
        return theirs(batch)

    mine = run_ours()
    loss, norm = run_theirs()
    if ep > 1:
        dist.all_reduce(loss)
        loss /= ep
    parity = {"shardfn_loss": float(mine["loss"]), "module_loss": float(loss),
              "shardfn_grad_norm": float(mine["grad_norm"]), "module_grad_norm": float(norm)}
    parity["grad_norm_rel"] = abs(parity["shardfn_grad_norm"] / parity["module_grad_norm"] - 1)
    for _ in range(2):  # lowering, compile, allocator warm-up
        run_ours()
        run_theirs()
    out = alternated(lambda: float(run_ours()["loss"]), lambda: float(run_theirs()[0]), pairs)
    out["parity"] = parity
    return out


def titan(pairs: int, compile_: bool) -> dict:
    from shardfn.runtime.launch import spawn

    rows = {}
    for name, ep, comp in [("one device", 1, False), ("ep2", 2, False)] + ([("ep2, train.compile", 2, True)]
                                                                           if compile_ else []):
        rows[name] = spawn(_titan_worker, ep, args=(pairs, ep, comp), timeout_s=1800)[0]
        r = rows[name]
        p = r["parity"]
        print(f"{name}: shardfn {r['shardfn_s'] * 1e3:.1f} ms, module {r['torch_s'] * 1e3:.1f} ms -> "
              f"{r['ratio']:.3f}x (median of {pairs} pair ratios); first loss {p['shardfn_loss']:.6f} vs "
              f"{p['module_loss']:.6f}, grad norm rel diff {p['grad_norm_rel']:.1e}", flush=True)
        assert abs(p["shardfn_loss"] - p["module_loss"]) <= 1e-4 * abs(p["module_loss"]), p
        assert p["grad_norm_rel"] <= 1e-4, p
    return rows


def table(rows: dict) -> str:
    lines = ["| layout | shardfn ms | module ms | shardfn / module (median of pair ratios) |", "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['shardfn_s'] * 1e3:.1f} | {r['torch_s'] * 1e3:.1f} | {r['ratio']:.3f}x |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- (b) layouts, grouped GEMM


def _layout_worker(overrides, steps):
    from shardfn import models
    from shardfn.config import load_config
    from shardfn.runtime import data
    from shardfn.runtime.partitioned import mesh_from_config, mesh_step
    from shardfn.runtime.train_step import make_optimizer

    cfg = load_config("moe_tiny", ["train.batch_size=16", "train.seq_len=64", *overrides])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, 0)
    opt = make_optimizer(cfg.train, model)
    state = {"p": params, "s": opt.init(params)}
    step = mesh_step(cfg, model, opt, params, mesh_from_config(cfg), backend=None)
    tokens = data.from_config(cfg.data)
    batch = data.get_batch(tokens, 0, batch_size=16, seq_len=64, seed=0)

    def run():
        state["p"], state["s"], state["m"] = step(state["p"], state["s"], batch)

    seconds = median_seconds(run, steps)
    a2a = [r for r in step.jitted.lower(state["p"], state["s"], batch).comm_report() if r["op"] == "all_to_all"]
    return {"step_s": seconds, "a2a_bytes": sum(r["bytes"] for r in a2a),
            "metrics": {k: float(v) for k, v in state["m"].items()}}


def grouped_vs_loop(n_experts=8, tokens=4096, dim=256, ffn=512, steps=10) -> dict:
    from shardfn.core.grouped_mm import grouped_mm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g, requires_grad=True)
    w1, w3 = (torch.randn(n_experts, dim, ffn, generator=g).requires_grad_() for _ in range(2))
    w2 = torch.randn(n_experts, ffn, dim, generator=g).requires_grad_()
    counts = torch.bincount(torch.randint(0, n_experts, (tokens,), generator=g), minlength=n_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)

    def grouped():
        h = F.silu(grouped_mm(x, w1, offs)) * grouped_mm(x, w3, offs)
        grouped_mm(h, w2, offs).sum().backward()

    def loop():
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start:start + n]
            outs.append((F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e])
            start += n
        torch.cat(outs).sum().backward()

    t_g, t_l = median_seconds(grouped, steps), median_seconds(loop, steps)
    return {"grouped_s": t_g, "loop_s": t_l, "speedup": t_l / t_g}


def layouts(steps: int) -> dict:
    from shardfn.runtime.launch import spawn

    result = {}
    for n in (2, 4):
        ep = spawn(_layout_worker, n, args=([f"mesh.ep={n}"], steps), timeout_s=900)[0]
        rep = spawn(_layout_worker, n, args=([f"mesh.dp={n}"], steps), timeout_s=900)[0]
        result[f"{n}_ranks"] = {"ep": ep, "replicated": rep, "ep_over_replicated": ep["step_s"] / rep["step_s"]}
        load = {k: v for k, v in ep["metrics"].items() if "load" in k or "imbalance" in k}
        print(f"{n} ranks: ep{n} {ep['step_s']*1e3:.1f} ms vs replicated experts {rep['step_s']*1e3:.1f} ms "
              f"-> {ep['step_s'] / rep['step_s']:.2f}x; all-to-all {ep['a2a_bytes']:,} B/step on rank 0; load {load}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/bench_moe.json")
    parser.add_argument("--parts", nargs="+", default=["titan"], choices=["titan", "layouts", "grouped"])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also ep2 under train.compile")
    args = parser.parse_args()
    result = {}
    if "titan" in args.parts:
        result["titan"] = titan(args.pairs, args.compile)
        print(table(result["titan"]))
    if "layouts" in args.parts:
        result.update(layouts(args.steps))
    if "grouped" in args.parts:
        result["grouped_gemm"] = r = grouped_vs_loop()
        print(f"grouped GEMM {r['grouped_s']*1e3:.1f} ms vs per-expert loop {r['loop_s']*1e3:.1f} ms -> "
              f"{r['speedup']:.2f}x faster")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
