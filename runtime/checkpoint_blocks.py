"""Blocks of a global tensor in a DCP state dict: how a rank saves and loads just its slices.

A DTensor tells DCP which chunk of the global tensor a rank holds; a pipeline rank's state is
not a DTensor (its stages hold contiguous layer ranges of stacked leaves, of any lengths, and
each leaf only on the ranks of its stage). :class:`Blocks` says the same thing directly: the
global shape and dtype, and the ``(offsets, tensor)`` blocks this rank holds (none on ranks
without the leaf, several with virtual stages). The two planners below hand those blocks to
DCP as chunk writes and chunk reads, so a save writes each block once (replicas over ``dp``
are deduplicated by DCP) and a load reads each block from whatever chunks the checkpoint has.
Plain tensors and DTensors in the same state dict are handled as DCP always does.

    sd = {"params.layers.w": Blocks((8, 4, 4), torch.float32, [((2, 0, 0), w_local)])}
    dcp.save(sd, storage_writer=writer, planner=BlocksSavePlanner())
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclasses.dataclass
class Blocks:
    """This rank's blocks of one global tensor: ``[(offsets, tensor), ...]`` (possibly empty).

    Example:
        Blocks((8, 16), torch.float32, [((4, 0), w[4:8])])  # rows 4..7 of an [8, 16] tensor
    """

    shape: torch.Size
    dtype: torch.dtype
    blocks: list[tuple[tuple[int, ...], torch.Tensor]]

    def __post_init__(self):
        self.shape = torch.Size(self.shape)
        for offsets, t in self.blocks:
            outside = any(o < 0 or o + n > s for o, n, s in zip(offsets, t.shape, self.shape))
            if len(offsets) != len(self.shape) or outside:
                raise ValueError(f"a block of shape {tuple(t.shape)} at {tuple(offsets)} lies outside "
                                 f"{tuple(self.shape)}")
            if t.dtype != self.dtype:
                raise ValueError(f"a block is {t.dtype}, the tensor {self.dtype}")

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.blocks]

    def block_at(self, offsets: Sequence[int]) -> torch.Tensor:
        offsets = tuple(offsets)
        return next(t for o, t in self.blocks if tuple(o) == offsets)


def _split(state_dict: dict) -> tuple[dict, dict]:
    blocks = {k: v for k, v in state_dict.items() if isinstance(v, Blocks)}
    return {k: v for k, v in state_dict.items() if k not in blocks}, blocks


class BlocksSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus one chunk write per block of each :class:`Blocks`."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        rest, self.blocks = _split(state_dict)
        super().set_up_planner(rest, storage_meta, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [
            WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape),
                                                  properties=TensorProperties.create_from_tensor(t), size=b.shape))
            for fqn, b in self.blocks.items() for o, t in b.blocks
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.blocks:
            return self.blocks[index.fqn].block_at(index.offset).contiguous()
        return super().lookup_object(index)


class BlocksLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus chunk reads into the blocks of each :class:`Blocks` (in place)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        rest, self.blocks = _split(state_dict)
        super().set_up_planner(rest, metadata, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [item for fqn, b in self.blocks.items() if b.blocks
                 for item in create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], b.chunks())]
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.blocks:
            return self.blocks[index.fqn].block_at(index.offset)
        return super().lookup_tensor(index)
