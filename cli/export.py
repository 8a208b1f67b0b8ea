"""``shardfn export``: a training checkpoint as a Hugging Face directory, in one process.

    shardfn export --checkpoint runs/llama_tiny-d54c2a53 --out llama_tiny_hf/
    shardfn export --checkpoint runs/x/step_00000100 --out hf/ --dtype bfloat16 --max-shard-bytes 5GiB

Every layout saves the same DCP format of global tensors (one device's tensors, a mesh's
DTensor shards, pipeline ranks' blocks: ``runtime/checkpoint.py``), so one process reads any
run's checkpoint whole (``checkpoint.load_params``: no ranks, no process group) and writes it
with ``models.hf.save``: ``*.safetensors``, the index when sharded, and ``config.json``, which
``hf.load`` and ``train.init_from`` read back into the same parameters. The model is the one
in the checkpoint's ``meta.json``; ``--config`` (and overrides) must agree with it on every
``model`` key. The output is written beside ``--out`` and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
from pathlib import Path

from shardfn.cli.common import UsageError

DTYPES = ("float32", "bfloat16")
"""What ``--dtype`` may ask for (default: the dtype the checkpoint holds, float32 master weights)."""

_STEP = re.compile(r"^step_\d{8}$")
_TMP = re.compile(r"^step_\d{8}\.tmp$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML run config, or the name of a packaged one; its model section must be the "
                             "checkpoint's (default: the config saved with the checkpoint)")
    parser.add_argument("--checkpoint", metavar="PATH", required=True,
                        help="a checkpoint (step_N directory), or a checkpoint directory: its newest complete one")
    parser.add_argument("--out", metavar="DIR", required=True,
                        help="the Hugging Face directory to write (absent or empty)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="the dtype of the written weights (default: as saved, float32)")
    parser.add_argument("--max-shard-bytes", metavar="N", default=None,
                        help="split the weights into files of at most N bytes, with an index "
                             "(e.g. 5GiB; default: one model.safetensors)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override config keys (the model keys must still be the checkpoint's)")


def run(args: argparse.Namespace) -> int:
    import torch

    from shardfn import models
    from shardfn.core.pytree import tree_leaves
    from shardfn.core.units import format_count
    from shardfn.models import hf
    from shardfn.runtime import checkpoint

    path = find_checkpoint(args.checkpoint)
    max_shard_bytes = _shard_bytes(args.max_shard_bytes)
    out = _check_out(Path(args.out))
    cfg = export_config(path, args.config, args.overrides)
    try:
        hf.named_model(cfg.model_name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    like = models.get(cfg.model_name).init(cfg.model, 0, device="meta")
    try:
        params = checkpoint.load_params(path, like, config=cfg.to_dict())
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.dtype is not None:
        params = _cast(params, getattr(torch, args.dtype))
    files = _write(out, params, cfg, max_shard_bytes)
    leaves = tree_leaves(params)
    dtype = next((x.dtype for x in leaves if x.is_floating_point()), torch.float32)
    n = sum(x.numel() for x in leaves)
    shards = [f.name for f in files if f.suffix == ".safetensors"]
    written = shards[0] if len(shards) == 1 else f"{len(shards)} safetensors files, {hf.INDEX_FILE}"
    print(f"exported {path} (step {checkpoint.read_meta(path).get('step', '?')}, {cfg.model_name}, "
          f"{format_count(n)} parameters, {str(dtype).removeprefix('torch.')}) to {out}: {written}, config.json")
    return 0


def find_checkpoint(given: str) -> Path:
    """The complete checkpoint ``given`` names: itself (a ``step_N`` directory), or the newest
    complete one in it (a checkpoint directory).

    Raises:
        UsageError: no such path, an incomplete save (``step_N.tmp``, or no ``COMPLETE``
            marker), or a directory that holds no complete checkpoint.

    Example:
        find_checkpoint("runs/llama_tiny-d54c2a53")  # PosixPath('runs/llama_tiny-d54c2a53/step_00000200')
    """
    from shardfn.runtime.checkpoint import MARKER, is_complete, latest_checkpoint

    p = Path(given)
    if not p.exists():
        raise UsageError(f"--checkpoint {given}: no such directory")
    if not p.is_dir():
        raise UsageError(f"--checkpoint {given} is a file; give a checkpoint (step_N directory) or the run's "
                         f"checkpoint directory")
    newest = latest_checkpoint(p.parent) if _STEP.match(p.name) or _TMP.match(p.name) else None
    instead = f"; the newest complete one there is {newest}" if newest is not None else ""
    if _TMP.match(p.name):
        raise UsageError(f"--checkpoint {given} is an incomplete save (a .tmp directory: a save in progress, "
                         f"or one killed midway){instead}")
    if _STEP.match(p.name):
        if not is_complete(p):
            raise UsageError(f"--checkpoint {given} is an incomplete save (no {MARKER} marker or DCP index)"
                             f"{instead}")
        return p
    found = latest_checkpoint(p)
    if found is None:
        partial = sorted(c.name for c in p.iterdir() if _TMP.match(c.name) or _STEP.match(c.name))
        what = f"only incomplete saves ({', '.join(partial)})" if partial else "no step_N directory"
        raise UsageError(f"--checkpoint {given} is not a checkpoint: it holds {what}; give a step_N directory "
                         f"with a {MARKER} marker, or the train.checkpoint.dir of a run that saved one")
    return found


def export_config(path: Path, config: str | None, overrides: list[str]):
    """The run config whose model the checkpoint at ``path`` holds: the one saved with it (plus
    ``overrides``), or ``config`` with ``overrides`` when given, which must agree on every model key.

    Raises:
        UsageError: a bad config, no saved config and no ``config``, or a model key that differs
            from the checkpoint's (naming each).

    Example:
        export_config(Path("runs/x/step_00000100"), None, [])
    """
    from shardfn.config import config_from_dict, load_config
    from shardfn.runtime.checkpoint import META, read_meta
    from shardfn.runtime.run_identity import config_changes

    saved = read_meta(path).get("config")
    if config is None and not saved:
        raise UsageError(f"checkpoint {path} records no config (its {META} has none); give --config with the "
                         f"model it was trained with")
    try:
        cfg = load_config(config, overrides) if config is not None else config_from_dict(saved, overrides)
    except (ValueError, FileNotFoundError) as e:
        where = "" if config is not None else \
            f"the config saved with checkpoint {path}{' with the overrides' if overrides else ''}: "
        raise UsageError(f"{where}{e}") from None
    if saved:
        known = _flat(saved)  # a key only this config has was added since the save: not another model
        wrong = [(k, old, new) for k, old, new in config_changes(saved, cfg.to_dict())
                 if k.startswith("model.") and _known(k, known)]
        if wrong:
            here = f"--config {config}" if config is not None else "the overrides"
            keys = "; ".join(f"{k} is {old!r} in the checkpoint and {new!r} in {here}" for k, old, new in wrong)
            drop = "--config" if config is not None else "those overrides"
            raise UsageError(f"checkpoint {path} holds another model: {keys}. Drop {drop} (the model saved with "
                             f"the checkpoint is used) or make those keys match")
    return cfg


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _known(key: str, known: dict) -> bool:
    """True when ``key`` or a section above it (``model.rope_scaling`` saved as null) was saved."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in known for i in range(2, len(parts) + 1))


def _shard_bytes(text: str | None) -> int | None:
    from shardfn.core.units import parse_bytes

    if text is None:
        return None
    try:
        n = parse_bytes(text, "--max-shard-bytes")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if n < 1:
        raise UsageError(f"--max-shard-bytes must be at least 1 byte, got {text!r}")
    return n


def _check_out(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"--out {out} exists and is not empty; delete it or give a new directory")
    return out


def _cast(params, dtype):
    from shardfn.core.pytree import map_with_path

    return map_with_path(lambda _, x: x.to(dtype) if x.is_floating_point() else x, params)


def _write(out: Path, params, cfg, max_shard_bytes: int | None) -> list[Path]:
    """``hf.save`` into a fresh directory beside ``out``, renamed to ``out`` once complete."""
    from shardfn.models import hf

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        files = hf.save(tmp, params, cfg.model_name, cfg.model, max_shard_bytes=max_shard_bytes)
        os.replace(tmp, out)  # onto an empty directory, or none
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.chmod(out, 0o777 & ~_umask())  # mkdtemp makes it private; give it the usual permissions
    return [out / f.name for f in files] + [out / "config.json"] + [out / hf.INDEX_FILE] * (len(files) > 1)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
