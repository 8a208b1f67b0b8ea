"""The planner (``shardfn plan``): bytes, collectives, step time and fit per rank for a run config on a
simulated mesh of any size, without allocating a parameter; and a search over layouts.

It sits above the runtime and asks the same functions a run uses: the layout checks and specs of
``partition.layouts.axes``, the schedules of ``partition.pipeline.schedules``, and the run's own train step
(``runtime.partitioned``) lowered on a fake mesh. One module per part: ``layout`` (what to plan,
and its checks), ``resolve`` (a run config resolved once), ``runmodel`` (the estimate),
``inventory`` (what each rank holds), ``profile`` (tracing a representative step), ``estimate``
(the plan), ``search``, ``text``, ``published`` (published runs against the estimate).

    cfg = load_config("kimi_k2_1t", ["mesh.pp=16", "mesh.ep=64", "train.batch_size=1024", "train.seq_len=4096"])
    plan = make_plan(cfg, hardware="h200")
    plan.fits, plan.peak_bytes, plan.time["step_s"], plan.time["tokens_per_s_per_device"]
    print(format_plan(plan)); json.dumps(plan.to_dict())
    found = search(cfg, gpus=1024, hardware="h200")        # fitting layouts, fastest first

Where each number comes from:

- **Parameters, gradients, optimizer state** are exact, for the full model, from shapes and
  specs alone: every parameter's spec on the mesh (``model.param_axes`` + the config's rules,
  as ``runtime.partitioned`` lays out a run) gives its local shard, ``numel x element size``;
  a pipeline rank holds its stages' slices of the stacked layers (:func:`stage_ranges`: the
  split a run makes, balanced by cost, whole layers), the
  embedding on the first stage and the final norm and output head on the last. The optimizer
  state is the real optimizer's ``init`` on meta tensors (AdamW: two moments like the
  parameters plus 0-d counters), sharded as the parameters. Gradients are the parameters' size.
- **Activations and collectives** come from lowering the real train step
  (``runtime.train_step.make_train_step`` under ``runtime.partitioned``'s specs) with fake tensors
  on a fake mesh of the layout's axes (``pp`` left out: stages own it), for one microbatch.
  A model of more than :data:`FULL_TRACE_MAX_LAYERS` layers (or any model under ``pp > 1``) is
  traced *reduced*: one layer of each kind (``dense_layers``, ``moe_layers``; ``layers`` for
  Llama), then each kind once more. The differences are exact per-layer quantities (every
  layer of a kind lowers to the same program), and a stage's numbers are
  ``base + sum(layers of kind k on the stage * per-layer_k)``. What is not a layer (embedding,
  final norm, output head, loss) is charged to the last stage.
  *Activation bytes* are the forward values the backward reads (saved for backward); with
  activation checkpointing a layer keeps only its input ``[mb, seq, dim]`` and one layer is
  recomputed at a time. Collectives of the forward and backward run once per microbatch; the
  gradient reductions (the constraints ``runtime.partitioned`` puts on the gradients) and the
  optimizer's run once per step, after gradients are accumulated over microbatches. Each
  gradient reduction belongs to one parameter, so a stage counts those of its own slices.
- **Expert-parallel all-to-alls** depend on routing and run in the runtime
  (``runtime.moe_dispatch``), so they are *estimated* for uniform routing: per MoE layer and
  microbatch, dispatch and combine each send ``tokens x top_k x dim x bytes x (ep-1)/ep`` off
  the rank, forward and again backward (four exchanges). **P2P** between pipeline stages is the
  ``[mb, seq, dim]`` activation forward and its gradient backward, per microbatch and boundary
  (counted from the schedule's send actions).
- **In-flight microbatches** per pipeline rank come from the schedule's action lists
  (``partition.pipeline.schedules``): the most forwards whose backward has not run, weighted by each
  stage's activation bytes.
- **The answer**: step time, tokens/s, MFU, peak memory and fit are the run model's estimate
  (``runmodel``, through ``resolve``: the config resolved once), in closed form from the
  parameter shards, the layout, the run config (remat, precision, compile) and the hardware's
  achieved rates; ``fits`` is its device bytes within ``partition.memory_budget`` or the
  device. The search ranks layouts by it. The traced program's own time (datasheet peak,
  nothing overlapped: ``Plan.traced_time``) and peak (``Plan.per_rank``) are detail.
"""

from shardfn.plan.estimate import Plan, make_plan
from shardfn.plan.inventory import memory_bytes, stage_ranges, state_bytes
from shardfn.plan.layout import PLACEMENT_ORDER, Layout, PlanError, check_layout, rank_stages
from shardfn.plan.profile import FULL_TRACE_MAX_LAYERS, Profile, lower_step, measure, profile, saved_bytes
from shardfn.plan.resolve import Resolved, resolve, run_config
from shardfn.plan.search import SearchResult, search
from shardfn.plan.text import format_estimate, format_plan, format_search

__all__ = [
    "PLACEMENT_ORDER", "FULL_TRACE_MAX_LAYERS",
    "Layout", "PlanError", "Plan", "Profile", "SearchResult", "Resolved", "resolve", "run_config",
    "check_layout", "stage_ranges", "rank_stages", "state_bytes", "memory_bytes",
    "lower_step", "measure", "saved_bytes", "profile", "make_plan", "search", "format_plan", "format_estimate",
    "format_search",
]
