"""Process launch: run a function on N local ranks over gloo (or under torchrun's environment).

Every rank gets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT on a free port; results come back in rank
order. If any rank fails, dies or hangs, every rank is stopped and reaped, and :class:`RankFailed`
names the rank that caused it:

    results = spawn(work, nproc=2, args=(cfg,), timeout_s=120)   # [rank0_result, rank1_result]

Faults, and how long they take to stop a run (``timeout_s`` is ``runtime.timeout_s`` for
``shardfn train``):

- A rank raises: its error (with its traceback) is the message; ``RankFailed.summary`` is the
  message without tracebacks, and ``RankFailed.mistake`` says when the error is a ``RunError``
  (a mistake in the config or data, ``runtime.errors``).
- A rank dies (a signal, ``os._exit``, the OOM killer): the launcher sees its exit within a
  fraction of a second; the ranks talking to it fail on the closed connection.
- A rank hangs: the ranks waiting for it in a collective fail after ``timeout_s`` (the process
  group's timeout, subgroups included), and the rank that neither finished nor failed is named.
- Nothing moves: when no rank has reported progress (:func:`progress`, called once per training
  step; the start counts as progress) for ``timeout_s`` plus :data:`GRACE_S`, every rank is stopped
  and the message gives the last step each reached. Without progress calls this bounds the run.

Ctrl-C (SIGINT) reaches the launcher only: the ranks are started with SIGINT ignored, and the
launcher's ``KeyboardInterrupt`` stops and reaps every rank before it propagates.

Children run in their own process group (their own subprocesses, such as compile workers, are
stopped with them) and die with the launcher (``PR_SET_PDEATHSIG`` on Linux), so nothing is left
behind.

Test hook: ``SHARDFN_TEST_FAULT=KIND:RANK:STEP`` (``KIND`` one of ``kill``, ``hang``, ``raise``)
makes that rank SIGKILL itself, sleep forever, or raise when it calls ``progress(STEP)``.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

GRACE_S = 10.0
"""How much longer than ``timeout_s`` the launcher waits for progress: long enough for the ranks'
own collective timeouts to fire first, so the message can say which rank they were waiting for."""

SETTLE_S = 3.0
"""After the first failure, how long the launcher gathers the other ranks' reports and exit codes
before it names the cause (a killed rank's peers often report first)."""

FAULT_ENV = "SHARDFN_TEST_FAULT"
FAULT_KINDS = ("kill", "hang", "raise")

_progress = None  # (rank, shared steps array, shared times array) inside a spawned child


class RankFailed(RuntimeError):
    """A rank raised, died or timed out; the message names the rank.

    ``str(e)`` has the ranks' tracebacks; ``summary`` is the same without them; ``rank`` is the
    rank named (None when several stalled); ``mistake`` is the message of the
    :class:`~shardfn.runtime.errors.RunError` that rank raised (a mistake in the config or data,
    not a failure), else None.
    """

    def __init__(self, message: str, *, summary: str | None = None, rank: int | None = None,
                 mistake: str | None = None):
        super().__init__(message)
        self.summary = summary if summary is not None else message
        self.rank = rank
        self.mistake = mistake


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- in the ranks


def progress(step: int) -> None:
    """Tell the launcher this rank reached ``step`` (a no-op outside :func:`spawn`; no syncs).

    Also where the ``SHARDFN_TEST_FAULT`` hook fires (see the module docstring).

    Example:
        for step in range(steps):
            progress(step)
    """
    if _progress is not None:
        rank, steps, times = _progress
        steps[rank] = step
        times[rank] = time.monotonic()
    fault = os.environ.get(FAULT_ENV)
    if fault:
        _inject(fault, step)


def _inject(fault: str, step: int) -> None:
    kind, _, rest = fault.partition(":")
    rank, _, at = rest.partition(":")
    if kind not in FAULT_KINDS or not rank.isdigit() or not at.isdigit():
        raise ValueError(f"{FAULT_ENV}={fault!r}: write KIND:RANK:STEP with KIND one of {', '.join(FAULT_KINDS)}")
    if int(os.environ.get("RANK", "0")) != int(rank) or step != int(at):
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV}={fault} at step {step}")
    while True:  # hang
        time.sleep(3600)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the launcher dies, so no rank outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _thread_lock_for_progress_bars() -> None:
    """Where tqdm is installed, its bars share a multiprocessing lock, which registers with the
    launcher's resource tracker; torch.fx's Interpreter builds a (disabled) bar on every run. A rank
    the launcher stops (Ctrl-C, a peer's failure) never unregisters it, and the tracker then warns of
    leaked semaphores on the user's terminal. A rank is one process: a thread lock serves."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _child(rank: int, nproc: int, port: int, fn: Callable, args: tuple, results, timeout_s: float,
           steps, times, backend: str = "gloo") -> None:
    import datetime

    import torch.distributed as dist

    from shardfn.core._torch_private import one_gloo_worker_thread, set_default_group_timeout

    global _progress
    os.setpgrp()
    _die_with_parent()
    faulthandler.enable()  # a rank killed by a fatal signal prints where each of its threads was
    _thread_lock_for_progress_bars()
    _progress = (rank, steps, times)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    timeout = datetime.timedelta(seconds=timeout_s)
    set_default_group_timeout(timeout)  # the subgroups a DeviceMesh creates get it too (default 30 min)
    one_gloo_worker_thread()  # collectives in flight together are safe on one gloo thread, not two
    try:
        if backend == "nccl":  # each rank on its own GPU (LOCAL_RANK), as under torchrun
            from shardfn.partition.mesh import local_device_index

            torch.cuda.set_device(local_device_index())
            dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_device_index()))
        else:
            dist.init_process_group("gloo", timeout=timeout)
        out = fn(*args)
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: no shared-memory handles that die with this process
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        from shardfn.runtime.errors import RunError

        report = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        results.put((rank, "mistake", (report, str(e))) if isinstance(e, RunError) else (rank, "error", report))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- the launcher


def spawn(fn: Callable, nproc: int, args: tuple = (), timeout_s: float = 300.0,
          backend: str = "gloo") -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` gloo ranks; return the per-rank results in rank order.
    ``backend="nccl"``: NCCL ranks instead, rank ``r`` on ``cuda:r`` (its ``LOCAL_RANK``).

    ``fn`` must be importable (a module-level function). ``timeout_s`` is each collective's
    timeout and, plus :data:`GRACE_S`, the longest the run may go without :func:`progress`.

    Raises:
        RankFailed: naming the rank that raised, died or hung (see the module docstring), after
            every rank has been stopped and reaped.

    Example:
        spawn(work, nproc=2, args=(cfg,), timeout_s=120)  # [rank0_result, rank1_result]
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    steps = ctx.Array("q", [-1] * nproc, lock=False)
    times = ctx.Array("d", [0.0] * nproc, lock=False)
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, nproc, port, fn, args, results, timeout_s, steps, times, backend),
                    daemon=True)
        for r in range(nproc)
    ]
    with _sigint_ignored():  # the ranks ignore Ctrl-C (inherited); the launcher stops them (SIGTERM)
        for p in procs:
            p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    mistakes: dict[int, str] = {}
    start = time.monotonic()
    try:
        while len(out) < nproc:
            _collect(results, out, errors, timeout=0.2, mistakes=mistakes)
            exits = {r: p.exitcode for r, p in enumerate(procs)}
            failed = errors or any(code not in (None, 0) and r not in out for r, code in exits.items())
            if failed:
                _settle(results, procs, out, errors, mistakes)
                raise _failure(nproc, out, errors, mistakes, {r: p.exitcode for r, p in enumerate(procs)}, timeout_s)
            last = max([start, *times])
            if time.monotonic() - last > timeout_s + GRACE_S:
                raise RankFailed(_stalled(nproc, out, list(steps), time.monotonic() - last, timeout_s))
        for p in procs:
            p.join(timeout=timeout_s)
    except KeyboardInterrupt:  # Ctrl-C: every rank stopped before it propagates; a second one waits
        with _sigint_ignored():
            _stop(procs)
        raise
    finally:
        _stop(procs)
    return [out[r] for r in range(nproc)]


class _sigint_ignored:
    """Ignore SIGINT inside the block (main thread only; elsewhere a no-op): children started in
    it inherit the disposition, and Python keeps an ignored SIGINT ignored."""

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _collect(results, out: dict, errors: dict, timeout: float, mistakes: dict | None = None) -> None:
    """Move every report waiting in ``results`` into ``out`` (results) or ``errors`` (and
    ``mistakes``, the messages of the ranks that raised a ``RunError``)."""
    try:
        rank, status, value = results.get(timeout=timeout)
        while True:
            if status == "mistake":
                errors[rank], message = value
                if mistakes is not None:
                    mistakes[rank] = message
            elif status == "error":
                errors[rank] = value
            else:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            rank, status, value = results.get_nowait()
    except queue.Empty:
        return


def _settle(results, procs, out: dict, errors: dict, mistakes: dict | None = None) -> None:
    """Gather reports for up to :data:`SETTLE_S`, until every rank has reported or exited."""
    until = time.monotonic() + SETTLE_S
    while time.monotonic() < until:
        _collect(results, out, errors, timeout=0.1, mistakes=mistakes)
        if all(r in out or r in errors or p.exitcode is not None for r, p in enumerate(procs)):
            _collect(results, out, errors, timeout=0.1, mistakes=mistakes)  # a report may trail its sender's exit
            return


def _stop(procs) -> None:
    """Terminate, then kill, every child and its process group; reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    for p in procs:  # whatever the ranks started (compile workers, ...) is in their process group
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, TypeError):
            pass


# ----------------------------------------------------------------------------- messages

_COMM_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Broken pipe",
                "DistBackendError", "DistNetworkError", "Socket Timeout", "Connection refused")


def is_comm_error(report: str) -> bool:
    """True when a rank's error report (``Type: message`` and traceback) is a failed collective.

    Example:
        is_comm_error("RuntimeError: [gloo/pair.cc:553] Connection closed by peer ...")  # True
    """
    head = report.split("\n", 1)[0]
    return any(marker in head for marker in _COMM_ERRORS)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} without reporting an error"


def _first_line(report: str) -> str:
    return report.split("\n", 1)[0][:300]


def _head(report: str) -> str:
    """A rank's error report without its traceback: ``Type: message``."""
    return report.split("\nTraceback (most recent call last):", 1)[0].rstrip()


def cause(nproc: int, out: dict, errors: dict[int, str], exits: dict[int, int | None]) -> tuple[str, int]:
    """``(how, rank)``: the rank that caused a failure, and how: ``"died"``, ``"raised"``,
    ``"hung"`` or ``"collective"`` (see :func:`blame`).

    Example:
        cause(2, {}, {0: "RuntimeError: ... Connection closed by peer"}, {0: 1, 1: -9})  # ('died', 1)
    """
    dead = [r for r in range(nproc) if r not in out and r not in errors and exits.get(r) not in (None, 0)]
    if dead:
        return "died", dead[0]
    own = [r for r, text in sorted(errors.items()) if not is_comm_error(text)]
    if own:
        return "raised", own[0]
    silent = [r for r in range(nproc) if r not in out and r not in errors]
    if silent:
        return "hung", silent[0]
    return "collective", min(errors)


def blame(nproc: int, out: dict, errors: dict[int, str], exits: dict[int, int | None], timeout_s: float, *,
          brief: bool = False) -> str:
    """The :class:`RankFailed` message: which rank caused the failure, and what the others saw.

    In order: a rank that died without reporting; a rank whose error is not a failed collective;
    a rank that neither finished nor failed while the others' collectives failed (it hung); the
    first failed collective. ``brief``: the ranks' errors without their tracebacks.

    Example:
        blame(2, {}, {0: "RuntimeError: ... Connection closed by peer"}, {0: 1, 1: -9}, 30)
        # 'rank 1 died: it was killed by SIGKILL; then rank 0 failed: RuntimeError: ... Connection closed by peer'
    """
    show = _head if brief else (lambda report: report)
    others = lambda blamed: "".join(  # noqa: E731
        f"; then rank {o} failed: {_first_line(report)}" for o, report in sorted(errors.items()) if o != blamed)
    how, r = cause(nproc, out, errors, exits)
    if how == "died":
        return f"rank {r} died: it {_exit_text(exits[r])}{others(r)}"
    if how == "raised":
        return f"rank {r} failed: {show(errors[r])}{others(r)}"
    if how == "hung":
        waiting = ", ".join(str(w) for w in sorted(errors))
        return (f"rank {r} hung: it neither finished nor failed while rank(s) {waiting} waited for it in a "
                f"collective for runtime.timeout_s={timeout_s:g} s and failed: {_first_line(errors[min(errors)])}")
    return f"rank {r} failed in a collective: {show(errors[r])}{others(r)}"


def _failure(nproc: int, out: dict, errors: dict[int, str], mistakes: dict[int, str], exits: dict,
             timeout_s: float) -> RankFailed:
    how, r = cause(nproc, out, errors, exits)
    return RankFailed(blame(nproc, out, errors, exits, timeout_s),
                      summary=blame(nproc, out, errors, exits, timeout_s, brief=True), rank=r,
                      mistake=mistakes.get(r) if how == "raised" else None)


def _stalled(nproc: int, out: dict, steps: list[int], idle_s: float, timeout_s: float) -> str:
    missing = [r for r in range(nproc) if r not in out]
    reached = ", ".join(f"rank {r} step {steps[r]}" if steps[r] >= 0 else f"rank {r} no step" for r in missing)
    behind = min(missing, key=lambda r: steps[r])
    return (f"rank {behind} did not finish: no rank made progress for {idle_s:.0f} s (runtime.timeout_s="
            f"{timeout_s:g} s + {GRACE_S:g} s); ranks {', '.join(map(str, missing))} did not finish (last step "
            f"reached: {reached}). Raise runtime.timeout_s if a step or the start really takes this long")
