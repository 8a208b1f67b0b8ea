"""``shardfn train``: train a run config on one device, on spawned gloo ranks, or under torchrun.

    shardfn train                                         # llama_tiny on the embedded corpus
    shardfn train --nproc 4 mesh.dp=2 mesh.tp=2 --metrics m.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

from shardfn.cli.common import UsageError, add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--metrics", metavar="FILE", default=None,
                        help="write one JSON object per step (step, loss, grad_norm, lr, tokens_per_s)")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="mesh.pp > 1: write the last step's real action timings as a Chrome trace")
    parser.add_argument("--resume", action="store_true",
                        help="resume from the newest complete checkpoint in train.checkpoint.dir; an error if "
                             "there is none (without it, train.checkpoint.resume decides: by default a run "
                             "with train.checkpoint.every > 0 resumes when the directory holds one)")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="spawn N local gloo ranks (default: runtime.nproc, else 1); under torchrun "
                             "the launcher's ranks are used")


def _train_rank(cfg_dict: dict, metrics: str | None, trace: str | None = None) -> None:
    from shardfn.config import config_from_dict
    from shardfn.runtime.train import train

    train(config_from_dict(cfg_dict), metrics_path=metrics, log=lambda line: print(line, flush=True), trace_dir=trace)


def run(args: argparse.Namespace) -> int:
    from shardfn.runtime.checkpoint import resume_path
    from shardfn.runtime.train import train

    if args.resume:
        args.overrides = [*args.overrides, "train.checkpoint.resume=true"]
    cfg = config_from_args(args)
    try:
        resume_path(cfg.train.checkpoint)  # --resume with nothing to resume: a usage error, before any launch
    except ValueError as e:
        raise UsageError(str(e)) from None
    from shardfn import models
    from shardfn.partition.errors import LayoutError
    from shardfn.partition.layouts import check_run

    try:  # a layout that cannot run is refused here, once, before any rank is spawned
        check_run(models.get(cfg.model_name), cfg)
    except LayoutError as e:
        raise UsageError(str(e)) from None
    if args.trace and cfg.mesh.pp == 1:
        raise UsageError(f"--trace {args.trace} records pipeline schedules: set mesh.pp > 1, or drop --trace")
    world = cfg.mesh.world_size
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}; it is the number of local ranks to spawn")
    nproc = args.nproc or cfg.runtime.nproc or world
    if nproc != world:
        raise UsageError(f"--nproc {nproc} but the mesh has {world} devices; make them equal")
    if "RANK" in os.environ or nproc == 1:  # under torchrun, or one device
        train(cfg, metrics_path=args.metrics, log=lambda line: print(line, flush=True), trace_dir=args.trace)
        return 0
    from shardfn.runtime.launch import RankFailed, spawn

    try:
        spawn(_train_rank, nproc, args=(cfg.to_dict(), args.metrics, args.trace), timeout_s=cfg.runtime.timeout_s)
    except RankFailed as e:
        print(f"shardfn train: {e}", file=sys.stderr)
        return 1
    return 0
