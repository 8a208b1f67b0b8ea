"""A run's identity and its resume policy: where its checkpoints live and which one it starts from.

A run whose ``train.checkpoint.dir`` is null keeps its checkpoints in its own directory,
``runs/<config name>-<run id>`` (:func:`run_directory`), the id a hash of the keys that change
what it computes; :func:`resume_path` picks the checkpoint ``train.checkpoint.resume`` asks for,
and :func:`check_resume` refuses one of another model and lists what else changed. The storage
itself (save, load, the layout on disk) is ``runtime.checkpoint``.

    cfg = with_run_directory(load_config("llama_tiny", ["train.checkpoint.every=50"]))
    found = resume_path(cfg.train.checkpoint)            # None: start at step 0
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from shardfn.runtime.checkpoint import latest_checkpoint, read_meta
from shardfn.runtime.errors import RunError

RUNS_DIR = "runs"
"""Where runs keep their checkpoints when ``train.checkpoint.dir`` is null (:func:`run_directory`)."""

NOT_IN_RUN_ID = ("train.steps", "train.log_every", "train.compile", "train.remat", "train.nonfinite",
                 "train.checkpoint")
"""Keys of the ``model``, ``train`` and ``data`` sections that do not name a run: a run continued
with more steps, other logging, compiled, recomputing activations, or with another NaN policy
is the same run. The
sections the layout lives in (``mesh``, ``rules``, ``pipeline``, ``partition``, ``runtime``) do
not name it either: a checkpoint loads under any layout, and the loss curve is the same on every
mesh."""

MUST_MATCH = ("model",)
"""Config sections a resumed run must share with the run that saved the checkpoint."""

NOT_COMPARED = ("train.checkpoint.dir", "train.checkpoint.resume", "runtime")
"""Keys a resume does not report as changed: where the checkpoint is, how it was asked for, and
how this machine runs the step."""


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def run_id(config: dict) -> str:
    """Eight hex digits naming a run: a hash of its ``model``, ``train`` and ``data`` keys, less
    :data:`NOT_IN_RUN_ID` and the null ones (so a key added later with a null default leaves the
    ids of earlier runs as they were). Two configs with the same id train the same parameters
    step for step.

    Example:
        run_id(load_config("llama_tiny").to_dict())   # e.g. 'd54c2a53'; another train.lr, another id
    """
    keys = {k: v for k, v in _flat({s: config.get(s, {}) for s in ("model", "train", "data")}).items()
            if v is not None and not _under(k, NOT_IN_RUN_ID)}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:8]


def run_directory(cfg) -> str:
    """``train.checkpoint.dir``, or when it is null the run's own: ``runs/<config name>-<run_id>``.

    The config name is the YAML file's stem (``llama_tiny``), or the model name for a config built
    from a mapping. A new run of other hyperparameters gets a new directory, so it never resumes
    an unrelated run's checkpoint; the same command finds its own again.

    Example:
        run_directory(load_config("llama_tiny", ["train.checkpoint.every=50"]))  # 'runs/llama_tiny-d54c2a53'
    """
    if cfg.train.checkpoint.dir is not None:
        return cfg.train.checkpoint.dir
    name = Path(cfg.source).stem if cfg.source else cfg.model_name.removesuffix(".py").replace("/", ".").rsplit(".")[-1]
    return f"{RUNS_DIR}/{name}-{run_id(cfg.to_dict())}"


def with_run_directory(cfg):
    """``cfg`` with ``train.checkpoint.dir`` set to :func:`run_directory` (a copy; ``cfg`` is unchanged).

    Example:
        cfg = with_run_directory(load_config("llama_tiny"))
        cfg.train.checkpoint.dir  # 'runs/llama_tiny-d54c2a53'
    """
    if cfg.train.checkpoint.dir is not None:
        return cfg
    ckpt = dataclasses.replace(cfg.train.checkpoint, dir=run_directory(cfg))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, checkpoint=ckpt))


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}" if math.isfinite(value) else str(value)
    return str(value)


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """``[(key, saved value, this run's value)]`` for every dotted config key that differs, sorted
    (the keys in :data:`NOT_COMPARED` left out; a key one side lacks counts as null, so a key
    added later with a null default is no change).

    Example:
        config_changes(read_meta(path)["config"], cfg.to_dict())  # [('train.lr', 0.003, 0.001)]
    """
    a, b = _flat(saved), _flat(current)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if not _under(k, NOT_COMPARED) and a.get(k) != b.get(k)]


def check_resume(path: str | os.PathLike, config: dict) -> list[str]:
    """Check that this run (``config``: ``RunConfig.to_dict()``) may resume the checkpoint at
    ``path``; return what changed since it was saved, as ``"train.lr 0.003 -> 0.001"`` strings.

    Raises:
        RunError: a key of :data:`MUST_MATCH` that both configs have differs (the state is
            another model's), naming each. A key only this run has was added since the
            checkpoint was saved: it is listed as a change, and the state's shapes are still
            checked on load.

    Example:
        check_resume(latest_checkpoint("runs/x"), cfg.to_dict())  # ['train.steps 200 -> 400']
    """
    saved = read_meta(path).get("config")
    if not saved:
        return []
    changes = config_changes(saved, config)
    known = _flat(saved)  # a key the saved run did not have (added since) is a change, not another model
    wrong = [(k, old, new) for k, old, new in changes if _under(k, MUST_MATCH) and k in known]
    if wrong:
        keys = "; ".join(f"{k} is {_show(old)} there and {_show(new)} here" for k, old, new in wrong)
        raise RunError(f"checkpoint {path} holds another model: {keys}. Resume it with the model it was "
                       f"saved with (its meta.json holds the config), or leave train.checkpoint.dir unset "
                       f"(each run gets its own directory) or point it at a fresh one to start a new run")
    return [f"{k} {_show(old)} -> {_show(new)}" for k, old, new in changes]


def resume_path(ckpt) -> Path | None:
    """The checkpoint a run starts from, by its checkpoint section's ``resume``, or None (step 0).

    ``ckpt`` is the run config's ``train.checkpoint`` section (``every``, ``dir``, ``resume``).
    ``auto`` (the default): the newest complete checkpoint in ``dir`` when checkpointing is on
    (``every > 0``), so a rerun of a killed job continues it. ``true`` (``shardfn train
    --resume``): that checkpoint, and an error if there is none. ``false``: step 0, and an error
    if the directory already holds checkpoints (the new ones would mix with them).

    Example:
        resume_path(load_config(None, ["train.checkpoint.every=50"]).train.checkpoint)  # None on a first run
    """
    if ckpt.dir is None:
        raise ValueError("train.checkpoint.dir is null: give the run's directory (with_run_directory(cfg) "
                         "sets it from the config)")
    if ckpt.resume is True:
        found = latest_checkpoint(ckpt.dir)
        if found is None:
            raise ValueError(f"train.checkpoint.resume=true (--resume), but train.checkpoint.dir={ckpt.dir!r} "
                             f"holds no complete checkpoint; point it at the run's directory, or start "
                             f"without --resume")
        return found
    if not ckpt.every:
        return None
    found = latest_checkpoint(ckpt.dir)
    if ckpt.resume is False and found is not None:
        raise ValueError(f"train.checkpoint.resume=false, but train.checkpoint.dir={ckpt.dir!r} holds "
                         f"checkpoints of an earlier run (newest: {found.name}); delete them, choose a fresh "
                         f"train.checkpoint.dir, or resume (train.checkpoint.resume=auto)")
    return found
