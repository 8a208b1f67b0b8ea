"""Checkpoints: sharded, atomic and reshardable, with ``torch.distributed.checkpoint`` (DCP).

One format for every run. On one device the tensors are plain; on a mesh they are the
partitioned step's DTensors, so every rank writes only its own shards and DCP records each
tensor's global shape and chunks. Loading reads whatever chunks the *target* layout needs, so a
checkpoint saved under one mesh loads under any other mesh, or on one device. Pipeline runs
(``mesh.pp > 1``) hold slices that are not DTensors (a stage's layer range of each stacked
leaf); they save and load them as :class:`~shardfn.runtime.checkpoint_blocks.Blocks`, chunks of
the same global tensors, so their checkpoints load under any layout too.

Layout on disk (``train.checkpoint.dir``; when it is null, the run's own directory
``runs/<config name>-<run id>``, ``runtime.run_identity.run_directory``)::

    step_00000100/            a complete checkpoint (the newest ``train.checkpoint.keep`` are kept)
        .metadata             DCP's index: every key's global shape, dtype and chunks
        __0_0.distcp ...      the shards, one file per rank
        meta.json             step, data position, world size, mesh and the run config
        COMPLETE              written last; a directory without it is never loaded
    step_00000200.tmp/        a save in progress, or one killed midway: ignored, removed later

Keys: ``params.<path>`` and ``opt_state.<path>`` (dotted pytree paths, NamedTuple fields by
name: ``opt_state.1.0.mu.layers.attn.wq``), ``train.step``, ``train.data_position`` (batches
are a pure function of ``(train.seed, step)``, so the position is the step, recorded anyway)
and ``rng.cpu.rank<r>`` (each rank's torch CPU generator state).

A save writes ``step_N.tmp/``; after every rank's shards are written (a barrier) rank 0 writes
``meta.json`` and ``COMPLETE``, renames the directory to ``step_N/`` and only then deletes
checkpoints beyond the newest ``keep``. A save killed at any point leaves the previous
checkpoint complete and newest. Every rank must see the same directory (one machine, or a
shared file system).

    save_checkpoint("runs/ckpt", 100, params, opt_state, keep=2)
    loaded = load_checkpoint(latest_checkpoint("runs/ckpt"), params, opt_state)
    loaded = restore(path, step, params, opt_state)   # a training Step's layout (runtime.step)
    params = load_params(path, model.init(cfg.model, 0, device="meta"))   # whole, in one process
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from shardfn.core.pytree import PyTree
from shardfn.runtime.checkpoint_blocks import Blocks, BlocksLoadPlanner, BlocksSavePlanner

FORMAT = "shardfn.dcp/1"
MARKER = "COMPLETE"
META = "meta.json"
_DIR = re.compile(r"^step_(\d{8})$")
_TMP = re.compile(r"^step_(\d{8})\.tmp$")


class Loaded(NamedTuple):
    """What :func:`load_checkpoint` returns."""

    step: int  # optimizer steps taken
    params: PyTree  # like ``params_like``: plain tensors, or DTensors in its layout
    opt_state: Any  # like ``opt_state_like``
    data_position: int  # the step of the next batch
    rng_state: torch.Tensor | None  # this rank's torch CPU generator state, if saved
    meta: dict  # meta.json


# ----------------------------------------------------------------------------- where


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint after ``step`` steps lives: ``directory/step_00000100``.

    Example:
        checkpoint_path("runs/ckpt", 100)  # PosixPath('runs/ckpt/step_00000100')
    """
    return Path(directory) / f"step_{step:08d}"


def is_complete(path: str | os.PathLike) -> bool:
    """True for a finished save: a ``step_N`` directory with DCP's index and the marker.

    Example:
        is_complete("runs/ckpt/step_00000100.tmp")  # False: a save in progress or killed
    """
    p = Path(path)
    return bool(_DIR.match(p.name)) and (p / MARKER).is_file() and (p / ".metadata").is_file()


def complete_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest first (``.tmp`` and unmarked ones left out).

    Example:
        complete_checkpoints("runs/ckpt")  # [PosixPath('runs/ckpt/step_00000050'), ...]
    """
    d = Path(directory)
    return sorted(p for p in d.iterdir() if is_complete(p)) if d.is_dir() else []


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the most steps in ``directory``, or None.

    Example:
        latest_checkpoint("runs/ckpt")  # PosixPath('runs/ckpt/step_00000100')
    """
    found = complete_checkpoints(directory)
    return found[-1] if found else None


# ----------------------------------------------------------------------------- state dicts


def flat_paths(tree: PyTree, prefix: str) -> list[tuple[str, Any]]:
    """``[(key, leaf), ...]`` in leaf order; NamedTuple fields by name, dict keys as they are.

    Example:
        flat_paths({"w": w}, "params")  # [("params.w", w)]
    """
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    return [(".".join([prefix, *_readable(tree, p)]), leaf) for p, leaf in zip(paths, leaves)]


def _readable(tree: Any, path: tuple) -> list[str]:
    parts, node = [], tree
    for k in path:
        fields = getattr(node, "_fields", None) if isinstance(node, tuple) else None
        parts.append(fields[k] if fields else str(k))
        node = node[k]
    return parts


def state_dict(step: int, params: PyTree, opt_state: Any, *, rank: int = 0,
               rng_state: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The flat DCP state dict of a training state (tensors and DTensors as they are).

    Example:
        sd = state_dict(100, params, opt_state, rng_state=torch.get_rng_state())
        sorted(sd)[:2]  # ['opt_state.0.global_norm', 'opt_state.1.0.count']
    """
    out = {key: leaf for key, leaf in flat_paths(params, "params") + flat_paths(opt_state, "opt_state")}
    out["train.step"] = torch.tensor(step, dtype=torch.int64)
    out["train.data_position"] = torch.tensor(step, dtype=torch.int64)
    if rng_state is not None:
        out[f"rng.cpu.rank{rank}"] = rng_state
    return out


# ----------------------------------------------------------------------------- save


def _distributed() -> bool:
    """Ranks to save and load with: a real process group (a fake one, built to plan a mesh in
    this process, has no other ranks to write their parts)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


@contextlib.contextmanager
def _dcp_call():
    """Around a DCP save or load: its one-process warning is silenced (it is right), and a Ctrl-C
    it caught and wrapped in a ``CheckpointException`` is a ``KeyboardInterrupt`` again, so an
    interrupted save stops the run like any other Ctrl-C (the partial ``.tmp`` is never published)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as e:
            if any(_interrupted(exc) for exc, _ in e.failures.values()):
                raise KeyboardInterrupt from e
            raise


def _interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a Ctrl-C or was raised while handling one: a ``KeyboardInterrupt`` inside
    ``torch.save`` surfaces as the zip writer's ``RuntimeError`` from its ``__exit__``, with the
    interrupt as its context."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def save_checkpoint(directory: str | os.PathLike, step: int, params: PyTree, opt_state: Any, *,
                    keep: int = 2, config: dict | None = None) -> Path:
    """Write the state after ``step`` steps to ``directory/step_N`` atomically; keep the ``keep`` newest.

    Collective on a mesh: every rank calls it with its own (DTensor) trees and writes its own
    shards. ``config`` (``RunConfig.to_dict()``) is recorded in ``meta.json`` so a mismatching
    load can name the config keys that differ.

    Example:
        save_checkpoint("runs/ckpt", 100, params, opt_state, keep=2, config=cfg.to_dict())
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (train.checkpoint.keep), got {keep}")
    final = checkpoint_path(directory, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    _barrier()
    sd = state_dict(step, params, opt_state, rank=rank, rng_state=torch.get_rng_state())
    with _dcp_call():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), planner=_planner(sd, BlocksSavePlanner),
                 no_dist=not _distributed())
    _barrier()  # every rank's shards are on disk
    if rank == 0:
        _write_meta(tmp, step, config)
        _publish(tmp, final)
        _prune(Path(directory), keep)
    _barrier()  # nobody moves on (or saves again) before the checkpoint is in place
    return final


def _planner(sd: dict, with_blocks):
    """DCP's default planner, or the one that also takes :class:`Blocks` when ``sd`` has any."""
    return with_blocks() if any(isinstance(v, Blocks) for v in sd.values()) else None


def _write_meta(tmp: Path, step: int, config: dict | None) -> None:
    meta = {"format": FORMAT, "step": step, "data_position": step, "world_size": _world(),
            "mesh": (config or {}).get("mesh"), "config": config}
    (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
    with open(tmp / MARKER, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():  # the same step saved again (a rerun): the new one wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable
    finally:
        os.close(fd)


def _prune(directory: Path, keep: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep``, and saves that were killed."""
    for old in complete_checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in directory.iterdir():
        if _TMP.match(stale.name):
            shutil.rmtree(stale, ignore_errors=True)


# ----------------------------------------------------------------------------- load


def read_meta(path: str | os.PathLike) -> dict:
    """``meta.json`` of a checkpoint (``{}`` if it has none).

    Example:
        read_meta(latest_checkpoint("runs/ckpt"))["step"]  # 100
    """
    p = Path(path) / META
    return json.loads(p.read_text()) if p.is_file() else {}


def load_checkpoint(path: str | os.PathLike, params_like: PyTree, opt_state_like: Any, *,
                    config: dict | None = None) -> Loaded:
    """The state saved at ``path``, in the layout, dtypes and devices of the ``_like`` trees.

    Plain ``_like`` leaves load the full tensors (one device); DTensor leaves load this rank's
    shards of their layout (collective: every rank calls it), whatever mesh saved them. Keys,
    shapes and dtypes are checked first; a mismatch names the key, and -- when ``config``
    (``RunConfig.to_dict()``) is given -- the model config keys that differ from the saved run's.

    Example:
        loaded = load_checkpoint(latest_checkpoint("runs/ckpt"), params, opt.init(params))
        loaded.step, loaded.params
    """
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker or DCP index); "
                         f"load one of latest_checkpoint({str(path.parent)!r})")
    rank = _rank()
    target = state_dict(0, params_like, opt_state_like)
    target = {k: (v.detach().clone() if not isinstance(v, (DTensor, Blocks)) else v) for k, v in target.items()}
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    meta = read_meta(path)
    check_compatible(path, saved, target, meta, config)
    rng_key = f"rng.cpu.rank{rank}" if f"rng.cpu.rank{rank}" in saved else "rng.cpu.rank0"
    if rng_key in saved:
        target[rng_key] = torch.empty(saved[rng_key].size, dtype=torch.uint8)
    with _dcp_call():
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), planner=_planner(target, BlocksLoadPlanner),
                 no_dist=not _distributed())
    p_leaves, p_def = optree.tree_flatten(params_like, none_is_leaf=False)
    s_leaves, s_def = optree.tree_flatten(opt_state_like, none_is_leaf=False)
    p_keys = [k for k, _ in flat_paths(params_like, "params")]
    s_keys = [k for k, _ in flat_paths(opt_state_like, "opt_state")]
    params = optree.tree_unflatten(p_def, [target[k] for k in p_keys])
    opt_state = optree.tree_unflatten(s_def, [target[k] for k in s_keys])
    return Loaded(int(target["train.step"]), params, opt_state, int(target["train.data_position"]),
                  target.get(rng_key), meta)


def load_params(path: str | os.PathLike, params_like: PyTree, *, config: dict | None = None) -> PyTree:
    """The parameters saved at ``path`` as whole CPU tensors in this process (no optimizer state).

    Every layout's checkpoint holds the same global tensors (plain, a mesh's DTensor shards, or
    pipeline ranks' blocks), so one process reads any of them: DCP assembles each leaf from its
    chunks, without a process group (a rank of a running group reads alone, no collective).
    ``params_like`` gives the tree, shapes and dtypes and is not written into; meta tensors
    (``model.init(cfg, 0, device="meta")``) allocate nothing. Keys, shapes and dtypes are checked
    first, as :func:`load_checkpoint` checks them (``config``: ``RunConfig.to_dict()``, to name
    the model keys that differ).

    Example:
        params = load_params(latest_checkpoint("runs/ckpt"), llama.init(cfg.model, 0, device="meta"))
        params["layers"]["attn"]["wq"].shape  # [L, D, H * head_dim], whatever mesh saved it
    """
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker or DCP index); "
                         f"load one of latest_checkpoint({str(path.parent)!r})")
    keys = flat_paths(params_like, "params")
    target = {k: torch.empty(tuple(v.shape), dtype=v.dtype) for k, v in keys}
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    check_compatible(path, {k: v for k, v in saved.items() if k.startswith("params.")}, target, read_meta(path),
                     config)
    with _dcp_call():
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    _, treedef = optree.tree_flatten(params_like, none_is_leaf=False)
    return optree.tree_unflatten(treedef, [target[k] for k, _ in keys])


def check_compatible(path: Path, saved: dict, target: dict, meta: dict, config: dict | None) -> None:
    """Raise ValueError naming the first key whose presence, shape or dtype differs.

    Example:
        check_compatible(path, reader.read_metadata().state_dict_metadata, state_dict(0, p, s), {}, None)
    """
    hint = _config_hint(meta.get("config"), config)
    fix = (f"{hint}load it with the config it was saved with (its meta.json holds it), or point "
           f"train.checkpoint.dir at a fresh directory to start a new run")
    wanted = [k for k in target if k.startswith(("params.", "opt_state."))]  # params first
    have = sorted(
        (k for k in saved if k.startswith(("params.", "opt_state."))), key=lambda k: not k.startswith("params.")
    )
    for key in (k for k in wanted if k not in saved):
        raise ValueError(f"checkpoint {path} has no {key!r}: it holds the state of a different model or "
                         f"optimizer; {fix}")
    for key in (k for k in have if k not in target):
        raise ValueError(f"checkpoint {path} holds {key!r}, which this run's model and optimizer do not "
                         f"have; {fix}")
    for key in wanted:
        got, like = saved[key], target[key]
        if not isinstance(got, TensorStorageMetadata):
            raise ValueError(f"checkpoint {path}: {key!r} is not a tensor; {fix}")
        if tuple(got.size) != tuple(like.shape):
            raise ValueError(f"checkpoint {path}: {key!r} has shape {tuple(got.size)}, this run's has "
                             f"{tuple(like.shape)}; {fix}")
        if got.properties.dtype != like.dtype:
            raise ValueError(f"checkpoint {path}: {key!r} is {got.properties.dtype}, this run's is "
                             f"{like.dtype}; {fix}")


def _config_hint(saved: dict | None, current: dict | None) -> str:
    """``"model.n_layers is 2 in the checkpoint and 1 here; "`` for the model keys that differ."""
    if not saved or not current:
        return ""
    a, b = saved.get("model", {}), current.get("model", {})
    diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "".join(f"model.{k} is {a.get(k)!r} in the checkpoint and {b.get(k)!r} here; " for k in diff[:3])



def restore(path: str | os.PathLike, step, params: PyTree, opt_state: Any, *, config: dict | None = None) -> Loaded:
    """Load ``path`` into ``step``'s layout and set this rank's CPU RNG state.

    ``params`` and ``opt_state`` are the run's initial state as ``step.place`` laid it out; the
    load fills ``step.to_checkpoint`` of them in place, so each rank reads only what it holds
    (its DTensor shards, or a pipeline rank's stages as blocks), whatever layout saved the
    checkpoint, and ``step.from_checkpoint`` turns that back into the step's state. ``config``
    (``RunConfig.to_dict()``) names the model keys that differ when the checkpoint does not fit.

    Example:
        loaded = restore(resume_path(cfg.train.checkpoint), step, *step.place(params), config=cfg.to_dict())
    """
    params_like, opt_like = step.to_checkpoint(params, opt_state)
    loaded = load_checkpoint(path, params_like, opt_like, config=config)
    if loaded.data_position != loaded.step:
        raise ValueError(f"checkpoint {path}: data position {loaded.data_position} differs from its step "
                         f"{loaded.step}; batches are a pure function of (train.seed, step), so it was not "
                         f"written by this loop: start a fresh train.checkpoint.dir")
    if loaded.rng_state is not None:
        torch.set_rng_state(loaded.rng_state)
    params, opt_state = step.from_checkpoint(loaded.params, loaded.opt_state)
    return loaded._replace(params=params, opt_state=opt_state)
