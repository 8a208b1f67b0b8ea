"""What every subcommand shares: the config arguments and the usage error (exit code 2).

    add_config_arguments(parser); cfg = config_from_args(parser.parse_args(argv))
"""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A mistake in the command line or config; reported on stderr with exit code 2."""


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
    from shardfn.config import load_config

    try:
        return load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
