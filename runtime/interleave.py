"""Two programs on one rank taking turns at their communication waits (DualPipe's overlapped pairs).

:func:`run_pair` runs two callables so that exactly one of them computes at any time. The first
runs until it is about to wait on a collective it has issued (a :func:`handoff` around the
wait, inside the MoE exchange); then the second computes while that collective is in flight,
until its own wait; then the first resumes (once its collective is done), and so on. When one
finishes, the other runs on alone. Where the turn changes is fixed by the two programs, never by
timing, so every rank that runs the same pair issues its collectives in the same order: the
ranks of an ``ep`` group stay matched. Outside :func:`run_pair`, :func:`handoff` does nothing.

On a GPU the turns order kernel launches, not kernels: an NCCL ``wait()`` makes the current
stream wait, not the host. So the second member runs on a stream of its own (one per device,
made once), entered on its thread together with the device, and the two streams are joined at
the pair's start (the second's stream waits for all the first's stream has queued: the pair's
inputs) and end (the first's stream waits for the second's: its results). In between, the
second's kernels run beside the first's exchange instead of queueing behind it. The tensors the
caller passes as ``keep`` (those the second member may free that were made on the first's
stream) are held until the join, so the caching allocator cannot hand their memory to the first
member while the second's kernels still read it. On CPU, or where no tensor is on a GPU, there
are no streams and nothing changes.

    log = run_pair(lambda: rank.F(f), lambda: rank.B(b))   # [(0, "start", ns), (0, "handoff", ns), ...]
    with handoff(): work.wait()                            # in an exchange: the other member computes meanwhile
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Callable

import torch

_seat = threading.local()    # (turns, member) while a member of a pair runs on this thread


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


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The second member's CUDA stream on ``device`` (made on first use, then reused).

        side_stream(torch.device("cuda", 0))
    """
    return _stream_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _stream_on(index: int) -> "torch.cuda.Stream":
    """The second member's stream on CUDA device ``index``, made once."""
    return torch.cuda.Stream(device=index)


@functools.cache
def _second_thread() -> ThreadPoolExecutor:
    """The one worker thread a pair's second member runs on, made on first use and reused by
    every pair."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfn-pair")


def _on_stream(stream) -> Any:
    """Enter ``stream`` (and its device) on this thread; nothing where ``stream`` is None."""
    if stream is None:
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(torch.cuda.device(stream.device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def _member(turns: _Turns, me: int, fn: Callable[[], None], grad: bool,
            threads: int | None = None, stream=None) -> BaseException | None:
    _seat.seat = (turns, me)
    try:
        turns.take(me, "start")
        if threads is not None:  # the helper thread: the caller's intra-op threads
            torch.set_num_threads(threads)
        with torch.set_grad_enabled(grad), _on_stream(stream):
            fn()
        return None
    except BaseException as e:  # handed back to run_pair's caller, after both members are done
        return e
    finally:
        _seat.seat = None
        turns.give(me, "end")


def run_pair(first: Callable[[], None], second: Callable[[], None], *,
             device: torch.device | str | None = None, keep: Any = None) -> list[tuple[int, str, int]]:
    """Run ``first`` and ``second`` (``first`` on this thread, ``second`` on a helper thread),
    one computing at a time, switching at each :func:`handoff`. Returns the turn log: one
    ``(member, event, perf_counter_ns)`` per ``"start"``, ``"handoff"``, ``"resume"`` and
    ``"end"``, in order.
    An exception in either is raised here once both are done.

    Args:
        first, second: the two members.
        device: where they compute. A CUDA device runs ``second`` on its own stream
            (:func:`side_stream`), joined with this thread's current stream at the start and the
            end of the pair; None or a CPU device: no streams.
        keep: anything (tensors, containers of them) to hold until the streams are joined: what
            ``second`` may free that was made on this thread's stream. Ignored without streams.

        log = run_pair(lambda: print("F"), lambda: print("B"))   # F, then B
        log = run_pair(f, b, device=torch.device("cuda", 0), keep=list(envs.values()))
    """
    device = torch.device(device) if device is not None else None
    stream = main = None
    if device is not None and device.type == "cuda":
        main = torch.cuda.current_stream(device)
        stream = side_stream(device)
        stream.wait_stream(main)      # join at the start: the second reads what the first's stream made
    turns = _Turns()
    grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
    other = _second_thread().submit(_member, turns, 1, second, grad, threads, stream)
    errors = [_member(turns, 0, first, grad), other.result()]
    if stream is not None:
        main.wait_stream(stream)      # join at the end: what follows reads the second's results
    del keep                          # safe to free now: the first's stream is ordered after the second's
    for e in errors:
        if e is not None:
            raise e
    return turns.log
