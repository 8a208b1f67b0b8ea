"""Write one benchmark's section of benchmarks/RESULTS.md from the JSON the benchmark wrote.

Each section sits between ``<!-- begin NAME -->`` and ``<!-- end NAME -->`` (NAME: the JSON's
file name without ``.json``) and holds the date, the machine, the command and the JSON's path,
the JSON's top-level numbers and strings (its setup), then a table of its rows: a list of objects
(``results``, ``rows``, or the first such list), or else objects keyed by name, one row each:
the first top-level object of objects (``{"sizes": {"S": {...}, "M": {...}}}``), or the top-level
objects themselves (``{"dp2": {...}, "fsdp2": {...}}``). Only
numbers, strings and booleans become cells. A rerun replaces the section; nothing else in the
file changes.

    python benchmarks/bench_memory.py
    python benchmarks/results_md.py benchmarks/results/bench_memory.json --command "python benchmarks/bench_memory.py"
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
from pathlib import Path

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    """This machine in a few words: CPU model, cores, OS; the GPU when torch sees one."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    words = f"{cpu}, {os.cpu_count()} cores, {platform.system()}"
    try:
        import torch

        words += f", torch {torch.__version__}"
        if torch.cuda.is_available():
            words += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return words


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows: list[dict]) -> str:
    """Rows of flat objects as a Markdown table (columns in first-seen order)."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns and not isinstance(row[k], (dict, list))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _scalar(value) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


def _named_rows(objects: dict) -> list[dict]:
    return [{"name": key, **{k: v for k, v in value.items() if _scalar(v)}} for key, value in objects.items()]


def rows_of(data: dict) -> list[dict]:
    """The rows to tabulate (see the module docstring); a ValueError when there are none."""
    for key in ("results", "rows"):
        if isinstance(data.get(key), list) and data[key] and all(isinstance(r, dict) for r in data[key]):
            return data[key]
    for value in data.values():
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            return value
    for value in data.values():  # one level down: {"sizes": {"S": {...}, "M": {...}}}
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            return _named_rows(value)
    named = {k: v for k, v in data.items() if isinstance(v, dict) and v and any(_scalar(x) for x in v.values())}
    if named:
        return _named_rows(named)
    raise ValueError("no list of objects and no objects keyed by name to tabulate")


def section(name: str, data: dict, *, command: str, source: str, machine_words: str, date: str) -> str:
    try:
        rows = rows_of(data)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    setup = ", ".join(f"{k} {_cell(v)}" for k, v in data.items() if _scalar(v))
    setup = f" Setup: {setup}." if setup else ""
    return (f"<!-- begin {name} -->\n### {name}\n\n"
            f"{date}, {machine_words}. `{command}` (`{source}`).{setup}\n\n{table(rows)}\n<!-- end {name} -->")


def replace_section(text: str, name: str, new: str) -> str:
    """``text`` with the section NAME replaced by ``new`` (appended when absent)."""
    pattern = re.compile(rf"<!-- begin {re.escape(name)} -->.*?<!-- end {re.escape(name)} -->", re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: new, text)
    return text.rstrip("\n") + "\n\n" + new + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="the JSON a benchmark wrote")
    parser.add_argument("--command", required=True, help="the command that wrote it")
    parser.add_argument("--machine", default=None, help="default: this machine")
    parser.add_argument("--date", default=None, help="default: the JSON's modification date")
    parser.add_argument("--out", type=Path, default=RESULTS_MD)
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    date = args.date or datetime.date.fromtimestamp(args.json.stat().st_mtime).isoformat()
    name = args.json.stem
    new = section(name, data, command=args.command, source=f"benchmarks/results/{args.json.name}",
                  machine_words=args.machine or machine(), date=date)
    text = args.out.read_text() if args.out.exists() else "# Benchmark results\n"
    args.out.write_text(replace_section(text, name, new))
    print(f"wrote the {name} section of {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
