"""Context parallelism (``mesh.cp``): the sequence split over ranks, load-balanced, attention with
K/V gathered per layer; and tp's sequence parallelism (``partition.sequence_parallel``). Parity
with one device (fp32, rtol 1e-5) on real gloo ranks, the exact exchange bytes, activation bytes
per rank, and the layouts' errors."""

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

import shardfn as sf
from shardfn import P, models
from shardfn.config import load_config
from shardfn.core.positional_attention import positional_attention
from shardfn.partition.errors import LayoutError
from shardfn.partition.layouts.axes import batch_spec, check_run, check_sequence_parallel, resolve_rules
from shardfn.partition.spmd.context_rules import balanced_batch, exchange_bytes_per_layer, load_balance_order
from shardfn.runtime.partitioned import expert_region, full, mesh_from_config, mesh_step
from tests.parity import BASE, _grad_fn, assert_matches, reference, setup


def context_worker(overrides, config=None):
    """A config's mesh step for ``STEPS`` steps on these ranks (the batch load-balanced by the
    step), and the first batch's gradients from the same layout."""
    cfg, model, params, opt, batches = setup(overrides, config)
    state = opt.init(params)
    mesh = mesh_from_config(cfg)
    step = mesh_step(cfg, model, opt, params, mesh, backend=None)
    specs = step.specs
    grad_of = _grad_fn(model, cfg, expert_region(model, cfg.model, mesh, specs))
    grad_step = lambda p, b: (lambda lg: (lg[0], sf.constrain(lg[1], specs["params"])))(grad_of(p, b))  # noqa: E731
    grad_fn = sf.jit(grad_step, mesh, in_specs=(specs["params"], specs["batch"]), out_specs=(P(), specs["params"]),
                     fsdp_argnums=(0,) if cfg.mesh.fsdp > 1 else (), backend=None,
                     sequence_parallel=("tp",) if cfg.partition.sequence_parallel else ())
    _, grads0 = grad_fn(params, balanced_batch(batches[0], cfg.mesh.cp))
    losses = []
    for b in batches:
        params, state, metrics = step(params, state, b)
        losses.append(metrics["loss"])
    return {"losses": torch.stack(losses), "grads": full(grads0), "params": full(params),
            "comm": step.comm_report(), "collectives": step.jitted.lower(
                params, state, balanced_batch(batches[-1], cfg.mesh.cp)).collectives(),
            "memory": step.memory_report()}


_RUNS: dict = {}


def run_context(overrides, nproc, config):
    from shardfn.runtime.launch import spawn

    key = (tuple(overrides), nproc, config)
    if key not in _RUNS:
        _RUNS[key] = spawn(context_worker, nproc, args=(list(overrides), config), timeout_s=600)
    return _RUNS[key]


# ----------------------------------------------------------------------------- pieces on one device


def test_load_balance_order_gives_rank_i_chunks_i_and_mirror():
    assert load_balance_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert load_balance_order(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"train.seq_len: 10 is not divisible by 2 \* mesh.cp = 4"):
        load_balance_order(10, 2)


def test_balanced_batch_permutes_inputs_and_targets_and_adds_positions():
    x = torch.arange(16).view(2, 8)
    out = balanced_batch({"inputs": x, "targets": x + 100}, 2)
    order = [0, 1, 6, 7, 2, 3, 4, 5]
    assert out["inputs"][1].tolist() == [8 + i for i in order]
    assert out["targets"][0].tolist() == [100 + i for i in order]
    assert out["positions"].tolist() == [order, order]


def test_positional_attention_in_any_order_is_causal_attention_reordered():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 6, generator=g), torch.randn(2, 2, 8, 6, generator=g), torch.randn(2, 2, 8, 6,
                                                                                                        generator=g)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True)
    order = load_balance_order(8, 2)
    pos = order.expand(2, 8)
    out = positional_attention(q[:, :, order], k[:, :, order], v[:, :, order], pos, pos)
    torch.testing.assert_close(out, ref[:, :, order], rtol=1e-6, atol=1e-6)


def test_positional_attention_gradients_are_the_reference_formulas_under_autograd_and_torch_func():
    from shardfn.core.positional_attention import positional_attention_reference

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 4, 8, 6), (2, 2, 8, 6), (2, 2, 8, 6)))
    pos = torch.randperm(8, generator=g).expand(2, 8)
    ours = lambda q, k, v: positional_attention(q, k, v, pos, pos).square().sum()  # noqa: E731
    want = torch.func.grad(lambda q, k, v: positional_attention_reference(q, k, v, pos, pos, 6 ** -0.5)
                           .square().sum(), argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for got in (torch.func.grad(ours, argnums=(0, 1, 2))(q, k, v), torch.autograd.grad(ours(*leaves), leaves)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("config", ["llama_tiny", "moe_tiny"])
def test_model_loss_with_reordered_tokens_is_the_one_device_loss(config):
    cfg, model, params, _, batches = setup([], config)
    want = model.loss(params, batches[0], cfg.model)
    got = model.loss(params, balanced_batch(batches[0], 4), cfg.model)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_batch_spec_splits_the_sequence_over_cp():
    axes = {"dp": 1, "fsdp": 2, "cp": 2, "ep": 1, "tp": 1}
    assert batch_spec(resolve_rules(None, axes), axes) == P("fsdp", "cp")


def test_bad_layouts_name_the_key():
    with pytest.raises(LayoutError, match=r"train.seq_len: 30 is not divisible by 2 \* mesh.cp = 4"):
        load_config("llama_tiny", ["mesh.cp=2", "train.seq_len=30"])
    cfg = load_config("moe_tiny", ["mesh.cp=2", "model.mtp_depth=1", "train.seq_len=32"])
    with pytest.raises(LayoutError, match="mesh.cp: 2 with model.mtp_depth = 1"):
        check_run(models.get("moe"), cfg)


# ----------------------------------------------------------------------------- real ranks

LLAMA_CP2 = ["mesh.cp=2"]


def test_cp2_llama_matches_one_device():
    assert_matches(run_context(LLAMA_CP2, 2, "llama_tiny"), reference("llama_tiny"))


def test_cp2_exchange_bytes_per_layer_are_the_all_gather_textbook():
    """Per attention layer: K, V and key positions gathered in the forward and again in the
    backward, dK and dV reduce-scattered; parameter gradients all-reduced over cp as over a data
    axis. Nothing else crosses cp."""
    cfg = load_config("llama_tiny", ["train.batch_size=8", "train.seq_len=32"])
    rows, seq = cfg.train.batch_size, cfg.train.seq_len
    kv_width = cfg.model.n_kv_heads * cfg.model.head_dim
    per_layer = exchange_bytes_per_layer(rows, seq, kv_width)
    rows_by_op = {r["op"]: r for r in run_context(LLAMA_CP2, 2, "llama_tiny")[0]["comm"]}
    n = cfg.model.n_layers
    assert rows_by_op["all_gather"]["bytes"] == n * per_layer["all_gather"]
    assert rows_by_op["all_gather"]["count"] == n * 6
    assert rows_by_op["reduce_scatter"]["bytes"] == n * per_layer["reduce_scatter"]
    params = models.get("llama").param_counts(cfg.model)["total"]
    # the gradients, and the loss (its mean divides by the number of positions: no count to reduce)
    assert rows_by_op["all_reduce"]["bytes"] == params * 4 + 4
    assert set(rows_by_op) == {"all_gather", "reduce_scatter", "all_reduce"}


def test_cp2_activation_bytes_per_rank_are_half(clean_process_group):
    """memory_report's peak activation bytes per rank of the train step, cp2 against one rank
    holding the whole sequence (both lowered on fake meshes), at a sequence long enough that
    activations, not parameter-sized temporaries, make the peak: exactly half, to 1e-6."""
    cfg, model, params, opt, batches = setup(["train.seq_len=512", "train.batch_size=2"], "llama_tiny")
    batch = balanced_batch(batches[0], 2)
    peak = {}
    for name, axes in (("one", {"dp": 1}), ("cp2", {"cp": 2})):
        step = mesh_step(cfg, model, opt, params, sf.Mesh(axes, fake=True), backend=None)
        peak[name] = step.jitted.lower(params, opt.init(params), batch).memory_report()["activations"]
    assert peak["cp2"] / peak["one"] == pytest.approx(0.5, rel=1e-6)


@pytest.mark.slow
def test_cp2_fsdp2_llama_matches_one_device():
    assert_matches(run_context(["mesh.cp=2", "mesh.fsdp=2"], 4, "llama_tiny"), reference("llama_tiny"))


@pytest.mark.slow
def test_cp2_moe_mla_matches_one_device():
    assert_matches(run_context(LLAMA_CP2, 2, "moe_tiny"), reference("moe_tiny"))


@pytest.mark.slow
def test_cp2_ep2_moe_matches_one_device():
    """The routed experts' region takes each data rank's tokens whole (gathered over cp)."""
    assert_matches(run_context(["mesh.cp=2", "mesh.ep=2"], 4, "moe_tiny"), reference("moe_tiny"))


@pytest.mark.slow
def test_cp2_tp2_llama_matches_one_device():
    assert_matches(run_context(["mesh.cp=2", "mesh.tp=2"], 4, "llama_tiny"), reference("llama_tiny"))


# ----------------------------------------------------------------------------- sequence parallelism (tp)

LLAMA_SP = ["mesh.tp=2", "partition.sequence_parallel=true"]


def test_sequence_parallel_layouts_name_the_key():
    with pytest.raises(LayoutError, match=r"partition.sequence_parallel: .*needs mesh.tp > 1"):
        check_run(models.get("llama"), load_config("llama_tiny", ["partition.sequence_parallel=true"]))
    with pytest.raises(LayoutError, match=r"partition.sequence_parallel: the sequence is already split over mesh.cp"):
        check_sequence_parallel(True, 64, {"cp": 2, "tp": 2}, seq_split=2)
    with pytest.raises(LayoutError, match=r"train.seq_len: 31 is not divisible by mesh.tp = 2"):
        check_sequence_parallel(True, 31, {"tp": 2})
    with pytest.raises(ValueError, match=r"sequence_parallel: unknown mesh axis 'sp'"):
        sf.jit(lambda x: x, sf.Mesh({"tp": 2}, fake=True), sequence_parallel="sp")


def test_tp2_sequence_parallel_llama_matches_one_device():
    assert_matches(run_context(LLAMA_SP, 2, "llama_tiny"), reference("llama_tiny"))


def test_tp2_sequence_parallel_bytes_are_the_megatron_sp_textbook():
    """Megatron-SP: each attention and MLP block all-gathers its input (b*s*h) once before its
    column-parallel matmuls and reduce-scatters its row-parallel output (b*s*h), in the forward
    and again (the conjugates) in the backward; the embedding's output is reduce-scattered and
    the LM head's input gathered. No activation is all-reduced: the all-reduces left are the
    vocab-parallel loss's row statistics, the norm weights' gradients and the global grad norm."""
    cfg = load_config("llama_tiny", [*BASE, *LLAMA_SP])
    b, s, h, n = cfg.train.batch_size, cfg.train.seq_len, cfg.model.dim, cfg.model.n_layers
    bsh = b * s * h * 4
    out = run_context(LLAMA_SP, 2, "llama_tiny")[0]
    gathers = [c for c in out["collectives"] if c["op"] == "all_gather"]
    scatters = [c for c in out["collectives"] if c["op"] == "reduce_scatter"]
    reduces = [c for c in out["collectives"] if c["op"] == "all_reduce"]
    assert [c["bytes"] for c in gathers] == [bsh] * (2 * 2 * n + 1)
    embedding_grad = cfg.model.vocab_size * h * 4  # the vocab-split embedding's gradient, to its shard
    assert sorted(c["bytes"] for c in scatters) == [bsh] * (2 * 2 * n + 2) + [embedding_grad]
    assert sum(c["bytes"] for c in reduces) == 3 * b * s * 4 + (2 * n + 1) * h * 4 + 4
    assert all(c["axis"] == "tp" for c in out["collectives"])


def test_tp2_sequence_parallel_halves_the_activations_per_rank(clean_process_group):
    """Peak activation bytes per rank of the train step (memory_report, fake meshes, a sequence
    long enough that activations make the peak): tp2 alone keeps the residual stream and norms
    whole on each rank (0.62 of one device); with sequence parallelism they are split and the
    peak is 0.54 of one device's: half, but for the one gathered matmul input each block keeps for
    its backward."""
    cfg, model, params, opt, batches = setup(["train.seq_len=512", "train.batch_size=2"], "llama_tiny")
    peak = {}
    for name, axes, sp in (("one", {"dp": 1}, ()), ("tp2", {"tp": 2}, ()), ("tp2_sp", {"tp": 2}, ("tp",))):
        cfg.partition.sequence_parallel = bool(sp)
        step = mesh_step(cfg, model, opt, params, sf.Mesh(axes, fake=True), backend=None)
        lowered = step.jitted.lower(params, opt.init(params), batches[0])
        peak[name] = lowered.memory_report()["activations"]
        if sp:
            stream = [n for n in lowered.traced.graph_module.graph.nodes
                      if n.target is torch.ops.aten.add.Tensor and tuple(n.meta["val"].shape) == (2, 512, 64)]
            # the residual stream (forward adds, gradient accumulation) is split over the sequence,
            # or a partial sum of gradients not yet reduced; never whole on a rank
            placements = {n.meta["sf_placements"] for n in stream}
            assert len(stream) > 4 * cfg.model.n_layers and placements == {(Shard(1),), (Partial(),)}
    assert peak["tp2"] / peak["one"] == pytest.approx(0.617, abs=0.002)
    assert peak["tp2_sp"] / peak["one"] == pytest.approx(0.540, abs=0.002)


@pytest.mark.slow
def test_tp2_sequence_parallel_moe_mla_matches_one_device():
    assert_matches(run_context(LLAMA_SP, 2, "moe_tiny"), reference("moe_tiny"))


def test_pipeline_stages_run_sequence_parallel():
    """pp2 x tp2: stage 0 (the embedding and the first layer's two blocks) per microbatch
    reduce-scatters the embedding's output and each block's output, forward and backward, and
    gathers each block's input twice (its forward, its output gradient's backward); no
    activation is all-reduced over tp."""
    from shardfn.plan.profile import lower_pipeline

    cfg = load_config("llama_tiny", ["mesh.pp=2", "mesh.tp=2", "pipeline.microbatches=2", *LLAMA_SP[1:]])
    micro = cfg.train.batch_size // cfg.pipeline.microbatches
    bsh = micro * cfg.train.seq_len * cfg.model.dim * 4
    rows = {r["op"]: r for r in lower_pipeline(cfg).comm_report(0) if r["axis"] == "tp"}
    assert (rows["all_gather"]["count"], rows["all_gather"]["bytes"]) == (2 * 4, 2 * 4 * bsh)
    assert rows["reduce_scatter"]["bytes"] == 2 * 5 * bsh + cfg.model.vocab_size * cfg.model.dim * 4
    assert rows["all_reduce"]["bytes"] < bsh // 100  # norm weights' gradients and the grad norm
