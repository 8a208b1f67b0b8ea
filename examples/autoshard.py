"""Auto-sharding: let an ILP choose every input's spec under a memory budget, and compare it with
layouts written by hand.

``sf.AUTO`` in ``in_specs`` asks the partitioner to choose: torch's DTensor op strategies list
what each op can do, a cost model prices each choice on a hardware profile, and an integer
program picks the cheapest plan whose memory per rank fits the budget (``docs/autoshard.md``).
All of it on a simulated 2 x 4 mesh in one process: nothing runs.

    python examples/autoshard.py
"""

import torch

import shardfn as sf
from shardfn import P
from shardfn.core.units import format_bytes
from shardfn.partition import auto
from shardfn.partition.spmd.trace import trace

DIM, HIDDEN, BATCH = 1024, 4096, 64


def loss_fn(params, batch):
    h = torch.relu(batch["x"] @ params["w1"])  # [B, HIDDEN]
    return ((h @ params["w2"] - batch["y"]) ** 2).mean()  # [B, DIM]


opt = sf.optim.adamw(1e-3)


def train_step(params, opt_state, batch):
    loss, grads = sf.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return sf.optim.apply_updates(params, updates), opt_state, loss


def hand_layouts(opt_state) -> dict:
    """Textbook in_specs for the mesh {"dp": 2, "tp": 4}: data parallel, Megatron, both."""
    def specs(param_specs, batch_spec):
        return (param_specs, sf.specs_like(opt_state, param_specs), {"x": batch_spec, "y": batch_spec})

    replicated = {"w1": P(), "w2": P()}
    megatron = {"w1": P(None, "tp"), "w2": P("tp", None)}
    return {"dp": specs(replicated, P(("dp", "tp"))),  # batch over all 8 ranks
            "tp": specs(megatron, P()),
            "dp_tp": specs(megatron, P("dp"))}


def main(memory_budget: float = 48 * 2**20) -> dict:
    mesh = sf.Mesh({"dp": 2, "tp": 4}, fake=True)  # a simulated mesh: plan only
    params = {"w1": torch.zeros(DIM, HIDDEN), "w2": torch.zeros(HIDDEN, DIM)}  # only shapes are read
    batch = {"x": torch.zeros(BATCH, DIM), "y": torch.zeros(BATCH, DIM)}
    opt_state = opt.init(params)
    args = (params, opt_state, batch)
    names = ("params", "opt_state", "batch")

    traced = trace(train_step, args)  # the global graph: forward, backward and update
    result = auto.solve(traced, mesh, hardware="h100", memory_budget=memory_budget, arg_names=names)
    print(result.summary())  # the chosen specs, estimated step time and memory per rank
    print(f"\nunder a budget of {format_bytes(memory_budget)} per rank:")
    print(result.comparison_table(hand_layouts(opt_state)))  # the plan against hand layouts, same model

    # The same in one call: in_specs=sf.AUTO plans on the first lowering.
    step = sf.jit(train_step, mesh, in_specs=sf.AUTO, arg_names=names, memory_budget=memory_budget, backend=None)
    lowered = step.lower(*args)
    print("\nsf.jit(in_specs=sf.AUTO):", lowered.comm_report())
    return {"result": result, "rows": result.compare(hand_layouts(opt_state)), "lowered": lowered}


if __name__ == "__main__":
    main()
