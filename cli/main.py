"""The ``shardfn`` command line: the table of subcommands and the dispatcher.

    shardfn train                                   # llama_tiny on the embedded corpus, on CPU
    shardfn train --config llama_tiny train.steps=50 --metrics metrics.jsonl
    shardfn params --config llama3_8b --json        # {"total": ..., "active": ...}

Each subcommand is one module of ``shardfn.cli`` (``train``, ``params``, ``inspect``, ``plan``,
``schedule``, ``export``) with ``add_arguments(parser)`` and ``run(args) -> exit code``.
:data:`SUBCOMMANDS` names them as ``"module:function"`` strings, so only the subcommand being run
is imported: ``shardfn params`` loads the config and the model, and of the partitioner only the
layout facts a config is checked against, never trace, propagate or lower
(``tests/test_namespace.py``).

Exit codes: 0 success, 1 a failure while running, 2 a usage or config error (message on stderr),
130 interrupted (Ctrl-C). A failure prints one line; ``shardfn --debug SUBCOMMAND ...`` (or
``SHARDFN_DEBUG=1``) prints its traceback as well.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, NamedTuple, Sequence, Union

import shardfn
from shardfn.cli.common import UsageError


class Subcommand(NamedTuple):
    help: str
    add_arguments: Union[Callable[[argparse.ArgumentParser], None], str]  # or "module:function"
    run: Union[Callable[[argparse.Namespace], int], str]  # returns the exit code


# ----------------------------------------------------------------------------- dispatch

SUBCOMMANDS: dict[str, Subcommand] = {
    name: Subcommand(help, f"shardfn.cli.{name}:add_arguments", f"shardfn.cli.{name}:run")
    for name, help in {
        "train": "train a model (default: llama_tiny on the embedded corpus, one CPU device)",
        "params": "count a model's parameters from shapes only (no allocation)",
        "schedule": "print a pipeline schedule's action table, bubble and peak in-flight microbatches",
        "inspect": "lower a config's train step on a simulated mesh; print its collectives and memory per rank",
        "plan": "plan memory, collectives and step time per rank at any scale; --search for layouts that fit",
        "export": "write a training checkpoint (any layout) as a Hugging Face directory: safetensors, config.json",
    }.items()
}
"""Subcommand name -> its help line and its module's functions (imported when that subcommand runs)."""


def register_subcommand(name: str, help: str, add_arguments, run) -> None:
    """Add ``shardfn NAME``; ``add_arguments``/``run`` are callables or ``"module:function"`` strings.

    Example:
        register_subcommand("hello", "say hello", "mypkg.hello:add_arguments", "mypkg.hello:run")
    """
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


def _resolve(fn):
    if callable(fn):
        return fn
    module, _, attr = fn.partition(":")
    return getattr(importlib.import_module(module), attr)


DEBUG_ENV = "SHARDFN_DEBUG"
"""Set to 1 for what ``--debug`` does: a failure's traceback, not just its message."""

DEBUG_HELP = f"on a failure, print its traceback (the ranks' too) as well as its message; or set {DEBUG_ENV}=1"


def debug_requested() -> bool:
    """True when ``SHARDFN_DEBUG`` is set to anything but empty or 0."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _top_help() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [f"usage: shardfn [--debug] {{{','.join(SUBCOMMANDS)}}} [options]", "",
             "shardfn: JAX-style functional PyTorch.", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {sub.help}" for name, sub in SUBCOMMANDS.items()]
    lines += ["", "options:", f"  --debug  {DEBUG_HELP}",
              "", "Run `shardfn SUBCOMMAND --help` for its options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardfn`` console script; returns the exit code.

    Example:
        main(["params", "--config", "llama_tiny", "--json"])  # prints {"total": ..., "active": ...}
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = ["shardfn", *argv]
    debug = debug_requested()
    while argv and argv[0] == "--debug":
        debug = True
        argv.pop(0)
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
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    args = parser.parse_intermixed_args(argv[1:])  # argparse exits 2 itself on bad options
    args.debug = debug or args.debug
    args.command = command  # as typed, for messages that say how to run it again
    try:
        return int(_resolve(sub.run)(args) or 0)
    except UsageError as e:
        print(f"shardfn {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"shardfn {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failure, not a mistake: its message, and how to see where it came from
        if args.debug:
            raise
        print(f"shardfn {name}: {type(e).__name__}: {e}\n(for the traceback: shardfn --debug {name} ..., or "
              f"{DEBUG_ENV}=1)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
