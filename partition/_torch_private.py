"""Every use of a private torch API in shardfn, in one place (a torch upgrade touches this file).

- DTensor's sharding propagator: asked which input placements an op wants, before it runs, so
  the partitioner can decide how a Partial value is reduced (once, and for every consumer).
- The active make_fx tracer: to tell which collectives each global graph node emitted.
- The fake process group's store, for planning on a simulated mesh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree


def desired_input_specs(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list | None:
    """The DTensorSpec DTensor wants for each DTensor leaf of ``(args, kwargs)`` (flattened in
    pytree order), or None when the op runs on its inputs as they are."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op, args, kwargs)
    sharding = dispatcher.sharding_propagator.propagate_op_sharding_non_cached(info.schema)
    if not sharding.needs_redistribute or sharding.redistribute_schema is None:
        return None
    schema = sharding.redistribute_schema
    wanted = [
        leaf
        for leaf in pytree.tree_leaves((schema.args_schema, schema.kwargs_schema))
        if _is_spec(leaf)
    ]
    return wanted


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


def resolve_group(name: str):
    """The process group registered under ``name`` (as functional collectives name groups)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
