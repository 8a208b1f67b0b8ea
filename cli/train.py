"""``shardfn train``: train a run config on one device, on spawned gloo ranks, or under torchrun.

    shardfn train                                         # llama_tiny on the embedded corpus
    shardfn train --nproc 4 mesh.dp=2 mesh.tp=2 --metrics m.jsonl
    shardfn train --config moe_tiny --nproc 4 --search    # the layout `shardfn plan --search` ranks first

What the config asks for is checked here, once, before any rank is spawned: the layout, the data
file, the ``train.init_from`` directory, and the checkpoint a run would resume (its model must
be this run's). A mistake found later -- a NaN loss, say -- is one message naming the rank
(exit code 2); a failure is one message naming the rank (exit code 1), with the ranks'
tracebacks under ``shardfn --debug``; Ctrl-C stops every rank and says how to resume (exit code
130).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from shardfn.cli.common import UsageError, add_config_arguments, config_from_args

INTERRUPTED = 130
"""The exit code after Ctrl-C (128 + SIGINT), as shells report it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--metrics", metavar="FILE", default=None,
                        help="write one JSON object per step (step, loss, grad_norm, lr, tokens_per_s, time_s)")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="mesh.pp > 1: write the last step's real action timings as a Chrome trace")
    parser.add_argument("--resume", action="store_true",
                        help="resume from the newest complete checkpoint in train.checkpoint.dir; an error if "
                             "there is none (without it, train.checkpoint.resume decides: by default a run "
                             "with train.checkpoint.every > 0 resumes when the directory holds one)")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="spawn N local gloo ranks (default: runtime.nproc, else the mesh size, the product "
                             "of the mesh axes); under torchrun the launcher's ranks are used")
    parser.add_argument("--search", action="store_true",
                        help="lay the run out on --nproc devices as `shardfn plan --search` ranks first (its "
                             "estimate on --hardware: mesh, pipeline schedule and microbatches, remat), then "
                             "train that layout")
    parser.add_argument("--hardware", default=None, metavar="NAME",
                        help="--search: the hardware profile the estimate prices (default: cpu when "
                             "runtime.device is cpu; a profile name or YAML path)")


def _train_rank(cfg_dict: dict, metrics: str | None, trace: str | None = None) -> None:
    from shardfn.config import config_from_dict
    from shardfn.runtime.train import train

    train(config_from_dict(cfg_dict), metrics_path=metrics, log=lambda line: print(line, flush=True), trace_dir=trace)


def check_before_launch(cfg) -> None:
    """Raise :class:`UsageError` for what would fail in every rank: a layout that cannot run, a
    missing or too short data file, a ``train.init_from`` that is not a Hugging Face directory,
    ``--resume`` with nothing to resume, or a checkpoint to resume that holds another model.

    ``cfg.train.checkpoint.dir`` must be set (``run_identity.with_run_directory``).

    Example:
        check_before_launch(with_run_directory(load_config(None, ["data.path=missing.txt"])))  # UsageError
    """
    from shardfn import models
    from shardfn.partition.errors import LayoutError
    from shardfn.partition.layouts.axes import check_run
    from shardfn.runtime import data, run_identity

    try:  # a layout that cannot run
        check_run(models.get(cfg.model_name), cfg)
    except LayoutError as e:
        raise UsageError(str(e)) from None
    try:
        tokens = data.from_config(cfg.data)
        data.get_batch(tokens, 0, batch_size=1, seq_len=cfg.train.seq_len)  # the data holds one row
        if cfg.train.init_from:
            from shardfn.models import hf

            hf_config = hf.read_dir(cfg.train.init_from).config()  # shard headers only, no tensor is read
            if hf_config is not None:
                hf.check_hf_config(hf_config, cfg.model_name, cfg.model,
                                   source=os.path.join(cfg.train.init_from, "config.json"))
        found = run_identity.resume_path(cfg.train.checkpoint)  # --resume with nothing to resume
        if found is not None:
            run_identity.check_resume(found, cfg.to_dict())  # a checkpoint of another model
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from shardfn.runtime.errors import RunError
    from shardfn.runtime.run_identity import with_run_directory
    from shardfn.runtime.train import train

    if args.resume:
        args.overrides = [*args.overrides, "train.checkpoint.resume=true"]
    if args.search:
        args.overrides = [*args.overrides, *searched_layout(config_from_args(args), args.nproc, args.hardware)]
    cfg = with_run_directory(config_from_args(args))  # train.checkpoint.dir null: this run's own
    check_before_launch(cfg)
    if args.trace and cfg.mesh.pp == 1:
        raise UsageError(f"--trace {args.trace} records pipeline schedules: set mesh.pp > 1, or drop --trace")
    world = cfg.mesh.world_size
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}; it is the number of local ranks to spawn")
    nproc = args.nproc or cfg.runtime.nproc or world
    if nproc != world:
        raise UsageError(f"--nproc {nproc} but the mesh has {_devices(world)}; make them equal")
    debug = getattr(args, "debug", False)
    try:
        if "RANK" in os.environ or nproc == 1:  # under torchrun, or one device
            try:
                train(cfg, metrics_path=args.metrics, log=lambda line: print(line, flush=True), trace_dir=args.trace)
            except RunError as e:
                if debug:
                    raise
                raise UsageError(str(e)) from None
            return 0
        from shardfn.runtime.launch import RankFailed, spawn

        try:
            spawn(_train_rank, nproc, args=(cfg.to_dict(), args.metrics, args.trace),
                  timeout_s=cfg.runtime.timeout_s,
                  backend="nccl" if cfg.runtime.device.startswith("cuda") else "gloo")
        except RankFailed as e:
            if e.mistake is not None and not debug:
                raise UsageError(f"rank {e.rank}: {e.mistake}") from None
            if debug:
                print(f"shardfn train: {e}", file=sys.stderr)
            else:
                print(f"shardfn train: {e.summary}\n(for the ranks' tracebacks: shardfn --debug train ..., or "
                      f"SHARDFN_DEBUG=1)", file=sys.stderr)
            return 2 if e.mistake is not None else 1
    except KeyboardInterrupt:
        if debug:
            raise
        print(interrupted_message(cfg, getattr(args, "command", None)), file=sys.stderr)
        return INTERRUPTED
    return 0


def searched_layout(cfg, devices: int | None, hardware: str | None) -> list[str]:
    """The overrides of the layout ``shardfn plan --search`` ranks first for ``cfg`` on
    ``devices`` (``--nproc``, else ``runtime.nproc``), priced on ``hardware`` (default ``cpu``
    for a CPU run); prints the choice and the runner-up. Raises :class:`UsageError` for a mesh
    given beside ``--search``, no device count, or no layout that fits.

    Example:
        searched_layout(load_config("moe_tiny"), 4, None)   # ['mesh.pp=1', 'mesh.dp=1', 'mesh.fsdp=4', ...]
    """
    import torch

    from shardfn import plan as planner

    devices = devices or cfg.runtime.nproc
    if not devices:
        raise UsageError("--search needs --nproc N (or runtime.nproc), the number of devices to lay the run out on")
    given = ", ".join(f"mesh.{a}={n}" for a, n in cfg.mesh.axes().items() if n != 1)
    if given:
        raise UsageError(f"--search chooses the mesh, but the config sets {given}; drop those, or drop --search")
    if hardware is None:
        if not cfg.runtime.device.startswith("cpu"):
            raise UsageError(f"--search on runtime.device={cfg.runtime.device} needs --hardware NAME, the profile "
                             f"its estimate prices (e.g. h100)")
        hardware = "cpu"
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    try:
        result = planner.search(cfg, devices, hardware=hardware, dtype=dtype, top=2)
    except (planner.PlanError, ValueError, FileNotFoundError) as e:
        raise UsageError(f"--search: {e}") from None
    if not result.plans:
        raise UsageError(f"--search: no layout of {_devices(devices)} fits ({len(result.too_big)} too big, "
                         f"{len(result.refused)} refused); see shardfn plan --search --gpus {devices}")
    best = result.ranked[0]
    after = (f"; next {result.ranked[1][1].describe()} at {result.ranked[1][0]:.4g} s"
             if len(result.ranked) > 1 else "")
    print(f"shardfn train --search: {best[1].describe()}, fastest of {result.fitting} layouts that fit on "
          f"{_devices(devices)} by the estimate on {hardware} ({best[0]:.4g} s a step{after})", flush=True)
    return best[1].overrides(cfg.train.remat)


def _devices(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


def interrupted_message(cfg, command: list[str] | None) -> str:
    """The line printed after Ctrl-C: the last complete checkpoint, and the command that resumes it.

    Example:
        interrupted_message(cfg, ["shardfn", "train", "train.checkpoint.every=50"])
        # 'shardfn train: interrupted; the last complete checkpoint is runs/llama_tiny-d54c2a53/step_00000050
        #  (step 50); resume with: shardfn train train.checkpoint.every=50 --resume'
    """
    from shardfn.runtime.checkpoint import latest_checkpoint, read_meta

    ckpt = cfg.train.checkpoint
    if not ckpt.every:
        return ("shardfn train: interrupted; checkpointing is off (train.checkpoint.every=0), so there is "
                "nothing to resume: set train.checkpoint.every=N to save every N steps")
    again = list(command or ["shardfn", "train"])
    last = latest_checkpoint(ckpt.dir)
    if last is None:
        return (f"shardfn train: interrupted before the first checkpoint (every {ckpt.every} steps, in "
                f"{ckpt.dir}); start it again with: {shlex.join(again)}")
    if "--resume" not in again:
        again.append("--resume")
    step = read_meta(last).get("step", "?")
    return (f"shardfn train: interrupted; the last complete checkpoint is {last} (step {step}); resume with: "
            f"{shlex.join(again)}")
