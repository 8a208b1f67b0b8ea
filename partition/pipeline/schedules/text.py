"""Schedules as text: the action table and the simulated timeline.

    print(format_table(sched))
    print(format_timeline(sched, simulate(sched)))
"""

from __future__ import annotations

from shardfn.partition.pipeline.schedules.simulate import Simulation
from shardfn.partition.pipeline.schedules.types import Schedule


def format_table(schedule: Schedule) -> str:
    """The schedule as a grid: one column per rank, one row per step (:func:`group_steps`);
    the communication actions of one batch are joined by ``+``.

    Example:
        print(format_table(one_f_one_b(2, 2)))
    """
    columns = [[" + ".join(a.cell for a in step) for step in schedule.steps(r)]
               for r in range(schedule.n_ranks)]
    width = max([len(c) for col in columns for c in col] + [len(f"rank {schedule.n_ranks - 1}")])
    n_rows = max(len(col) for col in columns)
    label = len(f"step {n_rows - 1}")
    lines = [" " * label + "  " + "  ".join(f"rank {r}".ljust(width) for r in range(schedule.n_ranks))]
    for i in range(n_rows):
        cells = [col[i] if i < len(col) else "" for col in columns]
        lines.append(f"step {i}".ljust(label) + "  " + "  ".join(c.ljust(width) for c in cells))
    return "\n".join(line.rstrip() for line in lines)


def format_timeline(schedule: Schedule, sim: Simulation) -> str:
    """The simulated timeline as text: one row per rank, one column per time unit (the smallest
    cost), ``.`` for idle, ``~`` where the action of the previous column goes on. On ranks with
    several stages a cell is ``STAGE KIND MB`` (``4F3``), else ``KIND MB`` (``F3``).

    Example:
        print(format_timeline(s := one_f_one_b(2, 2), simulate(s)))
    """
    unit = min(sim.costs[a.kind] for acts in schedule.actions for a in acts if not a.is_comm)
    n_cols = round(sim.makespan / unit)
    rows = []
    for r, slots in enumerate(sim.timeline):
        multi = len(schedule.stages_of(r)) > 1
        cells = ["."] * n_cols
        for slot in slots:
            a = slot.action
            first, last = round(slot.start / unit), round(slot.end / unit)
            cells[first] = f"{a.stage if multi else ''}{a.kind}{a.microbatch}"
            for c in range(first + 1, last):
                cells[c] = "~"
        rows.append(cells)
    width = max(len(c) for row in rows for c in row)
    return "\n".join(f"rank {r}  " + " ".join(c.ljust(width) for c in row).rstrip()
                     for r, row in enumerate(rows))
