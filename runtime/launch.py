"""Process launch: run a function on N local ranks over gloo (or under torchrun's environment).

Every rank gets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT on a free port; results come back in rank
order. If any rank fails or the deadline passes, every rank is stopped and reaped, and the error
names the rank.

    results = spawn(work, nproc=2, args=(cfg,), timeout_s=120)   # [rank0_result, rank1_result]
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised, died or timed out; the message names the rank."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, nproc: int, port: int, fn: Callable, args: tuple, results, timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        out = fn(*args)
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: no shared-memory handles that die with this process
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, nproc: int, args: tuple = (), timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` gloo ranks; return the per-rank results in rank order.

    ``fn`` must be importable (a module-level function). Raises RankFailed naming the first rank
    that failed, died or did not finish within ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, nproc, port, fn, args, results, timeout_s), daemon=True)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < nproc:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(nproc) if r not in out]
                    raise RankFailed(f"rank {missing[0]} did not finish within {timeout_s:.0f} s") from None
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} failed: {value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(nproc)]
