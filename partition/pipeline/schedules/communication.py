"""Sends and receives derived from a compute order, and the F/B pairs that may overlap.

    sched = add_communication(gpipe(2, 4))
    paired, pairs = pair_overlaps(sched)
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Mapping, Optional

from shardfn.partition.pipeline.schedules.dependencies import _counterpart, _send_for
from shardfn.partition.pipeline.schedules.simulate import _costs, _timeline
from shardfn.partition.pipeline.schedules.types import Action, Schedule, ScheduleError
from shardfn.partition.pipeline.schedules.validate import validate


def add_communication(schedule: Schedule, costs: Optional[Mapping[str, float]] = None) -> Schedule:
    """Insert the sends and receives a compute-only ``schedule`` implies, deadlock-free.

    Each send goes right after the compute that produces its tensor. Each receive goes before
    the compute that consumes it, at the first point where, in the simulated timeline (``costs``,
    default ``F=1 B=2 I=1 W=1``), the tensor already exists: so no receive stalls its rank in
    that timeline, and every rank's blocking batches pair up in time order, which cannot
    deadlock (docs/schedules.md has the argument). Stages on the same rank exchange nothing.

    Example:
        s = add_communication(one_f_one_b(2, 2))
        [a.cell for a in s.actions[0]]  # F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 B0@s0 ...
    """
    if schedule.has_communication:
        raise ValueError(f"schedule {schedule.name!r} already has communication actions; pass "
                         f"schedule.compute_only() to rebuild them")
    validate(schedule)
    timeline = _timeline(schedule, _costs(costs), 0.0)
    starts = [[slot.start for slot in slots] for slots in timeline]
    gaps: list[list[list[tuple[float, int, Action]]]] = [[[] for _ in range(len(slots) + 1)]
                                                          for slots in timeline]
    for r, slots in enumerate(timeline):
        for k, slot in enumerate(slots):
            send = _send_for(slot.action, schedule)
            if send is None:
                continue
            gaps[r][k + 1].append((slot.end, 0, send))  # right after its producer
            recv = _counterpart(send, schedule)
            q = send.peer
            gap = bisect.bisect_left(starts[q], slot.end)
            gaps[q][gap].append((slot.end, 1, recv))  # before the first compute starting later
    actions = []
    for r, slots in enumerate(timeline):
        program: list[Action] = []
        for k in range(len(slots) + 1):
            program += [a for _, _, a in sorted(gaps[r][k], key=lambda x: (x[1], x[0]))]
            if k < len(slots):
                program.append(slots[k].action)
        actions.append(tuple(program))
    return validate(dataclasses.replace(schedule, actions=tuple(actions)))


@functools.lru_cache(maxsize=16)
def pair_overlaps(schedule: Schedule) -> tuple[Schedule, frozenset[tuple[int, Action, Action]]]:
    """DualPipe's overlapped pairs made explicit: ``(schedule', pairs)``.

    A pair is an ``F`` followed on its rank by a ``B`` of another stage, with nothing between
    them but the ``F``'s own sends and the ``B``'s receive (DualPipeV writes its overlapped
    pairs that way). In ``schedule'`` the sends move after the ``B`` and the receive before the
    ``F``, so the two can run as one step whose members
    take turns at their communication waits (``runtime.interleave``); ``pairs`` holds
    ``(rank, F, B)``. ``schedule'`` passes :func:`validate` (its blocking batches cannot
    deadlock); where it would not, no pair is made and ``schedule`` comes back unchanged.

    Example:
        s, pairs = pair_overlaps(get_schedule("dualpipev", 2, 4))
        sorted(f"{f.cell}+{b.cell}" for r, f, b in pairs if r == 1)   # ['F2@s1+B0@s2', 'F3@s1+B1@s2']
    """
    if not schedule.has_communication:
        schedule = add_communication(schedule)
    actions, pairs = [], set()
    for r, program in enumerate(schedule.actions):
        out, i = [], 0
        while i < len(program):
            a, j = program[i], i + 1
            if a.kind == "F":
                while j < len(program) and program[j].is_comm:
                    j += 1
                b, between = (program[j] if j < len(program) else None), program[i + 1:j]
                sends = [c for c in between
                         if c.kind == "SEND_F" and (c.stage, c.microbatch) == (a.stage, a.microbatch)]
                recvs = [c for c in between if c.kind == "RECV_B" and b is not None
                         and (c.stage, c.microbatch) == (b.stage, b.microbatch)]
                if b is not None and b.kind == "B" and b.stage != a.stage and len(sends) + len(recvs) == len(between):
                    pairs.add((r, a, b))
                    out += [*recvs, a, b, *sends]
                    i = j + 1
                    continue
            out.append(a)
            i += 1
        actions.append(tuple(out))
    if not pairs:
        return schedule, frozenset()
    paired = dataclasses.replace(schedule, actions=tuple(actions))
    try:
        validate(paired)
    except ScheduleError:
        return schedule, frozenset()
    return paired, frozenset(pairs)
