"""A function of your own, partitioned three ways: data parallel, Megatron tensor parallel, ZeRO-3.

The train step below is plain PyTorch over a dict of tensors, with no parallelism code. For each
layout only the specs change: ``P`` says which mesh axis splits which dim of each tensor, and
``sf.jit`` traces the step, propagates placements, inserts the collectives they imply and runs
one program per rank.

    python examples/jit_layouts.py                        # spawns 4 local gloo ranks
    torchrun --nproc-per-node 4 examples/jit_layouts.py   # or one process per rank under torchrun
"""

import os

import torch

import shardfn as sf
from shardfn import P

WORLD = 4


def loss_fn(params, batch):  # a residual MLP
    h = torch.relu(batch["x"] @ params["w1"])  # [B, 256]
    y = batch["x"] + h @ params["w2"]  # [B, 64]
    return ((y - batch["y"]) ** 2).mean()


opt = sf.optim.adamw(1e-3)


def train_step(params, opt_state, batch):
    loss, grads = sf.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return sf.optim.apply_updates(params, updates), opt_state, {"loss": loss}


# One layout per mesh: (mesh axes, parameter specs, arguments stored sharded over fsdp)
LAYOUTS = {
    "dp": ({"dp": WORLD}, {"w1": P(), "w2": P()}, ()),  # replicated weights, split batch
    "tp": ({"tp": WORLD}, {"w1": P(None, "tp"), "w2": P("tp", None)}, ()),  # Megatron column / row
    "fsdp": ({"fsdp": WORLD}, {"w1": P("fsdp"), "w2": P("fsdp")}, (0,)),  # ZeRO-3: gathered on use
}


def main() -> float:
    """Lower and print each layout's collectives; run fsdp for 3 steps; return the last loss."""
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(64, 256, generator=g) * 0.05, "w2": torch.randn(256, 64, generator=g) * 0.05}
    opt_state = opt.init(params)
    batch = {"x": torch.randn(32, 64, generator=g), "y": torch.randn(32, 64, generator=g)}
    show = int(os.environ.get("RANK", "0")) == 0

    for name, (axes, param_specs, fsdp_argnums) in LAYOUTS.items():
        mesh = sf.Mesh(axes)  # real gloo / NCCL ranks; sf.Mesh(axes, fake=True) only plans
        opt_specs = sf.specs_like(opt_state, param_specs)  # Adam's mu and nu as the params, count P()
        batch_spec = P(next(iter(axes))) if name != "tp" else P()  # the batch split over dp / fsdp
        step = sf.jit(train_step, mesh,
                      in_specs=(param_specs, opt_specs, batch_spec),  # pytrees of P, a prefix of the args
                      out_specs=(param_specs, opt_specs, P()),
                      fsdp_argnums=fsdp_argnums,  # stored sharded over "fsdp", gathered on use
                      arg_names=("params", "opt_state", "batch"),  # names in the reports
                      bucket_bytes=25 * 2**20,  # gradient reductions coalesced, as DDP's buckets
                      backend=None)  # run the per-rank program as is ("inductor": compiled)
        lowered = step.lower(params, opt_state, batch)  # trace + propagate + collectives, no compile
        if show:
            print(name, lowered.comm_report())  # [{op, axis, bytes, count}] per step per rank
    if show:
        print(lowered.memory_report())  # fsdp's bytes per rank: params, opt_state, grads, ...
    p, s = params, opt_state
    for _ in range(3):
        p, s, metrics = step(p, s, batch)  # fsdp: DTensors out, fed back in
    loss = float(metrics["loss"].full_tensor())
    if show:
        print(f"loss after 3 fsdp steps: {loss:.4f}")
    return loss


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        from shardfn.runtime.launch import spawn

        spawn(main, WORLD)
