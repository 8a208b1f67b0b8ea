"""Write one benchmark's section of benchmarks/RESULTS.md from the JSON the benchmark wrote.

Each section sits between ``<!-- begin NAME -->`` and ``<!-- end NAME -->`` (NAME: the JSON's
file name without ``.json``) and holds the date, the machine, the command and the JSON's path,
then a table of the JSON's rows (its ``results`` or ``rows`` list of flat objects). A rerun
replaces the section; nothing else in the file changes.

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


def section(name: str, data: dict, *, command: str, source: str, machine_words: str, date: str) -> str:
    rows = data.get("results", data.get("rows"))
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{source}: no 'results' or 'rows' list of objects to tabulate")
    return (f"<!-- begin {name} -->\n### {name}\n\n"
            f"{date}, {machine_words}. `{command}` (`{source}`).\n\n{table(rows)}\n<!-- end {name} -->")


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
