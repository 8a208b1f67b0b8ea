"""What one pipeline rank holds, and moving parameter trees in and out of that.

A rank's state is ``{"stage<s>": subtree}`` for its stages, each subtree shaped like the model's
tree restricted to the leaves the stage holds, and each leaf this rank's *block* of the stage's
tensor: the stage's layers of a stacked leaf (``partition.pipeline.split``), then this rank's shard of
those under the leaf's placements on the stage's mesh (``partition.pipeline.stage_programs``). A block
is a box of the full leaf (:meth:`RankLayout.region`), which is all that initialisation, import,
checkpoints and exports need:

    layout.from_source(source)       # build only this rank's blocks: source(regions) -> {path: tensor}
    layout.scatter(params)           # the same from a full tree every rank holds
    layout.gather(params_local)      # the full tree again, on every rank (exports, tests)
    layout.checkpoint_blocks(params_local)   # Blocks of the global leaves, for DCP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardfn.core.pytree import PyTree, flatten_with_paths, tree_flatten, tree_unflatten
from shardfn.partition.pipeline.split import Pipeline, merge_params
from shardfn.partition.pipeline.stage_programs import StagePrograms
from shardfn.runtime.param_source import Source, contiguous_stride, tree_source


def stage_key(stage: int) -> str:
    """The key of a stage's subtree in a local parameter tree: ``"stage3"``."""
    return f"stage{stage}"


def nest(flat: dict[str, torch.Tensor]) -> dict:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}``."""
    out: dict = {}
    for path, x in flat.items():
        node = out
        *head, last = path.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = x
    return out


@dataclass
class RankLayout:
    """The blocks one pipeline rank holds (see the module docstring).

    Attributes:
        pipe: the whole pipeline (global shapes).
        programs: ``stage -> StagePrograms`` for this rank's stages (their layouts say the shards).
        stages: this rank's stages, in schedule order.
        stage_to_rank: the pp rank of every stage.
        pp_rank, pp_group: this rank's place in the ``pp`` group (None: a one-rank pipeline or the
            default group).
    """

    pipe: Pipeline
    programs: dict[int, StagePrograms]
    stages: tuple[int, ...]
    stage_to_rank: tuple[int, ...]
    pp_rank: int = 0
    pp_group: Any = None

    @property
    def n_ranks(self) -> int:
        return max(self.stage_to_rank) + 1

    def region(self, stage: int, path: str) -> tuple[slice, ...]:
        """The box of the full leaf ``path`` this rank holds for ``stage``."""
        prog = self.programs[stage]
        shape, offset = prog.local_shape(path), list(prog.local_offset(path))
        if path in prog.stage.layer_ranges:
            offset[0] += prog.stage.layer_ranges[path][0]
        return tuple(slice(o, o + n) for o, n in zip(offset, shape))

    def regions(self, stage: int) -> dict[str, tuple[slice, ...]]:
        return {p: self.region(stage, p) for p in self.pipe.stages[stage].param_paths}

    def from_source(self, source: Source) -> dict:
        """This rank's local tree, built by ``source`` one stage at a time (a stacked leaf has
        another region in each stage): nothing else of the model is made."""
        out = {}
        for s in self.stages:
            got = source(self.regions(s))
            out[stage_key(s)] = nest({p: got[p].detach().clone().contiguous() for p in self.pipe.stages[s].param_paths})
        return out

    def scatter(self, params: PyTree) -> dict:
        """This rank's local tree from the full parameter tree (copies: the full tree can be freed)."""
        return self.from_source(tree_source(params))

    def held(self, params_local: dict) -> dict[int, dict[str, torch.Tensor]]:
        """``stage -> {path: tensor}`` from a local tree."""
        out = {}
        for s in self.stages:
            flat = dict(flatten_with_paths(params_local[stage_key(s)]))
            out[s] = {p: flat[p] for p in self.pipe.stages[s].param_paths}
        return out

    def gather(self, params_local: dict) -> PyTree:
        """The full parameter tree on every rank: each stage's ranks all-gather its blocks over
        the stage's mesh, then its pp rank broadcasts the stage's tensors over ``pp``."""
        mine = self.held(params_local)
        held = {}
        device = next((t.device for p in mine.values() for t in p.values()), torch.device("cpu"))
        for s, stage in enumerate(self.pipe.stages):
            owner = self.stage_to_rank[s]
            tensors = {}
            for p in stage.param_paths:
                if owner == self.pp_rank:
                    t = self._stage_tensor(s, p, mine[s][p])
                else:
                    t = stage.param_specs[p].empty(device)
                if self.n_ranks > 1:
                    dist.broadcast(t, group=self.pp_group, group_src=owner)
                tensors[p] = t
            held[s] = tensors
        return merge_params(held, self.pipe)

    def _stage_tensor(self, stage: int, path: str, block: torch.Tensor) -> torch.Tensor:
        prog = self.programs[stage]
        if prog.mesh is None:
            return block.contiguous()
        spec = prog.stage_global(path)
        dt = DTensor.from_local(block, prog.mesh.device_mesh, prog.layout.stored[path], run_check=False,
                                shape=torch.Size(spec.shape), stride=contiguous_stride(spec.shape))
        return dt.full_tensor().contiguous()

    def gather_state(self, opt_state: Any) -> Any:
        """``opt_state`` with every tree shaped like the local params (AdamW's ``mu``, ``nu``)
        replaced by the full tree, on every rank."""
        return map_local_trees(self.gather, opt_state, self.stages)

    def scatter_state(self, opt_state_full: Any, params: PyTree) -> Any:
        """Inverse of :meth:`gather_state`: each full-params-shaped tree cut to this rank's blocks."""
        return map_full_trees(self.scatter, opt_state_full, params)

    def checkpoint_blocks(self, params_local: dict) -> PyTree:
        """The full parameter tree's structure with this rank's blocks at each leaf, as
        :class:`~shardfn.runtime.checkpoint_blocks.Blocks` (none where other ranks hold the
        leaf; a tied leaf's copies on one rank give one block): what a save writes and a load
        fills in place. No communication; replicas of a block on other ranks are deduplicated by
        the checkpoint writer.

            blocks = layout.checkpoint_blocks(params_local)  # Blocks(shape=(L, D, H), blocks=[((0, 0, 0), w)])
        """
        from shardfn.runtime.checkpoint_blocks import Blocks

        held = self.held(params_local)
        leaves = []
        for path, spec in self.pipe.param_specs.items():
            blocks, seen = [], set()
            for s in self.stages:
                if path in held[s]:
                    offsets = tuple(r.start for r in self.region(s, path))
                    if offsets not in seen:
                        seen.add(offsets)
                        blocks.append((offsets, held[s][path]))
            leaves.append(Blocks(spec.shape, spec.dtype, blocks))
        return tree_unflatten(self.pipe.param_treedef, leaves)

    def from_blocks(self, blocks_tree: PyTree) -> dict:
        """Inverse of :meth:`checkpoint_blocks`: the local tree of the blocks' tensors."""
        by_path = dict(zip(self.pipe.param_specs, tree_flatten(blocks_tree)[0]))
        out, taken = {}, set()
        for s in self.stages:
            flat = {}
            for p in self.pipe.stages[s].param_paths:
                t = by_path[p].block_at(tuple(r.start for r in self.region(s, p)))
                flat[p] = t.clone() if id(t) in taken else t  # a tied leaf's second copy on this rank
                taken.add(id(t))
            out[stage_key(s)] = nest(flat)
        return out

    def state_blocks(self, opt_state: Any) -> Any:
        """``opt_state`` with every local-params-shaped tree (AdamW's ``mu``, ``nu``) as :meth:`checkpoint_blocks`."""
        return map_local_trees(self.checkpoint_blocks, opt_state, self.stages)

    def state_from_blocks(self, opt_state_blocks: Any, params_blocks: PyTree) -> Any:
        """Inverse of :meth:`state_blocks`."""
        return map_full_trees(self.from_blocks, opt_state_blocks, params_blocks)


def _map_trees(fn, state: Any, match) -> Any:
    """``fn`` applied to every sub-tree of ``state`` (NamedTuples, tuples, lists, dicts) where ``match`` holds."""
    if match(state):
        return fn(state)
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*[_map_trees(fn, s, match) for s in state])
    if isinstance(state, (tuple, list)):
        return type(state)(_map_trees(fn, s, match) for s in state)
    if isinstance(state, dict):
        return {k: _map_trees(fn, v, match) for k, v in state.items()}
    return state


def map_local_trees(fn, state: Any, stages) -> Any:
    """``fn`` on every sub-tree shaped like a local parameter tree (``{"stage<s>": ...}`` of ``stages``)."""
    keys = set(map(stage_key, stages))
    return _map_trees(fn, state, lambda t: isinstance(t, dict) and t and set(t) == keys)


def map_full_trees(fn, state: Any, params: PyTree) -> Any:
    """``fn`` on every sub-tree shaped like the full parameter tree ``params``."""
    treedef = tree_flatten(params)[1]
    return _map_trees(fn, state, lambda t: isinstance(t, dict) and tree_flatten(t)[1] == treedef)
