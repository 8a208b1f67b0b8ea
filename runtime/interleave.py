"""Two programs on one rank taking turns at their communication waits (DualPipe's overlapped pairs).

:func:`run_pair` runs two callables so that exactly one of them computes at any time. The first
runs until it is about to wait on a collective it has issued (a :func:`handoff` around the
wait, inside the MoE exchange); then the second computes while that collective is in flight,
until its own wait; then the first resumes (once its collective is done), and so on. When one
finishes, the other runs on alone. Where the turn changes is fixed by the two programs, never by
timing, so every rank that runs the same pair issues its collectives in the same order: the
ranks of an ``ep`` group stay matched. Outside :func:`run_pair`, :func:`handoff` does nothing.

    log = run_pair(lambda: rank.F(f), lambda: rank.B(b))   # [(0, "start", ns), (0, "handoff", ns), ...]
    with handoff(): work.wait()                            # in an exchange: the other member computes meanwhile
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable

import torch

_seat = threading.local()    # (turns, member) while a member of a pair runs on this thread
_second: ThreadPoolExecutor | None = None


class _Turns:
    """Whose turn it is to compute, and the order in which turns were taken."""

    def __init__(self):
        self.cv = threading.Condition()
        self.turn = 0
        self.done = [False, False]
        self.log: list[tuple[int, str, int]] = []

    def take(self, me: int, event: str) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == me)
            self.log.append((me, event, time.perf_counter_ns()))

    def give(self, me: int, event: str) -> None:
        with self.cv:
            self.log.append((me, event, time.perf_counter_ns()))
            if event == "end":
                self.done[me] = True
            if not self.done[1 - me]:
                self.turn = 1 - me
                self.cv.notify_all()


@contextmanager
def handoff():
    """Around a wait on an issued collective: inside :func:`run_pair`, let the other member
    compute until the wait is over and the turn comes back; elsewhere, nothing.

        with handoff(): work.wait()
    """
    seat = getattr(_seat, "seat", None)
    if seat is None:
        yield
        return
    turns, me = seat
    turns.give(me, "handoff")
    try:
        yield
    finally:
        turns.take(me, "resume")


def _member(turns: _Turns, me: int, fn: Callable[[], None], grad: bool,
            threads: int | None = None) -> BaseException | None:
    _seat.seat = (turns, me)
    try:
        turns.take(me, "start")
        if threads is not None:  # the helper thread: the caller's intra-op threads
            torch.set_num_threads(threads)
        with torch.set_grad_enabled(grad):
            fn()
        return None
    except BaseException as e:  # handed back to run_pair's caller, after both members are done
        return e
    finally:
        _seat.seat = None
        turns.give(me, "end")


def run_pair(first: Callable[[], None], second: Callable[[], None]) -> list[tuple[int, str, int]]:
    """Run ``first`` and ``second`` (``first`` on this thread, ``second`` on a helper thread),
    one computing at a time, switching at each :func:`handoff`. Returns the turn log: one
    ``(member, event, perf_counter_ns)`` per ``"start"``, ``"handoff"``, ``"resume"`` and
    ``"end"``, in order.
    An exception in either is raised here once both are done.

        log = run_pair(lambda: print("F"), lambda: print("B"))   # F, then B
    """
    global _second
    if _second is None:
        _second = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfn-pair")
    turns = _Turns()
    grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
    other = _second.submit(_member, turns, 1, second, grad, threads)
    errors = [_member(turns, 0, first, grad), other.result()]
    for e in errors:
        if e is not None:
            raise e
    return turns.log
