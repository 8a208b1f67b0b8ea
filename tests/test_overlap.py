"""Communication hidden behind compute (partition/passes/overlap.py, the MoE layer's shared experts).

Program order: in the lowered fsdp2 step of llama_tiny each layer's all-gathers are issued
before the previous layer's compute (forward and backward), within the memory bound; the MoE
layer hands its shared experts to the expert-parallel region, which issues the dispatch before
they run. Results: bitwise (fp32) those of the unscheduled program on 2 gloo ranks.
"""

import os

import pytest
import torch
from fixtures import shared_experts_outside_exchange
from test_remat import run_config

from shardfn.config import load_config
from shardfn.core.pytree import tree_leaves
from shardfn.partition.passes import overlap as ov

FSDP = ["train.batch_size=8", "train.seq_len=32", "mesh.fsdp=2", "model.n_layers=4"]
PLAIN = ["partition.overlap=false"]  # the unscheduled program (the pass is on by default under fsdp)
ON = ["partition.overlap=true"]


def _lowered(config, overrides):
    from shardfn.plan.profile import lower_step

    return lower_step(load_config(config, overrides)).graph_module


def _gathers_by_layer(gm):
    """``{(phase, layer): (last issue, first use)}`` of the stacked weights' all-gathers: phase 0
    is a weight's first gather (forward), 1 its second (the backward's re-gather)."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen: dict = {}
    out: dict = {}
    for node in gm.graph.nodes:
        if not ov.is_collective(node) or "all_gather" not in node.target._opname:
            continue
        tag = ov.layer_of(node.args[0])
        if tag is None:
            continue
        phase = seen.setdefault(node.args[0], 0)
        seen[node.args[0]] += 1
        (wait,) = node.users
        use = min(pos[u] for u in wait.users)
        issue, first = out.get((phase, tag[1]), (-1, len(pos)))
        out[(phase, tag[1])] = (max(issue, pos[node]), min(first, use))
    return out


def _prefetched(gm, n_layers):
    """Whether each layer's gathers are all issued before the previous layer's first use of its
    own gathered weights: layer i before layer i-1 forward, layer i before layer i+1 backward."""
    g = _gathers_by_layer(gm)
    forward = all(g[(0, i)][0] < g[(0, i - 1)][1] for i in range(1, n_layers))
    backward = all(g[(1, i)][0] < g[(1, i + 1)][1] for i in range(n_layers - 1))
    return forward, backward


def test_the_pass_is_on_by_default_where_parameters_are_stored_sharded():
    from shardfn.runtime.partitioned import overlaps

    assert overlaps(load_config("llama_tiny", ["mesh.fsdp=2"]))
    assert overlaps(load_config("llama_tiny", ["mesh.fsdp=2", "mesh.tp=2"]))
    assert not overlaps(load_config("llama_tiny", ["mesh.dp=2"]))
    assert not overlaps(load_config("llama_tiny", ["mesh.ep=2"]))
    assert not overlaps(load_config("llama_tiny", ["mesh.fsdp=2", *PLAIN]))
    assert overlaps(load_config("llama_tiny", ["mesh.dp=2", *ON]))


def test_gloo_groups_run_collectives_on_one_worker_thread(clean_process_group):
    # several collectives in flight at once on gloo's default two worker threads corrupted the
    # heap (an fsdp2 rank died in malloc in about half the runs); the launchers ask for one
    # (tests/test_remat.py checks the ranks spawn starts)
    import torch.distributed as dist

    from shardfn.core._torch_private import one_gloo_worker_thread

    one_gloo_worker_thread()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cpu = torch.device("cpu")
    for group in (dist.group.WORLD, dist.new_group([0])):  # the default group and a mesh's subgroup
        assert group._get_backend(cpu).options._threads == 1
    works = [dist.all_reduce(torch.full((4,), float(i)), async_op=True) for i in range(3)]
    assert all(w.wait() for w in works)


@pytest.fixture
def two_thread_gloo(monkeypatch, clean_process_group):
    """A default gloo group made the way a user's own ``init_process_group("gloo")`` makes it
    before any shardfn code runs: with gloo's two worker threads."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from shardfn.core._torch_private import gloo_worker_threads, one_gloo_worker_thread

    one_gloo_worker_thread()  # c10d's class is ours now (another test may have done it first)
    monkeypatch.setattr(c10d, "ProcessGroupGloo", c10d.ProcessGroupGloo.__mro__[1])  # gloo's own
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.undo()
    assert gloo_worker_threads(dist.group.WORLD) == 2
    return dist.group.WORLD


def _all_reduced(group):
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(lambda x: funcol.all_reduce(x * 2, "sum", group) + 1)(torch.ones(4))


def test_the_pass_refuses_a_program_on_a_gloo_group_with_two_worker_threads(two_thread_gloo):
    import torch.distributed as dist

    gm = _all_reduced(two_thread_gloo)
    name = two_thread_gloo.group_name
    with pytest.raises(RuntimeError, match=rf"overlap: all_reduce \(.*\) runs on gloo process group '{name}', "
                                           r"which has 2 worker threads; .*partition\.overlap=false"):
        ov.overlap(gm)
    one = dist.new_group([0])  # made after shardfn's call: one thread, so the pass schedules it
    gm = ov.overlap(_all_reduced(one))
    assert torch.equal(gm(torch.ones(4)), torch.full((4,), 3.0))


def test_a_mesh_over_a_users_two_thread_group_runs_on_a_one_thread_group_of_its_own(two_thread_gloo):
    import warnings

    from shardfn.core._torch_private import gloo_worker_threads
    from shardfn.partition.mesh import Mesh
    from shardfn.runtime.partitioned import overlaps

    mesh = Mesh({"fsdp": 1})  # over the user's world, on a group of its own
    assert gloo_worker_threads(two_thread_gloo) == 2
    assert mesh.device_mesh.get_group("fsdp") is not two_thread_gloo
    assert mesh.gloo_worker_threads() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert overlaps(load_config("llama_tiny", ["mesh.fsdp=2"]), mesh)


def _torchrun_way_worker(overrides):
    # what a torchrun script does before any shardfn code: its own default gloo group, made by
    # gloo's own class (two worker threads), from the launcher's environment
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from shardfn.core._torch_private import gloo_worker_threads
    from shardfn.partition.mesh import Mesh
    from shardfn.runtime.launch import free_port
    from shardfn.runtime.partitioned import full, mesh_from_config, overlaps

    # a port of its own: the launcher's store closes with its group, and a new store bound to the
    # same port at once can meet the old one's closing connections
    port = torch.tensor([free_port() if dist.get_rank() == 0 else 0])
    dist.all_reduce(port)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(int(port))
    ours = c10d.ProcessGroupGloo
    c10d.ProcessGroupGloo = ours.__mro__[1]
    try:
        dist.init_process_group("gloo")
    finally:
        c10d.ProcessGroupGloo = ours
    user_threads = gloo_worker_threads(dist.group.WORLD)
    mesh = Mesh({"fsdp": 2})
    on = overlaps(load_config("llama_tiny", FSDP), mesh_from_config(load_config("llama_tiny", FSDP)))
    out = {"user": user_threads, "mesh": mesh.gloo_worker_threads(), "overlaps": on, "runs": []}
    for extra in ([], PLAIN):
        params, _, metrics = run_config("llama_tiny", [*FSDP, *extra, *overrides], steps=2)
        out["runs"].append({"params": full(params), "losses": torch.stack([m["loss"] for m in metrics])})
    return out


def test_sf_mesh_over_a_group_made_the_torchrun_way_keeps_the_overlap_pass():
    from shardfn.runtime.launch import spawn

    out = spawn(_torchrun_way_worker, 2, args=([],), timeout_s=600)
    for rank in out:
        assert (rank["user"], rank["mesh"], rank["overlaps"]) == (2, 1, True)
        overlapped, plain = rank["runs"]
        assert torch.equal(overlapped["losses"], plain["losses"])
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(overlapped["params"]), tree_leaves(plain["params"])))


def test_fsdp2_gathers_are_issued_one_layer_ahead(clean_process_group):
    plain = _lowered("llama_tiny", FSDP + PLAIN)
    assert _prefetched(plain, 4) == (False, False)  # issued where used, waited on at once
    gm = _lowered("llama_tiny", FSDP)
    assert _prefetched(gm, 4) == (True, True)
    # every collective is still waited on, before its first use, in the same order on every rank
    plain_order = [n.target for n in plain.graph.nodes if ov.is_collective(n)]
    assert [n.target for n in gm.graph.nodes if ov.is_collective(n)] == plain_order
    assert all(w > i for _, i, w in ov.issue_order(gm))
    # one layer of llama_tiny, gathered: wq wo [64, 64], wk wv [64, 32], w1 w3 w2 [64, 256] (fp32;
    # the norms are replicated)
    dim, ffn, kv = 64, 256, 32
    assert ov.layer_bytes(gm) == 4 * (dim * dim * 2 + dim * kv * 2 + dim * ffn * 3) == 245760
    assert ov.default_max_bytes(gm) == 2 * ov.layer_bytes(gm)


def _early_bytes_peak(plain, gm):
    """The most bytes of all-gather outputs issued ahead of where ``plain`` issues them, at once:
    counted in compute nodes (non-views) run before each issue, which reordering keeps apart."""
    def compute_before(g):
        out, count = {}, 0
        for n in g.graph.nodes:
            if ov.is_collective(n):
                out[n.name] = count
            elif n.op == "call_function" and not ov.is_wait(n) and not ov._is_view(n):
                count += 1
        return out, count

    before, total = compute_before(plain)
    after, _ = compute_before(gm)
    cost = {n.name: ov.early_cost(n) for n in gm.graph.nodes if ov.is_collective(n)}
    held = [0] * (total + 1)
    for name, at in after.items():
        for p in range(at, before[name]):
            held[p] += cost[name]
    return max(held)


@pytest.mark.parametrize("layers", [0, 1])
def test_memory_bound_holds(layers, clean_process_group):
    plain = _lowered("llama_tiny", FSDP + PLAIN)
    one_layer = ov.layer_bytes(plain)
    gm = ov.overlap(_lowered("llama_tiny", FSDP + PLAIN), max_bytes=layers * one_layer)
    peak = _early_bytes_peak(plain, gm)
    assert peak <= layers * one_layer
    assert (peak > 0) == (layers > 0)  # 0: no gather moves ahead of its compute
    with pytest.raises(ValueError, match="max_bytes=-1 must be >= 0"):
        ov.overlap(gm, max_bytes=-1)


def test_moe_layer_hands_its_shared_experts_to_the_exchange(clean_process_group):
    from shardfn.plan.profile import lower_step

    lowered = lower_step(load_config("moe_tiny", ["train.batch_size=8", "train.seq_len=32", "mesh.ep=2"]))
    gm = lowered.graph_module
    ep = [n for n in gm.graph.nodes if n.op == "call_function" and "ep_experts" in str(n.target)]
    forward = [n for n in ep if "backward" not in str(n.target)]
    assert len(forward) == 2  # moe_tiny's two MoE layers
    assert all(all(a is not None for a in n.args[6:9]) for n in ep)  # s1, s2, s3 go in

    def matmuls_reading(node, seen):  # shared weights never meet an aten matmul outside the region
        if node in seen:
            return 0
        seen.add(node)
        if node.op == "call_function" and getattr(node.target, "_overloadpacket", None) in (
                torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.matmul):
            return 1
        if node.op == "call_function" and "ep_experts" in str(node.target):
            return 0
        return sum(matmuls_reading(u, seen) for u in node.users)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    paths = dict(zip(placeholders, lowered.traced.in_paths))
    shared = {n: p for n, p in paths.items() if p.startswith("0.moe_layers.shared.")}  # params, not opt state
    assert sorted(shared.values()) == ["0.moe_layers.shared.w1", "0.moe_layers.shared.w2", "0.moe_layers.shared.w3"]
    assert sum(matmuls_reading(n, set()) for n in shared) == 0


# ----------------------------------------------------------------------------- 2 gloo ranks


class _RecordedWait:
    def __init__(self, work, events):
        self.work, self.events = work, events

    def wait(self):
        self.events.append("arrived")
        return self.work.wait()


def _order_of_exchange_and_shared():
    """Records the order of the exchange's all-to-alls (issued, waited on) and the shared
    experts' SwiGLU."""
    from shardfn.runtime import moe_dispatch

    events, a2a, swiglu = [], moe_dispatch._a2a, moe_dispatch._swiglu

    def recorded_a2a(*args, async_op=False, **kwargs):
        events.append("issued")
        out = a2a(*args, async_op=async_op, **kwargs)
        if not async_op:
            events.append("arrived")
            return out
        return out[0], _RecordedWait(out[1], events)

    swiglu_backward = moe_dispatch._swiglu_backward

    def recorded_swiglu(*args):
        events.append("shared")
        return swiglu(*args)

    def recorded_swiglu_backward(*args):
        events.append("shared")
        return swiglu_backward(*args)

    moe_dispatch._a2a, moe_dispatch._swiglu = recorded_a2a, recorded_swiglu
    moe_dispatch._swiglu_backward = recorded_swiglu_backward
    return events


def _worker(runs):
    out = []
    for config, overrides, old_order in runs:
        undo = shared_experts_outside_exchange() if old_order else (lambda: None)
        events = _order_of_exchange_and_shared() if "mesh.ep=2" in overrides and not old_order else []
        try:
            params, _, metrics = run_config(config, overrides)
        finally:
            undo()
        out.append({"params": params, "losses": torch.stack([m["loss"] for m in metrics]), "events": events})
    return out


@pytest.mark.slow  # about 45 s: four 3-step runs on 2 gloo ranks
def test_overlapped_programs_are_bitwise_the_plain_ones():
    from shardfn.runtime.launch import spawn

    # pairs (before, after): fsdp2 without and with the pass; ep2 with the shared experts after
    # the routed ones and no pass, against the shared experts in the exchange and the pass
    runs = [("llama_tiny", ["mesh.fsdp=2", *PLAIN], False), ("llama_tiny", ["mesh.fsdp=2"], False),
            ("moe_tiny", ["mesh.ep=2", *PLAIN], True), ("moe_tiny", ["mesh.ep=2", *ON], False)]
    out = spawn(_worker, 2, args=(runs,), timeout_s=600)
    for rank in out:
        for ref, got in zip(rank[::2], rank[1::2]):
            assert torch.equal(got["losses"], ref["losses"])
            assert all(torch.equal(a, b) for a, b in zip(tree_leaves(got["params"]), tree_leaves(ref["params"])))
        # each MoE layer, forward and backward: the dispatch (or the output cotangents) issued, the
        # shared experts (or their vjp) while it flies, then its arrival, the routed experts, the
        # combine issued and arrived (3 steps, 2 layers, one chunk)
        step = ["issued", "shared", "arrived", "issued", "arrived"] * 4
        assert rank[3]["events"] == step * 3, rank[3]["events"]
