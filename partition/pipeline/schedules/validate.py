"""The validator: placement, order, completeness, P2P pairing and a blocking run.

    validate(sched)                                # the schedule, or a ScheduleError naming rank and step
    validate(load_schedule("my.yaml"))
"""

from __future__ import annotations

from typing import Optional

from shardfn.partition.pipeline.schedules.dependencies import _counterpart, _recv_for
from shardfn.partition.pipeline.schedules.simulate import _timeline
from shardfn.partition.pipeline.schedules.types import (
    COMPUTE_KINDS,
    DEFAULT_COSTS,
    Action,
    Schedule,
    ScheduleError,
    group_steps,
)


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` runs to the end; return it, or raise :class:`ScheduleError`.

    Checks, in order: every action sits on the rank of its stage (and a communication action
    names the right peer); no duplicates; every input is ready where it is used (``F`` after the
    previous stage's ``F``, ``B``/``I`` after their ``F``, ``W`` after its ``I``, and, when the
    schedule has communication, a receive before each remote input and a send after each
    producer); every stage runs ``F`` and ``B`` (or ``I`` and ``W``) once per microbatch; each
    send has its receive, paired in posting order; and the ranks never all block. A compute-only
    schedule is checked as if messages arrived as soon as they are produced; a schedule with
    communication is run with blocking P2P batches (see :func:`group_steps`, docs/schedules.md).

    Example:
        validate(get_schedule("zbh1", 4, 8))            # returns the schedule
        validate(Schedule(((Action("B", 0, 0), Action("F", 0, 0)),), 1, (0,)))  # ScheduleError
    """
    _check_placement(schedule)
    _check_order(schedule)
    _check_complete(schedule)
    if schedule.has_communication:
        _check_p2p(schedule)
    else:
        _timeline(schedule, DEFAULT_COSTS, 0.0)
    return schedule


def _err(rank: int, step: Optional[int], a: Optional[Action], msg: str) -> ScheduleError:
    where = f"rank {rank} step {step}: {a}" if step is not None else f"rank {rank}: {a}"
    return ScheduleError(f"{where} {msg}", rank=rank, step=step, action=a)


def _check_placement(sched: Schedule) -> None:
    n, s2r = sched.n_stages, sched.stage_to_rank
    for r, acts in enumerate(sched.actions):
        for i, a in enumerate(acts):
            if a.stage >= n:
                raise _err(r, i, a, f"names stage {a.stage}, but the schedule has {n} stages "
                                    f"(0..{n - 1})")
            if a.microbatch >= sched.n_microbatches:
                raise _err(r, i, a, f"names microbatch {a.microbatch}, but the schedule has "
                                    f"{sched.n_microbatches} (0..{sched.n_microbatches - 1})")
            if s2r[a.stage] != r:
                raise _err(r, i, a, f"is on rank {r}, but stage {a.stage} lives on rank "
                                    f"{s2r[a.stage]}; move it there or fix stage_to_rank")
            if not a.is_comm:
                continue
            other = a.stage + 1 if a.kind in ("SEND_F", "RECV_B") else a.stage - 1
            if not 0 <= other < n:
                end = "last" if other == n else "first"
                raise _err(r, i, a, f"has no peer: stage {a.stage} is the {end} stage; drop it")
            if s2r[other] == r:
                raise _err(r, i, a, f"is not needed: stages {a.stage} and {other} both live on "
                                    f"rank {r}, which hands the tensor over locally; drop it")
            if a.peer != s2r[other]:
                raise _err(r, i, a, f"names peer rank {a.peer}, but stage {other} lives on rank "
                                    f"{s2r[other]}; drop the peer to derive it")


def _check_order(sched: Schedule) -> None:
    comm, s2r, last = sched.has_communication, sched.stage_to_rank, sched.n_stages - 1
    for r, acts in enumerate(sched.actions):
        first: dict[Action, int] = {}
        for i, a in enumerate(acts):
            first.setdefault(a, i)

        def before(b: Action, i: int, what: str = "") -> str:  # the action at step i lacks b
            j = first.get(b)
            if j is not None and j > i:
                return f"runs before {b} (step {j}){what}"
            return f"needs {b} before it, and rank {r} never runs it"

        seen: set[Action] = set()
        for i, a in enumerate(acts):
            if a in seen:
                raise _err(r, i, a, f"is a duplicate (first at step {first[a]}); each action runs "
                                    f"once")
            s, mb = a.stage, a.microbatch
            fwd, full, inp = (Action(k, s, mb) for k in ("F", "B", "I"))
            if a.kind == "F" and s > 0:
                prev = Action("F", s - 1, mb)
                if s2r[s - 1] == r and prev not in seen:
                    raise _err(r, i, a, before(prev, i, ", which feeds it"))
            if a.kind in ("B", "I"):
                other = inp if a.kind == "B" else full
                if other in seen:
                    raise _err(r, i, a, f"but {other} already ran at step {first[other]}: a "
                                        f"microbatch's backward is one B, or an I followed by a W")
                if fwd not in seen:
                    raise _err(r, i, a, before(fwd, i))
                if s < last and s2r[s + 1] == r and not seen & {Action("B", s + 1, mb),
                                                              Action("I", s + 1, mb)}:
                    raise _err(r, i, a, f"runs before the backward of stage {s + 1} mb {mb} "
                                        f"(B or I), which feeds it its output gradient")
            if a.kind == "W":
                if full in first:
                    raise _err(r, i, a, f"but the backward is a full B at step {first[full]}; drop "
                                        f"the W or split that B into I and W")
                if inp not in seen:
                    raise _err(r, i, a, before(inp, i, "; W needs its I first"))
            if comm and not a.is_comm:
                recv = _recv_for(a, sched)
                if recv is not None and recv not in seen:
                    j = first.get(recv)
                    late = f" (it is at step {j})" if j is not None else ""
                    raise _err(r, i, a, f"needs {recv} from rank {recv.peer} before it{late}; "
                                        f"move or add it, or write no communication and call "
                                        f"add_communication()")
            if a.kind in ("SEND_F", "SEND_B"):
                producers = [fwd] if a.kind == "SEND_F" else [full, inp]
                if not seen & set(producers):
                    p = next((b for b in producers if b in first), producers[0])
                    raise _err(r, i, a, before(p, i, ", which computes what it sends"))
            seen.add(a)


def _check_complete(sched: Schedule) -> None:
    present = [set(acts) for acts in sched.actions]
    for s, r in enumerate(sched.stage_to_rank):
        have = present[r]
        for mb in range(sched.n_microbatches):
            fwd, full, inp, wgt = (Action(k, s, mb) for k in COMPUTE_KINDS)
            if fwd not in have:
                raise _err(r, None, fwd, "is missing: every stage runs F, then B (or I and W), "
                                         "once per microbatch")
            if full not in have and inp not in have:
                raise _err(r, None, full, "is missing (or I and W): every stage runs F, then B "
                                          "(or I and W), once per microbatch")
            if inp in have and wgt not in have:
                raise _err(r, None, wgt, f"is missing: {inp} computes only the input gradient; "
                                         f"add W after it")


def _check_p2p(sched: Schedule) -> None:
    """Pair sends with receives per (sender, receiver) channel in posting order, then run all
    ranks with blocking batches: a batch completes once every op in it has its partner posted."""
    index = [{a: i for i, a in enumerate(acts)} for acts in sched.actions]
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    channels: dict[tuple[int, int], tuple[list, list]] = {}
    for r, acts in enumerate(sched.actions):
        for i, a in enumerate(acts):
            if not a.is_comm:
                continue
            match = _counterpart(a, sched)
            if match not in index[a.peer]:
                raise _err(r, i, a, _unmatched(a, match))
            src, dst = (r, a.peer) if a.kind.startswith("SEND") else (a.peer, r)
            channels.setdefault((src, dst), ([], []))[0 if a.kind.startswith("SEND") else 1].append(i)
    for (src, dst), (sends, recvs) in channels.items():
        for i, j in zip(sends, recvs):
            a, b = sched.actions[src][i], sched.actions[dst][j]
            if _counterpart(a, sched) != b:
                raise _err(dst, j, b, f"from rank {src} would receive {a} (rank {src} step {i}): "
                                      f"messages between two ranks pair up in the order they are "
                                      f"posted, so rank {src} must send in the order rank {dst} "
                                      f"receives; swap them on one side")
            partner[(src, i)], partner[(dst, j)] = (dst, j), (src, i)
    _run_blocking(sched, partner)


def _unmatched(a: Action, match: Action) -> str:
    if a.kind.startswith("SEND"):
        return (f"has no matching {match.kind} on rank {a.peer}: add {match} there before the "
                f"action that uses it")
    after = f"F(stage={match.stage}, mb={match.microbatch})" if a.kind == "RECV_F" else "its B or I"
    return (f"has no matching {match.kind} from rank {a.peer}: add {match} on rank {a.peer} after "
            f"{after}, or write no communication and call add_communication()")


def _run_blocking(sched: Schedule, partner: dict[tuple[int, int], tuple[int, int]]) -> None:
    steps, step_of = [], []
    for acts in sched.actions:
        grouped, k, of = [], 0, []
        for step in group_steps(acts):
            grouped.append(tuple(range(k, k + len(step))))
            of += [len(grouped) - 1] * len(step)
            k += len(step)
        steps.append(grouped)
        step_of.append(of)
    pc = [0] * sched.n_ranks

    def posted(q: int, j: int) -> bool:
        return step_of[q][j] <= pc[q]

    def waiting(r: int) -> list[int]:
        return [i for i in steps[r][pc[r]] if sched.actions[r][i].is_comm
                and not posted(*partner[(r, i)])]

    progress = True
    while progress:
        progress = False
        for r in range(sched.n_ranks):
            while pc[r] < len(steps[r]) and not waiting(r):
                pc[r] += 1
                progress = True
    stuck = [r for r in range(sched.n_ranks) if pc[r] < len(steps[r])]
    if not stuck:
        return
    lines = []
    for r in stuck:
        i = waiting(r)[0]
        a = sched.actions[r][i]
        q, j = partner[(r, i)]
        qi = steps[q][pc[q]][0]
        lines.append(f"rank {r} step {i}: {a} {'to' if a.kind.startswith('SEND') else 'from'} "
                     f"rank {q} waits for {sched.actions[q][j]} (rank {q} step {j}), but rank {q} "
                     f"is blocked at step {qi}")
    r0, i0 = stuck[0], waiting(stuck[0])[0]
    raise ScheduleError(
        "deadlock with blocking P2P batches:\n  " + "\n  ".join(lines) + "\npost each send and "
        "the receive it waits on in one batch (adjacent actions, no compute between) or reorder "
        "them; add_communication() places sends and receives so this cannot happen",
        rank=r0, step=i0, action=sched.actions[r0][i0])
