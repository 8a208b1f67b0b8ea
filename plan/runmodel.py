"""A GPU run's step time and memory, term by term: the estimate a plan leads with (``time``, ``memory``, ``fits``).

The traced plan (``plan.estimate``) is exact about the program shardfn emits on a CPU trace; a
GPU run differs from it in known ways: kernels reach a share of peak that depends on their
shape, attention is a flash kernel that keeps ``O(S)`` per row instead of the score matrix, the
element-wise ops and the optimizer are bound by HBM, communication overlaps compute where the
runtime prefetches it, and the allocator, the CUDA context and NCCL hold memory of their own.
This module prices each of those in closed form from the model's parameter shapes, the layout
and a hardware profile with its achieved-rate table (``partition.cost.hardware.efficiency``). Every
term is a named entry of the result, so a plan says where its time and bytes go.

    est = run_estimate(load_config("llama3_1_8b"), Layout(fsdp=8), hardware="h100_96gb",
                       spec=RunSpec(remat="selective_op", rows=2))
    est["tokens_per_s_per_device"], est["memory"]["reserved_bytes"] / 2**30

Three constants are fitted, each on one published run (docs/plan.md says which): the sustained
clock of the 500 W ``h100_96gb`` part (``partition.cost.hardware.EFFICIENCY``),
:data:`EXPERT_LOAD_IMBALANCE` and :data:`EAGER_ELEMENTWISE_FACTOR`. Everything else is a
datasheet number, a published measurement or a count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardfn.partition.cost.hardware import Hardware
from shardfn.partition.cost.model import Rates
from shardfn.plan.layout import Layout, inflight, intra_node, makespan_units

GIB = 1 << 30

ALLOCATOR_FRAGMENTATION = 0.10
"""Reserved over allocated bytes at the peak, minus one: the caching allocator's blocks that are
cached but free, split, or rounded up. Not fitted: a round 10% (TorchTitan's reported memory is
``torch.cuda.max_memory_reserved``, so the published runs check it; docs/plan.md)."""

CUDA_CONTEXT_BYTES = 0.6 * GIB
"""The CUDA context, cuBLAS/cuDNN workspaces and loaded kernels of one process, outside the
caching allocator (~500-700 MiB on Hopper with torch's lazy module loading; ``nvidia-smi`` minus
``torch.cuda.memory_reserved`` after initialisation)."""

NCCL_BYTES_PER_GROUP = 0.25 * GIB
"""NCCL's own buffers per communicator a rank is in (channels x ``NCCL_BUFFSIZE`` 4 MiB per peer
connection, plus proxy buffers), outside the caching allocator."""

STEP_OVERHEAD_S = 0.015
"""Fixed seconds per step: the host's launch latency not hidden by the queue, the data loader's
hand-off, the loss's device-to-host copy for logging and the optimizer's scalar bookkeeping."""

ELEMENTWISE_PASSES = 3.0
"""HBM traffic of the memory-bound ops per layer, in passes over the layer's activations: the
norms (read and write the residual stream), the residual adds, rotary embedding and the SwiGLU
product, forward once and backward about twice, after a compiler has fused neighbours."""

LOSS_BYTES_PER_LOGIT = 16
"""Cross-entropy's HBM traffic per logit: the bf16 logits read, the fp32 upcast written and read
for the log-sum-exp, the fp32 gradient written and cast back to bf16."""

EAGER_ELEMENTWISE_FACTOR = 3.3
"""The memory-bound ops' HBM traffic without ``torch.compile`` over the traffic with it: eager
runs each norm, rotary, SwiGLU product and residual add as separate kernels that write and read
back their intermediates, where inductor fuses neighbours (fitted on TorchTitan's eager Llama 3.1
8B FSDP 8 run against its compiled twin; docs/plan.md)."""

EAGER_LOSS_EXTRA_BYTES_PER_LOGIT = 4
"""Eager cross-entropy holds log-softmax's fp32 output beside the fp32 upcast at its peak, where
the compiled loss fuses the two (a count, checked on the eager Llama 3.1 8B run's memory)."""

ADAMW_BYTES_PER_PARAM = 34
"""A fused AdamW step per parameter (fp32 master weights): read parameter, gradient and two
moments (16), write parameter and moments (12), write the bf16 compute copy (2), and the
gradient norm for clipping reads the gradient once more (4)."""

EXPERT_LOAD_IMBALANCE = 1.28
"""The busiest expert-parallel rank's routed tokens over the mean: its grouped GEMMs and its
exchange set the pace of the MoE layer (fitted on TorchTitan's DeepSeek-V3 671B run; docs/plan.md)."""

EP_EXCHANGE_OVERLAP = 0.0
"""Share of the MoE all-to-alls hidden behind compute: none with the standard collectives
(the exchange sits on the critical path between router and experts)."""

REMAT_POLICIES = ("none", "full", "selective", "selective_op")


@dataclass(frozen=True)
class RunSpec:
    """What a run does beyond its layout.

    Attributes:
        remat: ``none``; ``full`` (each layer keeps its input); ``selective`` (shardfn's: plus every
            matmul's and attention's output); ``selective_op`` (TorchTitan's op-level policy: plus
            every other matmul's output and attention's).
        rows: sequences per microbatch per data rank (``None``: the config's batch over the layout).
        master_bytes, grad_bytes, opt_bytes: bytes per parameter of the fp32 master copy, its
            gradient and AdamW's moments; ``compute_bytes``: the bf16 copy used for compute.
        reduce_bytes: the gradient reduction's element size (TorchTitan reduces in fp32).
        reshard_after_forward: FSDP frees gathered weights after the forward and gathers again.
        sequence_parallel: under tp, the residual stream between the matmul blocks is split over
            tp as well (Megatron-LM's and TorchTitan's sequence parallelism).
        ep_overlap: share of the MoE exchange hidden behind compute.
        compile: the step is compiled (``train.compile`` not false): inductor fuses the
            memory-bound ops (:data:`EAGER_ELEMENTWISE_FACTOR` when eager).

    Example:
        RunSpec(remat="full", rows=2, compile=False)
    """

    remat: str = "none"
    rows: int | None = None
    master_bytes: int = 4
    grad_bytes: int = 4
    opt_bytes: int = 8
    compute_bytes: int = 2
    reduce_bytes: int = 4
    reshard_after_forward: bool = True
    sequence_parallel: bool = True
    ep_overlap: float = EP_EXCHANGE_OVERLAP
    compile: bool = True

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"RunSpec.remat: {self.remat!r} is not a policy; use one of {', '.join(REMAT_POLICIES)}")

    @classmethod
    def of(cls, cfg, **overrides) -> "RunSpec":
        """What a run config says: ``train.remat``, ``train.precision`` (bf16: 2-byte compute),
        ``train.compile``, ``partition.sequence_parallel``; ``overrides`` replace any field.

            RunSpec.of(load_config("llama3_8b", ["train.precision=bf16"])).compute_bytes   # 2
        """
        from shardfn.runtime.train_step import precision_policy

        compute = precision_policy(cfg.train).compute_dtype
        fields = dict(remat=cfg.train.remat, compute_bytes=torch.empty((), dtype=compute).element_size(),
                      reduce_bytes=4, sequence_parallel=bool(cfg.partition.sequence_parallel),
                      compile=cfg.train.compile is not False)
        return cls(**{**fields, **overrides})


@dataclass(frozen=True)
class MatMul:
    """One weight matmul of a layer: ``[tokens, k] @ [k, n]`` per token it touches."""

    name: str
    k: int
    n: int
    share: float      # of a layer's tokens that go through it (top_k / n_experts for routed experts)
    experts: int      # 1, or the routed experts it is one of
    in_axis: str | None
    out_axis: str | None
    local_numel: int  # elements on one rank (after fsdp/ep/tp sharding)


@dataclass(frozen=True)
class Shape:
    """The parameter shapes of one model, as the run model reads them (from the meta init)."""

    stacks: dict           # stack -> layers
    matmuls: dict          # stack -> [MatMul]
    norm_width: dict       # stack -> sum of norm widths in one layer
    layer_local: dict      # stack -> parameter elements of one layer on one rank
    layer_global: dict     # stack -> parameter elements of one layer
    layer_fsdp: dict       # stack -> elements of one layer's fsdp-sharded weights, gathered (whole over fsdp)
    embed: int
    head: int
    embed_local: int
    head_local: int
    head_fsdp: int         # the output head's fsdp-sharded weights, gathered
    dim: int
    vocab: int
    attn_flops_per_token_seq: float   # causal attention FLOPs fwd+bwd per token, layer and position
    attn_out: int          # heads x v_head_dim
    top_k: int
    n_experts: int
    kv_width: int = 0      # K and V elements per token that attention reads (cp gathers them)


def model_shape(cfg, layout: Layout, model=None) -> Shape:
    """The run model's view of ``cfg.model`` on ``layout``'s mesh (shards as ``cfg.rules`` place them);
    ``model``: the model module when the caller has resolved it.

        model_shape(load_config("llama3_1_8b"), Layout(fsdp=8)).matmuls["layers"][0]
    """
    from shardfn import models
    from shardfn.plan.inventory import mesh_leaves

    model, mcfg = model or models.get(cfg.model_name), cfg.model
    leaves = mesh_leaves(model, mcfg, layout.axes(include_pp=False), cfg.rules, torch.float32)
    stacks = dict(model.stacks(mcfg))
    mm = {k: [] for k in stacks}
    norms, local, glob, gathered = ({k: 0 for k in stacks} for _ in range(4))
    embed = head = embed_local = head_local = head_fsdp = 0
    fsdp = layout.fsdp
    n_experts = 1
    for leaf in leaves:
        numel, lnumel = math.prod(leaf.shape), math.prod(leaf.local)
        sharded = fsdp > 1 and "fsdp" in leaf.spec.axes()
        if leaf.stack is None:
            if leaf.axes and leaf.axes[0] == "vocab":
                embed, embed_local = embed + numel, embed_local + lnumel
            else:
                head, head_local = head + numel, head_local + lnumel
                head_fsdp += lnumel * fsdp if sharded else 0
            continue
        per, lper = numel // leaf.shape[0], lnumel // leaf.local[0]
        glob[leaf.stack] += per
        local[leaf.stack] += lper
        gathered[leaf.stack] += lper * fsdp if sharded else 0
        dims = leaf.shape[1:]
        if len(dims) == 1:
            norms[leaf.stack] += dims[0] if leaf.axes[-1] == "norm" else 0
            continue
        experts = dims[0] if len(dims) == 3 else 1
        n_experts = max(n_experts, experts)
        mm[leaf.stack].append(MatMul(leaf.path, dims[-2], dims[-1], leaf.active * experts if experts > 1 else 1.0,
                                     experts, leaf.axes[-2], leaf.axes[-1], lper))
    heads, qk, v = model.attention_shape(mcfg)
    return Shape(stacks, mm, norms, local, glob, gathered, embed, head, embed_local, head_local, head_fsdp,
                 model.embed_dim(mcfg), model.vocab_size(mcfg), 3.0 * heads * (qk + v), heads * v,
                 model.experts_per_token(mcfg), n_experts, model.kv_width(mcfg))


# ============================================================================ memory terms


def state_bytes(local_params: float, spec: RunSpec) -> dict:
    """Parameter, gradient and optimizer bytes of ``local_params`` elements (mixed precision:
    fp32 master weights, fp32 gradients, AdamW's two fp32 moments).

        state_bytes(1e9, RunSpec())   # {"params": 4e9, "grads": 4e9, "opt_state": 8e9}
    """
    return {"params": local_params * spec.master_bytes, "grads": local_params * spec.grad_bytes,
            "opt_state": local_params * spec.opt_bytes}


def saved_per_token_layer(shape: Shape, stack: str, remat: str, itemsize: int = 2, tp: int = 1,
                          sequence_parallel: bool = True) -> float:
    """Bytes one token leaves saved in one layer for the backward, with flash attention (which
    keeps q, k, v, its output and an fp32 log-sum-exp per head and row; no score matrix).

    ``none``: every matmul's input (inputs shared by several matmuls once), the outputs the
    backward of a non-linearity reads (SwiGLU's two, attention's q, k, v) and every norm's input.
    ``full``: the layer's input. ``selective``: ``full`` plus every matmul's output and attention's.
    ``selective_op``: ``full`` plus every other matmul's output and attention's.

        saved_per_token_layer(shape, "layers", "full")    # dim x 2 bytes
    """
    mms = shape.matmuls[stack]
    lse = 4 * shape.attn_out // 128   # fp32 per head (head dims ~128)
    stream = tp if sequence_parallel else 1   # the residual stream's split
    if remat == "full":
        return shape.dim * itemsize / stream
    if remat in ("selective", "selective_op"):
        out = sum(m.n * m.share for m in mms) / tp
        keep = 0.5 if remat == "selective_op" else 1.0
        return (shape.dim / stream + keep * out + shape.attn_out / tp) * itemsize + lse / tp
    inputs: dict = {}
    for m in mms:
        module = m.name.rsplit(".", 1)[0]
        inputs[(module, m.in_axis)] = max(inputs.get((module, m.in_axis), 0.0), m.k * m.share)
    outs = sum(m.n * m.share for m in mms if m.out_axis in ("mlp", "expert_mlp", "heads", "kv_heads"))
    return (sum(inputs.values()) + outs) / tp * itemsize + shape.norm_width[stack] * itemsize / stream + lse / tp


def rank_layers(shape: Shape, layout: Layout) -> dict:
    """Layers of each stack on the busiest pipeline rank: ``ceil(layers / pp)``, taken from the
    last stacks (the costliest layers of a MoE model), with the output head.

        rank_layers(shape, Layout(pp=8))   # {"dense_layers": 0, "moe_layers": 8}
    """
    want = math.ceil(sum(shape.stacks.values()) / layout.pp)
    out = {}
    for stack, n in reversed(list(shape.stacks.items())):
        out[stack] = min(n, want)
        want -= out[stack]
    return {k: out[k] for k in shape.stacks}


def memory_terms(shape: Shape, layout: Layout, spec: RunSpec, tokens_mb: int, layers: dict, rank: int = 0, *,
                 schedule: bool = True) -> dict:
    """Peak bytes of pipeline rank ``rank``, term by term: fp32 master weights, gradients and
    AdamW state of its shards; under fsdp the layer in use and the prefetched next one gathered
    in bf16 plus one layer's unsharded gradient; the activations its in-flight microbatches hold
    (:func:`saved_per_token_layer`); the larger transient of one layer's recomputed inside with
    its gradients, or the loss's bf16 logits, fp32 upcast and fp32 gradient (last rank); the
    allocator's fragmentation on all of that; the CUDA context and NCCL's buffers beside it.

        memory_terms(shape, Layout(fsdp=8), RunSpec(remat="full"), 8192, {"layers": 32})["device_bytes"]
    """
    it = spec.compute_bytes
    first, last = rank == 0, rank == layout.pp - 1
    local = sum(n * shape.layer_local[k] for k, n in layers.items())
    local += shape.embed_local * first + shape.head_local * last
    state = state_bytes(local, spec)
    gathered = 0.0
    if layout.fsdp > 1:
        biggest = max((shape.layer_fsdp[k] for k, n in layers.items() if n), default=0)
        gathered = biggest * (2 * it + spec.reduce_bytes)
        if last:
            gathered = max(gathered, shape.head_fsdp * (it + spec.reduce_bytes))
    per_layer = {k: saved_per_token_layer(shape, k, spec.remat, it, layout.tp, spec.sequence_parallel)
                 for k in layers}
    stage_mb = sum(n * per_layer[k] for k, n in layers.items()) * tokens_mb / layout.stages_per_rank
    if schedule:
        held, held_mb, _ = inflight(layout, [stage_mb] * layout.n_stages, sends=False)
        activations, in_flight = held[rank], held_mb[rank]
    else:  # a floor: every rank holds at least one stage-microbatch (floor_bytes)
        activations, in_flight = stage_mb, 1
    inside = max(saved_per_token_layer(shape, k, "none", it, layout.tp, spec.sequence_parallel)
                 for k, n in layers.items() if n)
    layer_transient = 2 * inside * tokens_mb
    loss_bytes = it + 4 + 4 + (0 if spec.compile else EAGER_LOSS_EXTRA_BYTES_PER_LOGIT)
    loss_transient = tokens_mb * shape.vocab / layout.tp * loss_bytes if last else 0.0
    transient = max(layer_transient, loss_transient)
    allocated = sum(state.values()) + gathered + activations + transient
    reserved = allocated * (1 + ALLOCATOR_FRAGMENTATION)
    groups = sum(1 for a in ("dp", "fsdp", "cp", "ep", "tp", "pp") if getattr(layout, a) > 1)
    outside = CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_GROUP * groups
    return {"pp_rank": rank, **{f"{k}_bytes": v for k, v in state.items()}, "fsdp_gathered_bytes": gathered,
            "activation_bytes": activations, "activation_bytes_per_token_layer": per_layer,
            "inflight_microbatches": in_flight, "transient_bytes": transient,
            "loss_transient_bytes": loss_transient, "layer_transient_bytes": layer_transient,
            "allocated_bytes": allocated, "fragmentation_bytes": reserved - allocated, "reserved_bytes": reserved,
            "cuda_context_bytes": CUDA_CONTEXT_BYTES, "nccl_bytes": NCCL_BYTES_PER_GROUP * groups,
            "device_bytes": reserved + outside}


def floor_bytes(shape: Shape, layout: Layout, spec: RunSpec, tokens_mb: int) -> float:
    """Device bytes no estimate of ``layout`` goes below: :func:`memory_terms` of its first and
    last pipeline rank with one stage-microbatch of activations held instead of the schedule's
    in-flight count (every other term needs no schedule). A search drops a layout whose floor
    exceeds the memory before it builds the layout's schedule.

        floor_bytes(shape, Layout(pp=8, ep=32), RunSpec(remat="full"), 4096)
    """
    layers = rank_layers(shape, layout)
    return max(memory_terms(shape, layout, spec, tokens_mb, layers, r, schedule=False)["device_bytes"]
               for r in {0, layout.pp - 1})


# ============================================================================ time terms


def matmul_s(shape: Shape, stack: str, tokens: float, layout: Layout, rates: Rates, dtype: torch.dtype) -> float:
    """Forward seconds of one layer's matmuls for ``tokens`` tokens on one rank, each GEMM at its
    shape's achieved share (routed experts: ``ep x tokens x top_k / experts`` rows per expert)."""
    total = 0.0
    for m in shape.matmuls[stack]:
        rows = tokens if m.experts == 1 else tokens * layout.ep * shape.top_k / m.experts
        flops = 2.0 * tokens * m.share * m.k * m.n / layout.tp * (EXPERT_LOAD_IMBALANCE if m.experts > 1 else 1.0)
        total += rates.gemm_s(rows, m.n / layout.tp, m.k, dtype, flops)
    return total


def _dtype(spec: RunSpec) -> torch.dtype:
    return torch.bfloat16 if spec.compute_bytes == 2 else torch.float32


def time_terms(shape: Shape, layout: Layout, spec: RunSpec, rates: Rates, tokens_mb: int, seq: int,
               layers: dict) -> dict:
    """Seconds per microbatch on the busiest rank, term by term, and what of it is exposed."""
    dtype = _dtype(spec)
    intra = intra_node(layout, rates.hardware)
    it = spec.compute_bytes
    fwd_mm = sum(n * matmul_s(shape, k, tokens_mb, layout, rates, dtype) for k, n in layers.items())
    head_flops = 2.0 * tokens_mb * shape.head / layout.tp
    head_mm = rates.gemm_s(tokens_mb, shape.vocab / layout.tp, shape.dim, dtype, head_flops)
    recompute_mm = {"full": 1.0, "selective_op": 0.5}.get(spec.remat, 0.0)
    matmul = 3 * fwd_mm + 3 * head_mm + recompute_mm * fwd_mm
    n_layers = sum(layers.values())
    attn_flops = n_layers * shape.attn_flops_per_token_seq * seq * tokens_mb / layout.tp
    attention = rates.attention_s(attn_flops * (4 / 3 if spec.remat == "full" else 1.0), dtype)
    act_bytes = sum(n * saved_per_token_layer(shape, k, "none", it, layout.tp) for k, n in layers.items())
    passes = ELEMENTWISE_PASSES * (1.0 if spec.compile else EAGER_ELEMENTWISE_FACTOR)
    memory_bound = rates.memory_s(passes * (1.0 + (spec.remat != "none") / 3) * act_bytes * tokens_mb
                                  + LOSS_BYTES_PER_LOGIT * tokens_mb * shape.vocab / layout.tp)
    compute = matmul + attention + memory_bound
    # fsdp: each layer's weights gathered (bf16) for the forward and again for the backward, its
    # gradient reduce-scattered; prefetched, so hidden behind compute but for the first gather
    fsdp = exposed_fsdp = 0.0
    if layout.fsdp > 1:
        gathers = 2 if spec.reshard_after_forward else 1
        full_dense = sum(n * shape.layer_fsdp[k] for k, n in layers.items()) + shape.head_fsdp
        ag = rates.collective_s("all_gather", full_dense * it, layout.fsdp, intra["fsdp"])
        rs = rates.collective_s("reduce_scatter", full_dense * spec.reduce_bytes, layout.fsdp, intra["fsdp"])
        fsdp = gathers * ag + rs
        # prefetch hides the forward's gathers behind the forward (a third of the compute), the
        # backward's gathers and reduce-scatters behind the backward; the first gather is exposed
        exposed_fsdp = (max(0.0, ag - compute / 3) + max(0.0, (gathers - 1) * ag + rs - 2 * compute / 3)
                        + ag / max(n_layers, 1))
    # tp: two all-reduces of [tokens, dim] per layer forward, two backward; on the critical path
    tp = 4 * n_layers * rates.collective_s("all_reduce", tokens_mb * shape.dim * it, layout.tp, intra["tp"])
    # ep: dispatch and combine, forward and backward (and the forward again when recomputed), per
    # MoE layer, the busiest rank's share
    moe_layers = sum(n for k, n in layers.items() if any(m.experts > 1 for m in shape.matmuls[k]))
    exchanges = 6 if spec.remat == "full" else 4
    ep = exchanges * moe_layers * EXPERT_LOAD_IMBALANCE * rates.all_to_all_s(
        tokens_mb * shape.top_k * shape.dim * it, layout.ep, intra["ep"])
    # cp: each attention layer all-gathers the sequence's K and V in the forward and again in the
    # backward, and reduce-scatters their gradients (docs/context.md); on the critical path
    cp = 0.0
    if layout.cp > 1:
        kv = tokens_mb * layout.cp * shape.kv_width / layout.tp * it
        cp = n_layers * (2 * rates.collective_s("all_gather", kv, layout.cp, intra["cp"])
                         + rates.collective_s("reduce_scatter", kv, layout.cp, intra["cp"]))
    exposed = compute + exposed_fsdp + tp + cp + ep * (1 - spec.ep_overlap)
    return {"matmul_s": matmul, "attention_s": attention, "memory_bound_s": memory_bound, "compute_s": compute,
            "fsdp_s": fsdp, "fsdp_exposed_s": exposed_fsdp, "tp_s": tp, "cp_s": cp, "ep_s": ep,
            "ep_exposed_s": ep * (1 - spec.ep_overlap), "microbatch_s": exposed}


def run_estimate(cfg, layout: Layout, *, hardware: str | Hardware | Rates = "h200", spec: RunSpec | None = None,
                 shape: Shape | None = None, layers: dict | None = None, bound: bool = False) -> dict:
    """A GPU run of ``cfg`` under ``layout``: step time, tokens/s per device, MFU and peak memory,
    with every term named (see the module docstring).

    ``shape`` is :func:`model_shape` of the layout's mesh when the caller has it (a search keeps
    one per mesh); ``layers`` the busiest pipeline rank's layers per stack when the stage split
    is known (default :func:`rank_layers`). ``bound``: the pipeline without its bubble and P2P
    delay (no schedule simulated), so ``step_s`` is a lower bound on the estimate's and every
    other number is the estimate's (a search ranks by it before it simulates).

    Example:
        est = run_estimate(cfg, Layout(fsdp=8), hardware="h100_96gb", spec=RunSpec(remat="selective_op", rows=2))
        est["time"]["step_s"], est["memory"]["reserved_bytes"]
    """
    spec = spec or RunSpec.of(cfg)
    rates = hardware if isinstance(hardware, Rates) else Rates.of(hardware)
    hw = rates.hardware
    shape = shape or model_shape(cfg, layout)
    seq = cfg.train.seq_len
    rows = spec.rows if spec.rows is not None else cfg.train.batch_size // layout.data_size // layout.microbatches
    if rows < 1:
        raise ValueError(f"train.batch_size: {cfg.train.batch_size} leaves no row per microbatch on "
                         f"{layout.data_size} data ranks x {layout.microbatches} microbatches")
    tokens_mb = rows * seq // layout.cp  # a context-parallel rank holds 1/cp of each sequence
    layers = layers or rank_layers(shape, layout)
    t = time_terms(shape, layout, spec, rates, tokens_mb, seq, layers)
    per_mb = t["microbatch_s"]
    m = layout.microbatches
    intra = intra_node(layout, hw)
    p2p = rates.p2p_s(tokens_mb * shape.dim * spec.compute_bytes, intra["pp"]) if layout.pp > 1 else 0.0
    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    unit = per_mb / 3 / layout.stages_per_rank
    if bound:
        makespan, bubble = m * layout.stages_per_rank * (costs["F"] + costs["B"]), 0.0
    else:
        makespan, bubble = makespan_units(layout, costs, p2p / unit if unit else 0.0)
    pipeline = makespan * unit
    local = sum(n * shape.layer_local[k] for k, n in layers.items()) + shape.head_local
    optimizer = rates.memory_s(local * ADAMW_BYTES_PER_PARAM)
    dp = 0.0
    if layout.dp * layout.cp > 1:  # parameters are replicated over cp too: their gradients are summed over it
        dp = rates.collective_s("all_reduce", local * layout.fsdp * spec.reduce_bytes / layout.fsdp,
                                layout.dp * layout.cp, intra["dp"])
    dp_exposed = max(0.0, dp - pipeline * 2 / 3)
    step = pipeline + optimizer + dp_exposed + STEP_OVERHEAD_S
    tokens_step = tokens_mb * layout.cp * m * layout.data_size
    per_device = tokens_step / step / layout.world_size
    active = sum(shape.stacks[k] * sum(mm.k * mm.n * mm.share for mm in shape.matmuls[k]) for k in shape.stacks)
    model_flops = (6.0 * (active + shape.head) + sum(shape.stacks.values()) * shape.attn_flops_per_token_seq * seq)
    mem = max((memory_terms(shape, layout, spec, tokens_mb, layers, r) for r in {0, layout.pp - 1}),
              key=lambda x: x["device_bytes"])
    return {
        "hardware": hw.name, "remat": spec.remat, "compile": spec.compile, "rows_per_microbatch": rows,
        "rank_layers": layers,
        "time": {**t, "pipeline_s": pipeline, "bubble": bubble, "p2p_s": p2p, "optimizer_s": optimizer,
                 "dp_s": dp, "dp_exposed_s": dp_exposed, "fixed_s": STEP_OVERHEAD_S, "step_s": step},
        "tokens_per_s_per_device": per_device, "model_flops_per_token": model_flops,
        "mfu": per_device * model_flops / rates.peak(_dtype(spec)),
        "memory": mem, "fits": mem["device_bytes"] <= hw.hbm_bytes, "efficiency_source": rates.efficiency.source,
    }
