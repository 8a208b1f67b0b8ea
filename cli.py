"""The ``shardfn`` command line.

    shardfn train                                   # llama_tiny on the embedded corpus, on CPU
    shardfn train --config llama_tiny train.steps=50 --metrics metrics.jsonl
    shardfn params --config llama3_8b --json        # {"total": ..., "active": ...}

Subcommands live in :data:`SUBCOMMANDS`, one line each: a help string, a function adding the
subcommand's arguments to its ``argparse`` parser, and a function running it (returning the exit
code). Either function may be given as ``"module:function"``; only the subcommand being run is
imported, so ``shardfn params`` never loads the partitioner.

    SUBCOMMANDS["plan"] = Subcommand("print a sharding plan", "shardfn.partition.cli:plan_args", "shardfn.partition.cli:plan")

Exit codes: 0 success, 1 a failure while running, 2 a usage or config error (message on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable, NamedTuple, Sequence, Union

import shardfn


class Subcommand(NamedTuple):
    help: str
    add_arguments: Union[Callable[[argparse.ArgumentParser], None], str]  # or "module:function"
    run: Union[Callable[[argparse.Namespace], int], str]  # returns the exit code


class UsageError(Exception):
    """A mistake in the command line or config; reported on stderr with exit code 2."""


# ----------------------------------------------------------------------------- shared arguments


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and trailing ``section.key=value`` overrides (for any subcommand).

    Example:
        add_config_arguments(parser); cfg = config_from_args(parser.parse_args(argv))
    """
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML run config, or the name of a packaged one (default: llama_tiny)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override config keys, e.g. train.steps=50 model.n_layers=2")


def config_from_args(args: argparse.Namespace):
    """The validated run config for ``--config`` and the overrides; a bad key is a :class:`UsageError`.

    Example:
        cfg = config_from_args(parser.parse_args(["--config", "llama_tiny", "train.steps=5"]))
    """
    from shardfn.core.config import load_config

    try:
        return load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None


# ----------------------------------------------------------------------------- train


def _train_arguments(parser: argparse.ArgumentParser) -> None:
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
    from shardfn.core.config import config_from_dict
    from shardfn.runtime.train import train

    train(config_from_dict(cfg_dict), metrics_path=metrics, log=lambda line: print(line, flush=True), trace_dir=trace)


def _train(args: argparse.Namespace) -> int:
    import os

    from shardfn.runtime.checkpoint import resume_path
    from shardfn.runtime.train import train

    if args.resume:
        args.overrides = [*args.overrides, "train.checkpoint.resume=true"]
    cfg = config_from_args(args)
    try:
        resume_path(cfg)  # --resume with nothing to resume, or a pipeline run: a usage error, before any launch
    except ValueError as e:
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


# ----------------------------------------------------------------------------- params


def _params_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help='print {"total": N, "active": N}')


def _params(args: argparse.Namespace) -> int:
    from shardfn import models

    cfg = config_from_args(args)
    counts = models.get(cfg.model_name).param_counts(cfg.model)
    out = {"total": int(counts["total"]), "active": int(counts["active"])}
    if args.json:
        print(json.dumps(out))
    else:
        for name, n in out.items():
            print(f"{name:<7}{_human(n):>9}  ({n:,})")
    return 0


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


# ----------------------------------------------------------------------------- dispatch

SUBCOMMANDS: dict[str, Subcommand] = {
    "train": Subcommand("train a model (default: llama_tiny on the embedded corpus, one CPU device)", _train_arguments, _train),
    "params": Subcommand("count a model's parameters from shapes only (no allocation)", _params_arguments, _params),
}


def register_subcommand(name: str, help: str, add_arguments, run) -> None:
    """Add ``shardfn NAME``; ``add_arguments``/``run`` are callables or ``"module:function"`` strings.

    Example:
        register_subcommand("plan", "print a sharding plan", "shardfn.partition.cli:plan_args", "shardfn.partition.cli:plan")
    """
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


register_subcommand(
    "schedule", "print a pipeline schedule's action table, bubble and peak in-flight microbatches",
    "shardfn.runtime.schedule_cli:add_arguments", "shardfn.runtime.schedule_cli:run",
)
register_subcommand(
    "inspect", "lower a config's train step on a simulated mesh; print its collectives and memory per rank",
    "shardfn.runtime.inspect_cli:add_arguments", "shardfn.runtime.inspect_cli:run",
)
register_subcommand("plan", "plan memory, collectives and step time per rank at any scale; --search for layouts that fit", "shardfn.runtime.plan_cli:add_arguments", "shardfn.runtime.plan_cli:run")


def _resolve(fn):
    if callable(fn):
        return fn
    module, _, attr = fn.partition(":")
    return getattr(importlib.import_module(module), attr)


def _top_help() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [f"usage: shardfn {{{','.join(SUBCOMMANDS)}}} [options]", "",
             "shardfn: JAX-style functional PyTorch.", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {sub.help}" for name, sub in SUBCOMMANDS.items()]
    lines += ["", "Run `shardfn SUBCOMMAND --help` for its options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardfn`` console script; returns the exit code.

    Example:
        main(["params", "--config", "llama_tiny", "--json"])  # prints {"total": ..., "active": ...}
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"shardfn {shardfn.__version__}")
        return 0
    name = argv[0]
    if name not in SUBCOMMANDS:
        print(f"shardfn: error: unknown subcommand {name!r}; valid subcommands: {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return 2
    sub = SUBCOMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"shardfn {name}", description=sub.help)
    _resolve(sub.add_arguments)(parser)
    args = parser.parse_intermixed_args(argv[1:])  # argparse exits 2 itself on bad options
    try:
        return int(_resolve(sub.run)(args) or 0)
    except UsageError as e:
        print(f"shardfn {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
