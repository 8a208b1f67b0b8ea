"""``shardfn params``: count a model's parameters from shapes only (nothing is allocated).

    shardfn params --config llama3_8b --json     # {"total": 8030261248, "active": 8030261248}
"""

from __future__ import annotations

import argparse
import json

from shardfn.cli.common import add_config_arguments, config_from_args
from shardfn.core.units import format_count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help='print {"total": N, "active": N}')


def run(args: argparse.Namespace) -> int:
    from shardfn import models

    cfg = config_from_args(args)
    counts = models.get(cfg.model_name).param_counts(cfg.model)
    out = {"total": int(counts["total"]), "active": int(counts["active"])}
    if args.json:
        print(json.dumps(out))
    else:
        for name, n in out.items():
            print(f"{name:<7}{format_count(n):>9}  ({n:,})")
    return 0
