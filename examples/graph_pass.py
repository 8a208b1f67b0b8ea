"""Graph passes of your own, plugged into ``sf.jit`` after trace, propagate or lower.

A pass is a function ``GraphModule -> GraphModule`` (``docs/passes.md``). Here, on a simulated
2 x 2 mesh (one process, nothing runs):

- after trace, a look at the global graph (forward, backward and update as one program);
- after propagate, a rewrite that reads each node's placements and simplifies powers: ``x ** 2``
  (the loss) becomes ``x * x`` and ``x ** 1`` (in its backward) ``x``: the same values;
- after lower, a count of each rank's FLOPs and collectives in the per-rank program.

Activation checkpointing is a pass of the same kind: ``sf.remat_pass("selective")`` after trace.

    python examples/graph_pass.py
"""

import torch

import shardfn as sf
from shardfn import P
from shardfn.partition.cost.flops import node_flops

aten = torch.ops.aten


def loss_fn(params, x):
    h = torch.relu(x @ params["w1"])  # [B, 256], split over dp and tp
    return (h @ params["w2"]).pow(2).mean()


def train_step(params, x):
    loss, grads = sf.value_and_grad(loss_fn)(params, x)
    return {k: params[k] - 1e-2 * grads[k] for k in params}, loss


counts = {}


def look(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """After trace: global shapes; placeholders carry their pytree path in ``meta["sf_path"]``."""
    counts["global_nodes"] = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    counts["inputs"] = [n.meta.get("sf_path") for n in gm.graph.nodes if n.op == "placeholder"]
    return gm


seen = []


def simplify_powers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """After propagate: each node carries ``meta["sf_placements"]``; rewrite in place (the
    partitioner propagates and lowers the rewritten graph again)."""
    for node in list(gm.graph.nodes):
        if node.target is not aten.pow.Tensor_Scalar or node.args[1] not in (1, 2):
            continue
        seen.append((node.name, node.args[1], node.meta["sf_placements"]))
        if node.args[1] == 2:
            node.target, node.args = aten.mul.Tensor, (node.args[0], node.args[0])
        else:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def count_work(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """After lower: the per-rank program, local shapes and functional collectives."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    counts["gflop"] = sum(node_flops(n) for n in ops) / 1e9
    counts["collectives"] = sum(1 for n in ops if "_c10d_functional" in str(n.target) and "wait" not in str(n.target))
    return gm  # unchanged


def main() -> dict:
    mesh = sf.Mesh({"dp": 2, "tp": 2}, fake=True)  # a simulated mesh: plan only
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(64, 256, generator=g), "w2": torch.randn(256, 64, generator=g)}
    x = torch.randn(32, 64, generator=g)
    specs = {"w1": P(None, "tp"), "w2": P("tp", None)}  # Megatron column / row
    step = sf.jit(train_step, mesh, in_specs=(specs, P("dp")), out_specs=(specs, P()), backend=None,
                  passes={"after_trace": [look],
                          "after_propagate": [simplify_powers],
                          "after_lower": [count_work]})
    lowered = step.lower(params, x)
    text = lowered.as_text()
    print(f"global graph: {counts['global_nodes']} ops over inputs {counts['inputs']}")
    print("rewritten (node, exponent, placements per mesh dim):", seen)
    print(f"per rank: {counts['gflop']:.4f} GFLOP, {counts['collectives']} collectives")
    print("pow left in the per-rank program:", "aten.pow" in text)
    print(lowered.comm_report())
    return {"seen": seen, "counts": counts, "text": text, "comm": lowered.comm_report()}


if __name__ == "__main__":
    main()
