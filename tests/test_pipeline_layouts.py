"""Pipeline stages partitioned over the other axes: pp with fsdp, tp, dp x fsdp (HSDP), ep, cp.

Real gloo ranks train for 3 steps and every rank reports the one-device losses, gradient norms,
first-step gradients and final parameters (fp32, rtol 1e-5); the planner's per-rank bytes and
collectives equal the run's reports. One spawn runs every 4-rank llama_tiny layout in turn; the
8-rank layouts are slow (8 processes on 2 cores).
"""

import pytest
from parity import BASE, assert_matches, reference, run_pipelines

from shardfn import plan as pl
from shardfn.config import load_config, resolve_path

LLAMA = str(resolve_path("llama_tiny"))
MOE = str(resolve_path("moe_tiny"))
FOUR = ["model.n_layers=4"]          # dualpipev on pp2 runs 4 stages of whole layers
TIED = ["model.tie_embeddings=true"]

# (config, overrides): every llama_tiny layout of the default run, on 4 ranks, in one spawn
LLAMA_RUNS = [
    (LLAMA, ["mesh.pp=2", "mesh.fsdp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"]),
    (LLAMA, ["mesh.pp=2", "mesh.fsdp=2", "pipeline.schedule=zbh1", "pipeline.microbatches=2",
             "partition.reshard_after_forward=true"]),
    (LLAMA, ["mesh.pp=2", "mesh.tp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"]),
    (LLAMA, [*FOUR, *TIED, "mesh.pp=2", "mesh.fsdp=2", "pipeline.schedule=dualpipev", "pipeline.microbatches=4"]),
    (LLAMA, [*TIED, "mesh.pp=2", "mesh.fsdp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"]),
    (LLAMA, ["mesh.pp=2", "mesh.cp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"]),
]


def _model_overrides(overrides):
    return [o for o in overrides if o.startswith("model.")]


@pytest.fixture(scope="module")
def llama_runs():
    return run_pipelines(LLAMA_RUNS, 4)


def _check(run, config, overrides):
    assert_matches(run, reference(config, _model_overrides(overrides)))


@pytest.mark.parametrize("index", range(len(LLAMA_RUNS)),
                         ids=["pp2xfsdp2-1f1b", "pp2xfsdp2-zbh1-reshard", "pp2xtp2", "tied-dualpipev", "tied-1f1b",
                              "pp2xcp2"])
def test_llama_tiny_layouts_match_one_device(llama_runs, index):
    _check(llama_runs[index], *LLAMA_RUNS[index])


def test_each_rank_builds_only_the_blocks_it_holds(llama_runs):
    for run, (_, overrides) in zip(llama_runs, LLAMA_RUNS):
        whole = "mesh.cp=2" in overrides  # cp replicates a stage's parameters: about half the model per rank
        for rank in run:  # a box per held leaf (tied leaves once per holding stage), nothing else
            assert rank["built"] == rank["held"] < (0.6 if whole else 0.5) * rank["total"], rank["pp_rank"]
    for rank in llama_runs[0]:  # pp2 x fsdp2: about a quarter of the model per rank
        assert rank["held"] < 0.3 * rank["total"]


def _rows(rank, op, axis):
    return next((r for r in rank["comm"] if r["op"] == op and r["axis"] == axis), {"bytes": 0, "count": 0})


def test_fsdp_in_a_pipeline_gathers_once_per_step_or_per_microbatch(llama_runs):
    once, regather = llama_runs[0], llama_runs[1]
    for a, b in zip(once, regather):
        gathered, again = _rows(a, "all_gather", "fsdp"), _rows(b, "all_gather", "fsdp")
        leaves = _rows(a, "reduce_scatter", "fsdp")["count"]  # one reduce-scatter per sharded leaf, per step
        assert leaves > 0 and gathered["count"] == leaves      # and one gather each, for both microbatches
        assert _rows(b, "reduce_scatter", "fsdp") == _rows(a, "reduce_scatter", "fsdp")
        # re-gathered in every microbatch's F and again for its input gradient (stage 0 has none)
        assert again["bytes"] >= 2 * gathered["bytes"] and again["count"] >= 2 * leaves
        assert a["memory"]["gathered"] > 0 and b["memory"]["gathered"] == 0
        assert a["memory"]["grads"] == b["memory"]["grads"] > a["memory"]["params"]  # sums unsharded over fsdp


def test_tp_in_a_pipeline_is_megatron(llama_runs):
    for rank in llama_runs[2]:
        ops = {(r["op"], r["axis"]) for r in rank["comm"]}
        assert ("all_reduce", "tp") in ops and not any(axis == "fsdp" for _, axis in ops)
        assert not any(op == "all_gather" and axis == "tp" for op, axis in ops) or rank["pp_rank"] == 1  # logits


def test_tied_embedding_gradients_are_summed_over_its_two_stages(llama_runs):
    dualpipev, one_f_one_b = llama_runs[3], llama_runs[4]
    assert [r["stages"] for r in dualpipev] == [(0, 3)] * 2 + [(1, 2)] * 2   # both holders on pp rank 0
    assert [r["stages"] for r in one_f_one_b] == [(0,)] * 2 + [(1,)] * 2     # one holder on each pp rank
    embed = 256 * 64 * 4 // 2                                         # [vocab, dim] fp32 over fsdp
    for rank in one_f_one_b:
        assert _rows(rank, "all_reduce", "pp")["bytes"] >= embed
    for rank in dualpipev:  # summed on the rank that holds both stages: no collective for it
        assert _rows(rank, "all_reduce", "pp")["bytes"] < embed


def test_the_plan_of_a_pipeline_is_its_run(llama_runs):
    _check_plan(llama_runs[0], LLAMA_RUNS[0])
    _check_plan(llama_runs[2], LLAMA_RUNS[2])


def _check_plan(run, config_overrides):
    config, overrides = config_overrides
    plan = pl.make_plan(load_config(config, BASE + list(overrides)))
    for rank in run:
        planned = plan.ranks[rank["pp_rank"]]
        memory = rank["memory"]
        assert (planned["params_bytes"], planned["grads_bytes"], planned["opt_state_bytes"]) == \
            (memory["params"], memory["grads"], memory["opt_state"])
        assert planned["gathered_bytes"] == memory["gathered"]
        static = sorted((r["op"], r["axis"], r["bytes"], r["count"]) for r in rank["comm"] if "layer" not in r)
        rows = sorted((r["op"], r["axis"], r["bytes"], r["count"])
                      for r in planned["comm"] if r["source"] != "estimate")
        assert rows == static
        exchanges = [r for r in rank["comm"] if "layer" in r]
        estimate = [r for r in planned["comm"] if r["op"] == "all_to_all"]
        assert sum(r["count"] for r in exchanges) == sum(r["count"] for r in estimate)
        if exchanges:
            assert 0.5 < sum(r["bytes"] for r in exchanges) / sum(r["bytes"] for r in estimate) < 1.5
    assert "planned only" not in " ".join(plan.notes)


# ------------------------------------------------------------------ 8 ranks


MOE_RUNS = [
    (MOE, ["mesh.pp=2", "mesh.fsdp=2", "mesh.ep=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"]),
    (MOE, ["mesh.pp=2", "mesh.fsdp=2", "mesh.ep=2", "pipeline.schedule=zbh1", "pipeline.microbatches=2"]),
    (MOE, ["mesh.pp=2", "mesh.ep=2", "mesh.tp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"]),
    (LLAMA, ["mesh.pp=2", "mesh.dp=2", "mesh.fsdp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"]),
    # DualPipeV's pairs taking turns at their exchanges while tp's collectives run inside each member
    (MOE, [*FOUR, "mesh.pp=2", "mesh.ep=2", "mesh.tp=2", "pipeline.schedule=dualpipev", "pipeline.microbatches=4",
           "pipeline.overlap_pairs=true"]),
]


@pytest.fixture(scope="module")
def eight_rank_runs():
    return run_pipelines(MOE_RUNS, 8)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(MOE_RUNS)),
                         ids=["moe-pp2xfsdp2xep2-1f1b", "moe-pp2xfsdp2xep2-zbh1", "moe-pp2xep2xtp2", "llama-pp2xhsdp",
                              "moe-pp2xep2xtp2-dualpipev-turns"])
def test_eight_rank_layouts_match_one_device(eight_rank_runs, index):
    _check(eight_rank_runs[index], *MOE_RUNS[index])


@pytest.mark.slow
def test_dualpipev_pairs_took_turns_at_their_exchanges_with_tp_inside(eight_rank_runs):
    """The last run's pairs handed the turn over at their all-to-all waits, as many times on every rank
    of a pipeline rank (its ep and tp peers run the same pairs)."""
    handoffs = {(r["pp_rank"], r["handoffs"]) for r in eight_rank_runs[4]}
    assert len(handoffs) == 2 and all(n > 0 for _, n in handoffs)
    assert all(r["handoffs"] == 0 for run in eight_rank_runs[:4] for r in run)


@pytest.mark.slow
def test_the_plan_of_moe_on_pp2_fsdp2_ep2_is_its_run(eight_rank_runs):
    _check_plan(eight_rank_runs[0], MOE_RUNS[0])


@pytest.mark.slow
def test_hsdp_in_a_pipeline_reduce_scatters_over_fsdp_and_all_reduces_over_dp(eight_rank_runs):
    for rank in eight_rank_runs[3]:
        scatter, reduce = _rows(rank, "reduce_scatter", "fsdp"), _rows(rank, "all_reduce", "dp")
        assert scatter["count"] > 0 and reduce["bytes"] >= scatter["bytes"] // 2  # the fsdp shards, over dp
