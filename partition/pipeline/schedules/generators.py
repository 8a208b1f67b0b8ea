"""The schedule generators (GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV) and their names.

    sched = get_schedule("1f1b", n_ranks=4, n_microbatches=8)
    stages_per_rank("interleaved_1f1b", 4)         # 2
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from shardfn.partition.errors import LayoutError
from shardfn.partition.pipeline.schedules.communication import add_communication
from shardfn.partition.pipeline.schedules.types import Schedule, _schedule, stage_to_rank_map


def _check_sizes(name: str, n_ranks: int, n_microbatches: int) -> None:
    if n_ranks < 1 or n_microbatches < 1:
        raise ValueError(f"{name} needs n_ranks >= 1 and n_microbatches >= 1 "
                         f"(got n_ranks={n_ranks}, n_microbatches={n_microbatches})")


def gpipe(n_ranks: int, n_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward. Bubble ``(p-1)/(m+p-1)``;
    each rank holds all ``m`` activations at its peak.

    Example:
        gpipe(2, 2).actions[0]   # F0@s0, F1@s0, B0@s0, B1@s0
    """
    _check_sizes("gpipe", n_ranks, n_microbatches)
    m = range(n_microbatches)
    orders = [[("F", r, i) for i in m] + [("B", r, i) for i in m] for r in range(n_ranks)]
    return _schedule("gpipe", orders, n_microbatches, stage_to_rank_map(n_ranks, n_ranks))


def one_f_one_b(n_ranks: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, Narayanan et al. 2021): ``p-1-r`` warmup forwards on rank ``r``,
    then one forward and one backward in turn. Bubble ``(p-1)/(m+p-1)`` like GPipe, but at most
    ``p`` activations in flight per rank.

    Example:
        one_f_one_b(2, 3).actions[0]   # F0 F1 B0 F2 B1 B2 (all @s0)
    """
    _check_sizes("1f1b", n_ranks, n_microbatches)
    orders = []
    for r in range(n_ranks):
        warmup = min(n_ranks - 1 - r, n_microbatches)
        order = [("F", r, i) for i in range(warmup)]
        for i in range(n_microbatches):
            if warmup + i < n_microbatches:
                order.append(("F", r, warmup + i))
            order.append(("B", r, i))
        orders.append(order)
    return _schedule("1f1b", orders, n_microbatches, stage_to_rank_map(n_ranks, n_ranks))


def interleaved_1f1b(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): ``v = n_virtual`` stages per rank,
    stage ``s`` on rank ``s % p``; microbatches go through each rank's chunks in groups of ``p``.
    Bubble about ``(p-1)/(v*m + p-1)``, at the price of ``v`` times more P2P messages.

    Example:
        interleaved_1f1b(2, 4, n_virtual=2).stages_of(0)   # (0, 2)
    """
    p, m, v = n_ranks, n_microbatches, n_virtual
    _check_sizes("interleaved_1f1b", p, m)
    if v < 1:
        raise ValueError(f"interleaved_1f1b needs n_virtual >= 1, got {v}")
    if m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(f"interleaved_1f1b needs n_microbatches to be a multiple of n_ranks "
                         f"(got n_microbatches={m}, n_ranks={p}); use {hint}")
    total = m * v  # forwards (and backwards) per rank

    def microbatch(k: int) -> int:  # k-th forward (or backward) on a rank
        return (k // (p * v)) * p + k % p

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    orders = []
    for r in range(p):
        warmup = min((p - 1 - r) * 2 + (v - 1) * p, total)
        fwd = [("F", chunk(k, True) * p + r, microbatch(k)) for k in range(total)]
        bwd = [("B", chunk(k, False) * p + r, microbatch(k)) for k in range(total)]
        order = fwd[:warmup]
        for i in range(total - warmup):
            order += [fwd[warmup + i], bwd[i]]
        order += bwd[total - warmup:]
        orders.append(order)
    return _schedule("interleaved_1f1b", orders, m, stage_to_rank_map(p, p * v))


def zbh1(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split
    into ``I`` (input gradient, on the critical path) and ``W`` (weight gradient, off it). Rank
    ``r`` keeps ``r`` ``W`` passes pending and runs them in the cooldown bubbles, so the bubble
    drops to ``(p-1)(F+I-W)`` per rank (``(p-1)/(3m+p-1)`` for unit costs) with 1F1B's peak
    activation memory.

    Example:
        zbh1(2, 2).actions[1]   # F0 I0 F1 I1 W0 W1 (all @s1): rank 1 defers one W
    """
    _check_sizes("zbh1", n_ranks, n_microbatches)
    p, m = n_ranks, n_microbatches
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [("F", r, i) for i in range(warmup)]
        pending: deque = deque()
        for i in range(m):
            if warmup + i < m:
                order.append(("F", r, warmup + i))
            order.append(("I", r, i))
            pending.append(("W", r, i))
            while len(pending) > r:
                order.append(pending.popleft())
        order += pending
        orders.append(order)
    return _schedule("zbh1", orders, m, stage_to_rank_map(p, p))


def dualpipev(n_ranks: int, n_microbatches: int) -> Schedule:
    """DualPipeV: the "cut-in-half" DualPipe (DeepSeek-V3 report, 2024; Sea AI Lab 2025) as in
    DeepSeek's ``dualpipev.py`` and torchtitan. Rank ``r`` holds stages ``r`` and ``2p-1-r`` (a V:
    microbatches go down the ranks and back up, so rank 0 holds the first and the last stage). Its
    eight phases mix full backwards, zero-bubble ``I``/``W`` splits in warmup and cooldown, and
    overlapped pairs ``F`` of one chunk + ``B`` of the other, written as adjacent actions.

    Example:
        dualpipev(2, 4).stages_of(0)   # (0, 3)
    """
    p, m = n_ranks, n_microbatches
    _check_sizes("dualpipev", p, m)
    if m < 2 * p:
        raise ValueError(f"dualpipev needs n_microbatches >= 2 * n_ranks (got n_microbatches={m}, "
                         f"n_ranks={p}); use n_microbatches={2 * p} or more")
    return _schedule("dualpipev", [_dualpipev_rank(r, p, m) for r in range(p)], m,
                     stage_to_rank_map(p, 2 * p, "v"))


def _dualpipev_rank(r: int, p: int, m: int) -> list[tuple[str, int, int]]:
    """Rank ``r``'s DualPipeV order, phase by phase (chunk 0 = stage r, chunk 1 = stage 2p-1-r)."""
    stage = (r, 2 * p - 1 - r)
    next_mb = {}  # (kind group, chunk) -> next microbatch; B and I share the backward counter
    weights: deque = deque()  # pending W, run oldest first
    order: list[tuple[str, int, int]] = []

    def forward(c: int) -> None:
        order.append(("F", stage[c], next_mb.setdefault(("F", c), 0)))
        next_mb[("F", c)] += 1

    def backward(c: int, split: bool = False) -> None:
        mb = next_mb.setdefault(("B", c), 0)
        next_mb[("B", c)] += 1
        order.append(("I" if split else "B", stage[c], mb))
        if split:
            weights.append(("W", stage[c], mb))

    def weight() -> None:
        if weights:
            order.append(weights.popleft())

    for _ in range(2 * (p - r - 1)):  # 1: forwards of chunk 0
        forward(0)
    for _ in range(r + 1):  # 2: chunk 0 and chunk 1 forwards in turn
        forward(0)
        forward(1)
    for _ in range(p - r - 1):  # 3: I1 W F1, zero bubble
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(m - 2 * p + r + 1):  # 4 (main): overlapped F0+B1, then F1+B0
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - r - 1):  # 5: B1, then overlapped F1+B0
        backward(1)
        forward(1)
        backward(0)
    split = False
    for i in range(r + 1):  # 6: B1 B0; the second half split into I and W
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(p - r - 1):  # 7: W, then I0
        weight()
        backward(0, split)
    for _ in range(r + 1):  # 8: the remaining W
        weight()
    assert not weights, "dualpipev left weight passes behind"
    return order


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zbh1": zbh1,
    "dualpipev": dualpipev,
}
"""Schedule name -> its generator; the names ``pipeline.schedule`` accepts."""

_VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": None, "zbh1": 1, "dualpipev": 2}
_DEFAULT_VIRTUAL = 2  # interleaved_1f1b without pipeline.stages


def canonical_name(name: str) -> str:
    """``"Interleaved-1F1B"`` -> ``"interleaved_1f1b"``: how names are compared.

    Example:
        canonical_name("ZBH1") in SCHEDULES   # True
    """
    return name.lower().replace("-", "_")


def stages_per_rank(name: str, n_ranks: int, n_stages: Optional[int] = None) -> int:
    """How many pipeline stages each rank holds under the schedule ``name``.

    ``n_stages`` is ``pipeline.stages`` (None: the schedule's own default, 2 for
    ``interleaved_1f1b`` and ``dualpipev``, else 1). The runtime, the planner and the config
    checks all ask this function.

    Raises:
        LayoutError: ``pipeline.stages`` is not a multiple of ``n_ranks``, or the schedule holds a
            fixed number of stages per rank and ``n_stages`` asks for another.

    Example:
        stages_per_rank("interleaved_1f1b", 4), stages_per_rank("1f1b", 4, 8)   # 2, LayoutError
    """
    key = canonical_name(name)
    fixed = _VIRTUAL.get(key, 1)
    if n_stages is None:
        return _DEFAULT_VIRTUAL if fixed is None else fixed
    if n_stages % n_ranks:
        raise LayoutError(
            "pipeline.stages",
            f"{n_stages} is not a multiple of mesh.pp = {n_ranks}; use "
            f"{n_ranks * max(1, n_stages // n_ranks)} or null (the schedule's default)",
        )
    virtual = n_stages // n_ranks
    if fixed is not None and virtual != fixed:
        other = "; for more stages per rank use interleaved_1f1b" if fixed == 1 else ""
        raise LayoutError("pipeline.stages", f"{n_stages} stages on {n_ranks} ranks is {virtual} per rank, but {key} "
                                             f"runs {fixed} per rank: set pipeline.stages={n_ranks * fixed} or "
                                             f"null{other}")
    return virtual


def get_schedule(name: str, n_ranks: int, n_microbatches: int, n_virtual: Optional[int] = None,
                 *, communication: bool = True) -> Schedule:
    """The named schedule, with its P2P actions unless ``communication=False``.

    ``n_virtual`` is the number of stages per rank: free for ``interleaved_1f1b`` (default 2),
    1 for ``gpipe``/``1f1b``/``zbh1`` and 2 for ``dualpipev``.

    Example:
        get_schedule("interleaved_1f1b", n_ranks=4, n_microbatches=8, n_virtual=2)
    """
    key = canonical_name(name)
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)}")
    fixed = _VIRTUAL[key]
    if fixed is None:
        sched = SCHEDULES[key](n_ranks, n_microbatches, n_virtual=2 if n_virtual is None else n_virtual)
    else:
        if n_virtual not in (None, fixed):
            other = "; for more stages per rank use interleaved_1f1b" if fixed == 1 else ""
            raise ValueError(f"{key} has {fixed} stage(s) per rank, got n_virtual={n_virtual}"
                             f"{other}")
        sched = SCHEDULES[key](n_ranks, n_microbatches)
    return add_communication(sched) if communication else sched
