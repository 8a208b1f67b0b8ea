"""DTensor's sharding propagation and redistribution planning, each question answered once.

A lowering asks DTensor, for every op, which placements it wants (twice: the partitioner asks
before the op runs, and DTensor's dispatcher asks again when it runs, uncached while make_fx
traces), and each answer compares redistribution costs found by a shortest-path search over
sharding states (``DTensorRedistributePlanner``: every state's successors, each with its cost,
recomputed for every pair of placements). On a mesh of three or more axes a tensor split by two
of them (a ``_StridedShard``) sends every cost through that search, and one lowering of a 1-layer
MLA model on ``dp x ep x tp`` asked for the same successors ~14 times over (minutes on 2 cores).

:func:`shared_propagation` answers the three questions from a :class:`PropagationCache` the
caller owns, so one lowering, and every later lowering on the same process group, asks each
distinct one once. All three are pure functions of their keys (op schema; source and target
spec; mesh, tensor metadata and state), so the lowered program is the same, only sooner.

    cache = PropagationCache()
    with shared_propagation(cache):
        lowered = step.jitted.lower(params, state, batch)
"""

from __future__ import annotations

import contextlib
import heapq
import math
from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass
class PropagationCache:
    """Answers kept between lowerings, valid while one process group lives (``world``)."""

    world: object = None
    sharding: dict = field(default_factory=dict)      # OpSchema -> OutputSharding
    costs: dict = field(default_factory=dict)         # (src spec, dst spec) -> redistribute cost
    successors: dict = field(default_factory=dict)    # (mesh, meta, state, targets) -> {state: cost}
    searches: dict = field(default_factory=dict)      # (mesh, bytes, ndim, source, targets) -> _Search
    steps: dict = field(default_factory=dict)         # (mesh, bytes, placements, placements) -> step cost
    hits: int = 0
    misses: int = 0

    def clear(self) -> None:
        self.sharding.clear()
        self.costs.clear()
        self.successors.clear()
        self.searches.clear()
        self.steps.clear()


def _memo(table: dict, key, compute, cache: PropagationCache):
    try:
        hit = table.get(key)
    except TypeError:  # an unhashable key (a symbolic size): ask every time
        return compute()
    if hit is None:
        cache.misses += 1
        hit = table[key] = compute()
    else:
        cache.hits += 1
    return hit


class _Search:
    """``DTensorRedistributePlanner.find_min_cost_path`` from one source state, resumable: the
    same Dijkstra (same queue keys, insertion counter and tie-breaking), so the states it settles
    and their paths do not depend on the target asked for; a later target reads its path if the
    search already settled it, and otherwise resumes the search until it does. The answer is the
    path a fresh search for that target returns."""

    def __init__(self, planner, source, sort_key):
        self.planner, self.sort_key = planner, sort_key
        self.source = source
        self.queue = [(0.0, 0, 0.0, source, ())]   # (key, counter, cost, state, path before it)
        self.counter = 0
        self.settled: dict = {}                    # state -> its path, source first

    def path_to(self, target) -> list:
        hit = self.settled.get(target)
        if hit is not None:
            return list(hit)
        queue, settled = self.queue, self.settled
        while queue:
            _, _, cost, state, before = heapq.heappop(queue)
            if state in settled:
                continue
            path = settled[state] = (*before, state)
            for nxt, step in self.planner.get_next_state(state.placements, state.tensor_dim_to_mesh_dim).items():
                if nxt not in settled:
                    self.counter += 1
                    total = cost + step
                    heapq.heappush(queue, (self.sort_key(total), self.counter, total, nxt, path))
            if state == target:
                return list(path)
        raise AssertionError(f"No path found from src_state {self.source} to dst_state {target}")


def _step_costs(cost_function, mesh_bytes: tuple, steps: dict):
    """A planner's one-step cost, kept per (mesh, tensor bytes, source and target placements):
    all that ``one_step_redistribute_cost`` reads (not the shard order, nor the shape beyond its
    bytes)."""

    def cost(src_state, dst_state):
        key = (mesh_bytes, src_state.placements, dst_state.placements)
        hit = steps.get(key)
        if hit is None:
            hit = steps[key] = cost_function(src_state, dst_state)
        return hit

    return cost


@contextlib.contextmanager
def shared_propagation(cache: PropagationCache):
    """While active, DTensor's sharding propagation (per op schema), redistribution costs (per
    source and target spec) and the redistribution planner's successor states (per mesh, tensor
    metadata and state) come from ``cache``, computed on first use. The cache is emptied when the
    default process group is not the one it was filled under (a fake group rebuilt for another
    world size), since DTensor's meshes of equal shape compare equal across groups.

    Example:
        cache = PropagationCache()
        with shared_propagation(cache):
            lowered = step.jitted.lower(params, state, batch)
    """
    from torch.distributed.tensor._ops import utils
    from torch.distributed.tensor._redistribute import DTensorRedistributePlanner, _redistribute_cost_sort_key
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    world = dist.group.WORLD if dist.is_initialized() else None
    if cache.world is not world:
        cache.clear()
        cache.world = world
    propagate, cost, successors = (ShardingPropagator.propagate_op_sharding_non_cached, utils.redistribute_cost,
                                   DTensorRedistributePlanner.get_next_state)
    shortest = DTensorRedistributePlanner.find_min_cost_path

    def propagate_once(self, op_schema):
        return _memo(cache.sharding, (id(self), op_schema), lambda: propagate(self, op_schema), cache)

    def cost_once(src, dst):
        return _memo(cache.costs, (src, dst), lambda: cost(src, dst), cache)

    def successors_once(self, placements, order):
        key = (self.device_mesh, self.dtensor_meta, placements, order,
               frozenset(self.strided_shard_placements_in_target), frozenset(self.partial_reduce_ops_in_target))
        return dict(_memo(cache.successors, key, lambda: successors(self, placements, order), cache))

    def shortest_once(self, src_state, dst_state):
        meta = self.dtensor_meta
        nbytes = meta.dtype.itemsize * math.prod(meta.shape)
        if type(nbytes) is not int:  # a symbolic size: search afresh
            return shortest(self, src_state, dst_state)
        # a step's cost depends on the tensor's bytes, its successors on its rank and the targets
        targets = (frozenset(self.strided_shard_placements_in_target), frozenset(self.partial_reduce_ops_in_target))
        key = (self.device_mesh, nbytes, len(meta.shape), src_state, targets)
        search = cache.searches.get(key)
        if search is None:
            planner = DTensorRedistributePlanner(self.device_mesh, meta)
            planner.strided_shard_placements_in_target = set(targets[0])
            planner.partial_reduce_ops_in_target = set(targets[1])
            planner.cost_function = _step_costs(planner.cost_function, (self.device_mesh, nbytes), cache.steps)
            search = cache.searches[key] = _Search(planner, src_state, _redistribute_cost_sort_key)
        return search.path_to(dst_state)

    ShardingPropagator.propagate_op_sharding_non_cached = propagate_once
    DTensorRedistributePlanner.find_min_cost_path = shortest_once
    utils.redistribute_cost = cost_once
    DTensorRedistributePlanner.get_next_state = successors_once
    try:
        yield cache
    finally:
        ShardingPropagator.propagate_op_sharding_non_cached = propagate
        utils.redistribute_cost = cost
        DTensorRedistributePlanner.get_next_state = successors
        DTensorRedistributePlanner.find_min_cost_path = shortest
