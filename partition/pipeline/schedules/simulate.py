"""A schedule timed in unit costs: each action's slot, the bubble, the peak in flight.

    sim = simulate(get_schedule("1f1b", 4, 8))
    sim.bubble                                     # 3 / 11
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Sequence

from shardfn.partition.pipeline.schedules.dependencies import _event_str, _needs, _produces
from shardfn.partition.pipeline.schedules.types import COMPUTE_KINDS, DEFAULT_COSTS, Action, Schedule, ScheduleError


class Slot(NamedTuple):
    start: float
    end: float
    action: Action


class Simulation(NamedTuple):
    """What :func:`simulate` measured. ``timeline[r]`` holds rank ``r``'s compute slots in order.

    ``bubble`` is idle time / (ranks * makespan); ``peak_inflight[r]`` is the most activations
    rank ``r`` holds at once (forwards whose ``B``/``I`` has not run, per stage and microbatch).
    """

    timeline: tuple[tuple[Slot, ...], ...]
    makespan: float
    bubble: float
    peak_inflight: tuple[int, ...]
    costs: Mapping[str, float]


def _costs(costs: Optional[Mapping[str, float]]) -> dict[str, float]:
    merged = dict(DEFAULT_COSTS)
    for kind, cost in (costs or {}).items():
        if kind not in COMPUTE_KINDS:
            raise ValueError(f"costs has unknown kind {kind!r}; valid kinds: {', '.join(COMPUTE_KINDS)}")
        if not cost > 0:
            raise ValueError(f"costs[{kind!r}] must be > 0, got {cost}")
        merged[kind] = float(cost)
    return merged


def _timeline(sched: Schedule, costs: Mapping[str, float], comm: float) -> tuple[tuple[Slot, ...], ...]:
    """List-schedule every rank's compute actions in order, each starting when its rank is free
    and its inputs are ready (``comm`` later when they come from another rank). Raises a
    :class:`ScheduleError` if the ranks wait on each other in a cycle."""
    programs = [[(i, a) for i, a in enumerate(acts) if not a.is_comm] for acts in sched.actions]
    done: dict[tuple[str, int, int], tuple[float, int]] = {}  # event -> (time, rank)
    free = [0.0] * sched.n_ranks
    pc = [0] * sched.n_ranks
    slots: list[list[Slot]] = [[] for _ in programs]
    progress = True
    while progress:
        progress = False
        for r, program in enumerate(programs):
            while pc[r] < len(program):
                a = program[pc[r]][1]
                needs = _needs(a, sched.n_stages)
                if any(e not in done for e in needs):
                    break
                start = max([free[r]] + [t + (comm if src != r else 0.0)
                                         for t, src in (done[e] for e in needs)])
                free[r] = start + costs[a.kind]
                slots[r].append(Slot(start, free[r], a))
                for e in _produces(a):
                    done[e] = (free[r], r)
                pc[r] += 1
                progress = True
    stuck = [r for r, program in enumerate(programs) if pc[r] < len(program)]
    if stuck:
        raise _cycle_error(sched, programs, pc, stuck, done)
    return tuple(tuple(s) for s in slots)


def _cycle_error(sched, programs, pc, stuck, done) -> ScheduleError:
    lines = []
    for r in stuck:
        step, a = programs[r][pc[r]]
        missing = [e for e in _needs(a, sched.n_stages) if e not in done]
        lines.append(f"rank {r} step {step}: {a} waits for {_event_str(missing[0])}"
                     f" from rank {sched.stage_to_rank[missing[0][1]]}")
    r0 = stuck[0]
    step0, a0 = programs[r0][pc[r0]]
    return ScheduleError("deadlock: the ranks wait on each other in a cycle:\n  " + "\n  ".join(lines)
                         + "\nreorder the compute actions so each input is produced before it is"
                           " needed", rank=r0, step=step0, action=a0)


def _peak_inflight(actions: Sequence[Action]) -> int:
    held, peak = 0, 0
    for a in actions:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind in ("B", "I"):
            held -= 1
    return peak


def simulate(schedule: Schedule, costs: Optional[Mapping[str, float]] = None,
             comm: float = 0.0) -> Simulation:
    """Time ``schedule`` with unit costs per compute kind (default ``F=1 B=2 I=1 W=1``).

    Communication is asynchronous and takes ``comm`` time units: an action that needs another
    rank's output starts ``comm`` after it was produced, and communication actions take no rank
    time. Each rank runs its compute actions in its own order; ``schedule`` must be valid.

    Example:
        sim = simulate(get_schedule("gpipe", 4, 8)); sim.bubble   # 3 / 11
        simulate(get_schedule("zbh1", 4, 8), costs={"I": 1, "W": 1}).makespan   # 27.0
    """
    costs = _costs(costs)
    timeline = _timeline(schedule, costs, float(comm))
    makespan = max((slots[-1].end for slots in timeline if slots), default=0.0)
    busy = sum(s.end - s.start for slots in timeline for s in slots)
    bubble = 1.0 - busy / (schedule.n_ranks * makespan) if makespan else 0.0
    peaks = tuple(_peak_inflight(acts) for acts in schedule.actions)
    return Simulation(timeline, makespan, bubble, peaks, costs)
