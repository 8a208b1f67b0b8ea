"""Every use of a private torch API in shardfn, in one package (a torch upgrade touches only it).

``strategies`` holds what the auto-sharder asks DTensor's op-strategy registries; this module
holds the rest:

- DTensor's sharding propagator: asked which input placements an op wants, before it runs, so
  the partitioner can decide how a Partial value is reduced (once, and for every consumer).
- The active make_fx tracer: to tell which collectives each global graph node emitted.
- The fake process group's store, for planning on a simulated mesh.
- ``_StridedShard.local_shard_size_and_offset``: run outside the tracing modes when its sizes
  are plain ints (:func:`eager_strided_shard_sizes`), so planning a redistribution does not
  trace index tensors one element at a time.
- ``_ops.utils.redistribute_cost``: memoized per lowering (:func:`memoized_redistribute_costs`);
  DTensor asks it for the same (source, target) pair thousands of times while expanding op
  strategies over a 2-D mesh.
- DTensor's redistribute planner (:func:`redistribute_steps`): the mesh-dim-by-mesh-dim steps
  ``redistribute`` takes, which the auto-sharder prices so its estimate is the program's.
- DTensor's sharding-propagation cache, cleared when a planner rebuilds the fake process group
  (:func:`clear_sharding_cache`).
- ``FakeTensorMode`` (:func:`fake_mode`): tensors with shapes and dtypes and no storage.
- c10d's default process-group timeout, which the subgroups of a ``DeviceMesh`` inherit
  (:func:`set_default_group_timeout`), and the number of worker threads each gloo group runs
  its collectives on (:func:`one_gloo_worker_thread`; ``init_process_group`` ignores gloo's
  options in torch 2.13), read back by :func:`gloo_worker_threads`.
- ``torch.utils._pytree`` (:func:`tree_flatten`): an op's ``(args, kwargs)`` flattened the way
  DTensor's dispatcher sees them; ``torch._ops.OpOverload`` (:data:`OpOverload`); a DTensor's
  ``DTensorSpec`` (:func:`dtensor_spec`), and one built once to wrap a program's outputs every
  step (:func:`dtensor_wrapper`).
- functorch's interpreter stack and the dispatch-mode stack (:func:`ops_intercepted`), and the
  profiler's enabled flag (:func:`profiler_enabled`): what ``core.transforms.eager`` and the
  layers' profiler labels ask.
- The dispatcher's thread-local key sets (:func:`autograd_inside_custom_op`): autograd turned
  back on inside a custom op's body, which the dispatcher runs below autograd.
- A ``torch.library.custom_op``'s schema (:func:`returns_tensor_list`): whether it returns a
  list of tensors, which ``core.custom_ops.register_autograd`` hands back as a list.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

OpOverload = torch._ops.OpOverload
"""The type of an ATen op overload (``torch.ops.aten.mm.default``)."""

tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten
tree_leaves = pytree.tree_leaves


def dtensor_spec(x: DTensor):
    """``x``'s ``DTensorSpec`` (mesh, placements and tensor metadata)."""
    return x._spec


def dtensor_wrapper(device_mesh, placements, shape, stride, dtype) -> Callable[[torch.Tensor], DTensor]:
    """A function that wraps a local tensor (no autograd history) as the DTensor that
    ``DTensor.from_local(local, device_mesh, placements, run_check=False, shape=shape,
    stride=stride)`` gives, its ``DTensorSpec`` built once here: a ``from_local`` costs ~35 us,
    most of it building that spec, the wrap ~5 us (a step returns dozens of tensors).

        wrap = dtensor_wrapper(mesh.device_mesh, (Replicate(),), x.shape, x.stride(), x.dtype)
        wrap(x).placements   # (Replicate(),)
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(device_mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))

    def wrap(local: torch.Tensor) -> DTensor:
        return DTensor(local.view_as(local), spec, requires_grad=False)  # a fresh tensor object, as from_local's

    return wrap


def local_shard_slices(shape, device_mesh, placements) -> tuple[slice, ...] | None:
    """The slices that cut this rank's shard out of a global tensor of ``shape`` under
    ``placements`` (``distribute_tensor``'s chunking: uneven shards, empty ones), or None where a
    placement is not a plain ``Shard`` or ``Replicate`` (there ``distribute_tensor`` itself).

        x[local_shard_slices(x.shape, mesh, (Shard(0),))]   # rank r's rows, a view
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) for p in placements):
        return None
    local, offset = compute_local_shape_and_global_offset(shape, device_mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local))


def planned_sharding(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[list | None, list]:
    """What DTensor would do for this call: the DTensorSpec it wants for each DTensor leaf of
    ``(args, kwargs)`` (flattened in pytree order; None when it runs on the inputs as they are),
    and the placements of each output."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op, args, kwargs)
    sharding = dispatcher.sharding_propagator.propagate_op_sharding_non_cached(info.schema)
    outs = sharding.output_spec if isinstance(sharding.output_spec, (tuple, list)) else [sharding.output_spec]
    out_placements = [tuple(o.placements) for o in outs if _is_spec(o)]
    if not sharding.needs_redistribute or sharding.redistribute_schema is None:
        return None, out_placements
    schema = sharding.redistribute_schema
    wanted = [
        leaf
        for leaf in pytree.tree_leaves((schema.args_schema, schema.kwargs_schema))
        if _is_spec(leaf)
    ]
    return wanted, out_placements


@contextlib.contextmanager
def vocab_parallel_loss():
    """DTensor's loss-parallel handlers (log-softmax / NLL over a class dim sharded on one mesh
    dim: all-reduces of max and sum instead of gathering the logits)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def _is_spec(x: Any) -> bool:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return isinstance(x, DTensorSpec)


def current_trace_graph() -> torch.fx.Graph | None:
    """The graph make_fx is recording into right now, if any."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


def fake_store():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def local_shape(global_shape, device_mesh, placements) -> tuple[int, ...]:
    """This rank's shard shape of a tensor of ``global_shape`` under ``placements``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(global_shape, device_mesh, placements)
    return tuple(shape)


def local_shape_and_offset(global_shape, device_mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard shape of a tensor of ``global_shape`` under ``placements``, and where
    the shard starts in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(global_shape, device_mesh, placements)
    return tuple(shape), tuple(offset)


def redistribute_steps(device_mesh, shape, dtype, src, dst) -> list[tuple[int, Any, Any]]:
    """The steps DTensor's ``redistribute`` takes from placements ``src`` to ``dst`` for a tensor
    of global ``shape``: ``(mesh_dim, from, to)`` in issue order."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), dtype)
    infos = _gen_transform_infos(DTensorSpec(device_mesh, tuple(src), meta),
                                 DTensorSpec(device_mesh, tuple(dst), meta))
    return [(i.mesh_dim, *i.src_dst_placements) for i in infos]


def resolve_group(name: str):
    """The process group registered under ``name`` (as functional collectives name groups)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@contextlib.contextmanager
def eager_strided_shard_sizes():
    """While active, DTensor computes ``_StridedShard`` shard sizes and offsets (a strided
    placement appears when two mesh axes split one tensor dim, e.g. ``fsdp`` and ``tp``) on
    real index tensors even under make_fx and FakeTensorMode, where each ``.tolist()`` would be
    traced and cost seconds per call. The answer is the same; only its cost changes.

        with eager_strided_shard_sizes():
            gm = make_fx(local_fn, tracing_mode="fake")(*example)
    """
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.utils._python_dispatch import _disable_current_modes

    original = _StridedShard.local_shard_size_and_offset
    answers: dict = {}  # the answer is a pure function of the placement and the integers asked

    def eager(self, curr_local_size, num_chunks, rank, *args, **kwargs):
        if not all(type(x) is int for x in (curr_local_size, num_chunks, rank)):
            return original(self, curr_local_size, num_chunks, rank, *args, **kwargs)
        key = (self, curr_local_size, num_chunks, rank, args, tuple(sorted(kwargs.items())))
        hit = answers.get(key)
        if hit is None:
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                hit = answers[key] = original(self, curr_local_size, num_chunks, rank, *args, **kwargs)
        size, offsets = hit
        return size, list(offsets) if isinstance(offsets, list) else offsets  # the caller's own list

    _StridedShard.local_shard_size_and_offset = eager
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


@contextlib.contextmanager
def memoized_redistribute_costs():
    """While active, DTensor's strategy expansion reuses the cost of redistributing one spec to
    another (a pure function of the two specs, meshes included) instead of planning it again.

        with memoized_redistribute_costs():
            gm = make_fx(local_fn, tracing_mode="fake")(*example)
    """
    from torch.distributed.tensor._ops import utils

    original = utils.redistribute_cost
    costs: dict = {}

    def memoized(src, dst):
        try:
            key = (src, dst)
            hit = costs.get(key)
        except TypeError:  # an unhashable spec: ask every time
            return original(src, dst)
        if hit is None:
            hit = costs[key] = original(src, dst)
        return hit

    utils.redistribute_cost = memoized
    try:
        yield
    finally:
        utils.redistribute_cost = original


@contextlib.contextmanager
def faster_propagation():
    """:func:`eager_strided_shard_sizes` and :func:`memoized_redistribute_costs` together: the
    same lowering, minutes faster on 2-D meshes.

        with faster_propagation():
            gm = make_fx(local_fn, tracing_mode="fake")(*example)
    """
    with eager_strided_shard_sizes(), memoized_redistribute_costs():
        yield


def clear_sharding_cache() -> None:
    """Forget DTensor's cached sharding decisions (they are keyed by meshes that compare equal,
    so a mesh rebuilt on a new fake process group would reuse the old group's collectives)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def fake_mode():
    """A ``FakeTensorMode`` that also accepts real tensors as inputs.

        with fake_mode():
            params = model.init(cfg, 0)   # shapes and dtypes, no storage
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def set_default_group_timeout(timeout) -> None:
    """The timeout (a ``datetime.timedelta``) of every process group created from now on,
    the subgroups a ``DeviceMesh`` makes included (c10d's default is 30 minutes)."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout


def one_gloo_worker_thread() -> None:
    """Every gloo process group created from now on (the default group and the subgroups a
    ``DeviceMesh`` makes) runs its collectives on one worker thread instead of gloo's two.

    Still asynchronous to the caller: a functional collective's ``wait_tensor`` is where the
    caller blocks. With two worker threads, two collectives in flight at once on one group
    (an FSDP gather prefetched while another is running) corrupted the heap: a rank died with
    ``malloc(): unaligned tcache chunk detected`` in about half of the runs of an fsdp2 step
    with the overlap pass (docs/passes.md); with one worker thread, none did. On this two-core
    machine one thread is also the one core the rank can spare. Idempotent.

        one_gloo_worker_thread(); dist.init_process_group("gloo")
    """
    import torch.distributed.distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_shardfn_one_thread", False):
        return

    class OneThreadGloo(base):
        _shardfn_one_thread = True

        def __init__(self, store, rank, size, timeout=c10d.default_pg_timeout):
            options = base._Options()
            options._threads = 1
            options._timeout = timeout
            names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
            options._devices = ([base.create_device(interface=n) for n in names] if names
                                else [base.create_default_device()])  # as gloo's own constructor
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneThreadGloo


def gloo_worker_threads(group) -> int | None:
    """How many worker threads a gloo process group (a ``ProcessGroup`` or its name, as a
    functional collective's ``group_name`` argument holds it) runs its collectives on; None
    for a group without a gloo backend (nccl, fake) or a name no live group has.

        gloo_worker_threads(dist.group.WORLD)   # 2 unless one_gloo_worker_thread() came first
    """
    import torch.distributed.distributed_c10d as c10d

    if isinstance(group, str):
        try:
            group = c10d._resolve_process_group(group)
        except (KeyError, RuntimeError, ValueError):
            return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    if not isinstance(backend, torch._C._distributed_c10d.ProcessGroupGloo):
        return None
    return backend.options._threads


def ops_intercepted() -> bool:
    """Whether anything stands between a torch op and its kernel right now: a ``torch.func``
    transform (grad, vmap, jvp, functionalize) or a dispatch mode (make_fx's tracer,
    ``FakeTensorMode``, ``FlopCounterMode``, ...). Both checks are flag reads."""
    return torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack() > 0


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jvp, functionalize) is active right now;
    unlike :func:`ops_intercepted`, a tracer or fake mode alone does not count. A flag read."""
    return torch._C._are_functorch_transforms_active()


@contextlib.contextmanager
def autograd_inside_custom_op():
    """Autograd records again inside a ``torch.library.custom_op``'s body, which the dispatcher
    runs with autograd's keys excluded, so ``torch.autograd.grad`` can differentiate there what
    the body builds (what ``torch.func.vjp`` does by pushing an interpreter of its own).

        with autograd_inside_custom_op(), torch.enable_grad():
            dx, = torch.autograd.grad(f(x := x0.detach().requires_grad_()), [x], dy)
    """
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    exclude = exclude.remove(keys.AutogradFunctionality).remove(keys.AutogradOther)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def returns_tensor_list(op) -> bool:
    """Whether the ``torch.library.custom_op`` ``op`` returns ``Tensor[]`` (a list of tensors)."""
    returns = op._opoverload._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch._C.ListType)


def profiler_enabled() -> bool:
    """Whether a profiler (``torch.profiler.profile``, ``torch.autograd.profiler.profile``) is
    recording right now."""
    return torch.autograd.profiler._is_profiler_enabled


def strided_shard(placement) -> tuple[int, int] | None:
    """``(dim, split_factor)`` of a ``_StridedShard`` placement (a dim split by two mesh axes in
    an interleaved order; in torch 2.13 not a ``Shard``), else None."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return (placement.dim, placement.split_factor) if isinstance(placement, _StridedShard) else None
