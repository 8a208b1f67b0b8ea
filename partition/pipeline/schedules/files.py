"""Schedules as YAML or CSV tables: read, checked, written.

    sched = load_schedule("schedule.yaml")
    dump_schedule(sched, "out.csv")
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

from shardfn.partition.pipeline.schedules.types import Action, Schedule, parse_action


def load_schedule(path: Union[str, Path]) -> Schedule:
    """Read a schedule table from YAML (``.yaml``/``.yml``) or CSV (``.csv``); see
    docs/schedules.md. Missing ``stage_to_rank`` / ``n_microbatches`` are inferred.

    Example:
        s = load_schedule("examples/schedules/1f1b_2x4.yaml"); validate(s)
    """
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        rows, meta = _read_yaml(text, path)
    elif path.suffix == ".csv":
        rows, meta = _read_csv(text)
    else:
        raise ValueError(f"{path}: unknown schedule file type {path.suffix!r}; use .yaml, .yml "
                         f"or .csv")
    actions = []
    for r, cells in enumerate(rows):
        parsed = []
        for c, cell in enumerate(cells):
            try:
                parsed.append(parse_action(cell))
            except ValueError as e:
                raise ValueError(f"{path}: rank {r} cell {c}: {e}") from None
        actions.append(tuple(parsed))
    if not actions:
        raise ValueError(f"{path}: no ranks; write one row of actions per rank")
    stage_to_rank = meta.get("stage_to_rank")
    if stage_to_rank is None:
        stage_to_rank = _infer_stage_to_rank(actions, path)
    n_microbatches = meta.get("n_microbatches")
    if n_microbatches is None:
        n_microbatches = 1 + max((a.microbatch for acts in actions for a in acts), default=0)
    try:
        return Schedule(tuple(actions), n_microbatches=int(n_microbatches),
                        stage_to_rank=tuple(stage_to_rank), name=str(meta.get("name", path.stem)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


_META_KEYS = ("name", "n_microbatches", "stage_to_rank")


def _read_yaml(text: str, path: Path) -> tuple[list[list[str]], dict]:
    import yaml

    doc = yaml.safe_load(text)
    if isinstance(doc, list):
        doc = {"ranks": doc}
    if not isinstance(doc, dict) or "ranks" not in doc:
        raise ValueError(f"{path}: expected a mapping with a 'ranks' list (one list of actions "
                         f"per rank)")
    unknown = sorted(set(doc) - set(_META_KEYS) - {"ranks"})
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; valid keys: ranks, "
                         f"{', '.join(_META_KEYS)}")
    rows = []
    for r, row in enumerate(doc["ranks"] or []):
        if isinstance(row, str):
            row = row.split()
        if not isinstance(row, list):
            raise ValueError(f"{path}: rank {r}: expected a list of cells or a string of cells "
                             f"separated by spaces, got {type(row).__name__}")
        rows.append([str(c) for c in row if c not in (None, "-", ".")])
    return rows, {k: doc[k] for k in _META_KEYS if k in doc}


def _read_csv(text: str) -> tuple[list[list[str]], dict]:
    import csv

    import yaml

    meta, body = {}, []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            key, sep, value = stripped[1:].partition(":")
            if sep and key.strip() in _META_KEYS:
                meta[key.strip()] = yaml.safe_load(value)
        elif stripped:
            body.append(line)
    rows = [[c.strip() for c in row if c.strip() not in ("", "-", ".")] for row in csv.reader(body)]
    return rows, meta


def _infer_stage_to_rank(actions: Sequence[Sequence[Action]], path: Path) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for r, acts in enumerate(actions):
        for a in acts:
            if owner.setdefault(a.stage, r) != r:
                raise ValueError(f"{path}: stage {a.stage} appears on ranks {owner[a.stage]} and "
                                 f"{r} ({a.cell}); a stage lives on one rank, or give "
                                 f"stage_to_rank")
    n = 1 + max(owner, default=0)
    missing = [s for s in range(n) if s not in owner]
    if missing:
        raise ValueError(f"{path}: stage {missing[0]} has no actions, so its rank is unknown; "
                         f"give stage_to_rank")
    return tuple(owner[s] for s in range(n))


def dump_schedule(schedule: Schedule, path: Union[str, Path]) -> Path:
    """Write ``schedule`` as a YAML or CSV table (by suffix) that :func:`load_schedule` reads back.

    Example:
        dump_schedule(get_schedule("1f1b", 2, 4), "1f1b.yaml")
    """
    path = Path(path)
    meta = [f"name: {schedule.name}", f"n_microbatches: {schedule.n_microbatches}",
            f"stage_to_rank: [{', '.join(map(str, schedule.stage_to_rank))}]"]
    rows = [[a.cell for a in acts] for acts in schedule.actions]
    header = "shardfn pipeline schedule: one row of actions per rank (docs/schedules.md)"
    if path.suffix in (".yaml", ".yml"):
        lines = [f"# {header}"] + meta + ["ranks:"]
        lines += [f"  - [{', '.join(row)}]  # rank {r}" for r, row in enumerate(rows)]
    elif path.suffix == ".csv":
        lines = [f"# {header}"] + [f"# {m}" for m in meta] + [",".join(row) for row in rows]
    else:
        raise ValueError(f"{path}: unknown schedule file type {path.suffix!r}; use .yaml, .yml "
                         f"or .csv")
    path.write_text("\n".join(lines) + "\n")
    return path
