"""Pipeline schedules as data: per-rank action lists, generators, a validator and a simulator.

A schedule says, for every pipeline rank, which compute and point-to-point (P2P) actions it runs
and in which order. It is plain data (frozen dataclasses of ints and strings, no torch): it can be
generated (GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV), written by hand in a YAML or CSV
table, checked for broken dependencies and deadlocks, and timed in unit costs before anything runs.

    sched = get_schedule("1f1b", n_ranks=4, n_microbatches=8)   # compute + P2P actions
    validate(sched)                                              # raises ScheduleError if broken
    simulate(sched).bubble                                       # 3 / 11 == (p - 1) / (m + p - 1)

Generators return the compute order only; :func:`add_communication` derives the sends and
receives, so a hand-written schedule needs compute actions only. ``docs/schedules.md`` describes
the action model, the table format and the P2P semantics the validator and the executor share.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

from shardfn.partition.errors import LayoutError

__all__ = [
    "COMPUTE_KINDS", "COMM_KINDS", "DEFAULT_COSTS", "SCHEDULES", "canonical_name", "stages_per_rank",
    "Action", "Schedule", "ScheduleError", "Slot", "Simulation",
    "parse_action", "stage_to_rank_map", "group_steps",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zbh1", "dualpipev", "get_schedule",
    "add_communication", "validate", "simulate",
    "load_schedule", "dump_schedule", "format_table", "format_timeline",
]

COMPUTE_KINDS = ("F", "B", "I", "W")  # forward, full backward, backward-input, backward-weight
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")  # activations forward, gradients backward
DEFAULT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}

_CELL = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)@s(\d+)$")
_CELL_HELP = "a cell is KIND MICROBATCH @s STAGE, e.g. F0@s1, B2@s0, I3@s0, W3@s0, SEND_F0@s1"


class ScheduleError(ValueError):
    """A schedule that would break a dependency or hang; ``rank``/``step``/``action`` locate it.

    ``step`` is the index into ``schedule.actions[rank]`` (``None`` when the problem is a missing
    action). The message says what is wrong and how to fix it.
    """

    def __init__(self, message: str, *, rank: Optional[int] = None, step: Optional[int] = None,
                 action: Optional["Action"] = None):
        super().__init__(message)
        self.rank, self.step, self.action = rank, step, action


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Action:
    """One entry of a rank's program.

    Compute kinds: ``F`` forward, ``B`` full backward (input and weight gradients), ``I``
    backward-input, ``W`` backward-weight (``I`` then ``W`` together replace one ``B``).
    Communication kinds each move one tensor between the ranks of two adjacent stages:
    ``SEND_F``/``RECV_F`` the activation of stage ``s`` to stage ``s + 1``, ``SEND_B``/``RECV_B``
    the input gradient of stage ``s`` to stage ``s - 1``. ``stage`` is always a stage living on
    this rank (the producer for a send, the consumer for a receive), so ``SEND_F(s, mb)`` matches
    ``RECV_F(s + 1, mb)`` and ``SEND_B(s, mb)`` matches ``RECV_B(s - 1, mb)``. ``peer`` is the
    other rank of a communication action (``None`` for compute).

    Example:
        Action("F", stage=1, microbatch=3)                 # cell "F3@s1"
        Action("SEND_F", stage=1, microbatch=3, peer=2)    # cell "SEND_F3@s1"
    """

    kind: str
    stage: int
    microbatch: int
    peer: Optional[int] = None

    def __post_init__(self):
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; valid kinds: "
                             f"{', '.join(COMPUTE_KINDS + COMM_KINDS)}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"{self}: stage and microbatch must be >= 0")
        if self.kind in COMPUTE_KINDS and self.peer is not None:
            raise ValueError(f"{self}: only communication actions have a peer")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def cell(self) -> str:
        """The table form, ``KIND MICROBATCH @s STAGE``: ``"F3@s1"``, ``"RECV_B0@s2"``."""
        return f"{self.kind}{self.microbatch}@s{self.stage}"

    def __str__(self) -> str:
        return f"{self.kind}(stage={self.stage}, mb={self.microbatch})"


def parse_action(cell: str) -> Action:
    """The :class:`Action` written as ``cell`` (peer left ``None``; a :class:`Schedule` fills it).

    Example:
        parse_action("I3@s0")    # Action("I", stage=0, microbatch=3)
    """
    match = _CELL.match(cell.strip())
    if match is None:
        raise ValueError(f"cannot read {cell!r}: {_CELL_HELP}")
    kind, mb, stage = match.groups()
    return Action(kind, int(stage), int(mb))


# ----------------------------------------------------------------------------- schedules


def stage_to_rank_map(n_ranks: int, n_stages: int, style: str = "loop") -> tuple[int, ...]:
    """Which rank holds each stage: ``"loop"`` puts stage ``s`` on ``s % n_ranks`` (GPipe, 1F1B,
    interleaved), ``"v"`` folds 2 stages per rank into a V (rank ``r`` holds ``r`` and ``2p-1-r``).

    Example:
        stage_to_rank_map(2, 4, "loop")   # (0, 1, 0, 1)
        stage_to_rank_map(2, 4, "v")      # (0, 1, 1, 0)
    """
    if n_ranks < 1 or n_stages < n_ranks or n_stages % n_ranks:
        raise ValueError(f"n_stages={n_stages} must be a positive multiple of n_ranks={n_ranks}")
    if style == "loop":
        return tuple(s % n_ranks for s in range(n_stages))
    if style == "v":
        if n_stages != 2 * n_ranks:
            raise ValueError(f"a V placement has 2 stages per rank: n_stages must be {2 * n_ranks}")
        return tuple(s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(n_stages))
    raise ValueError(f"unknown placement style {style!r}; valid styles: loop, v")


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``actions[r]`` is rank ``r``'s program, run in order.

    ``stage_to_rank[s]`` is the rank holding stage ``s`` (several stages per rank for virtual
    stages). Stage ``0`` takes the microbatch inputs and stage ``n_stages - 1`` computes the loss.
    Communication actions without a peer get it filled in from the stage map.

    Example:
        s = Schedule(((Action("F", 0, 0), Action("B", 0, 0)),), n_microbatches=1, stage_to_rank=(0,))
        s.n_ranks, s.n_stages       # (1, 1)
    """

    actions: tuple[tuple[Action, ...], ...]
    n_microbatches: int
    stage_to_rank: tuple[int, ...]
    name: str = "custom"

    def __post_init__(self):
        stage_to_rank = tuple(int(r) for r in self.stage_to_rank)
        if not stage_to_rank:
            raise ValueError("stage_to_rank is empty: a schedule needs at least one stage")
        if self.n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {self.n_microbatches}")
        if not self.actions:
            raise ValueError("a schedule needs at least one rank")
        bad = [r for r in stage_to_rank if not 0 <= r < len(self.actions)]
        if bad:
            raise ValueError(f"stage_to_rank {list(stage_to_rank)} names rank {bad[0]}, but the "
                             f"schedule has {len(self.actions)} ranks (0..{len(self.actions) - 1})")
        object.__setattr__(self, "stage_to_rank", stage_to_rank)
        object.__setattr__(self, "actions", tuple(
            tuple(self._with_peer(a) for a in rank_actions) for rank_actions in self.actions))

    def _with_peer(self, a: Action) -> Action:
        if not a.is_comm or a.peer is not None:
            return a
        other = a.stage + 1 if a.kind in ("SEND_F", "RECV_B") else a.stage - 1
        if not 0 <= other < self.n_stages:
            return a  # left for validate() to report with its rank and step
        return dataclasses.replace(a, peer=self.stage_to_rank[other])

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    @property
    def n_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def has_communication(self) -> bool:
        return any(a.is_comm for rank_actions in self.actions for a in rank_actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages living on ``rank``, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def compute_only(self) -> "Schedule":
        """The same schedule without its communication actions."""
        return dataclasses.replace(self, actions=tuple(
            tuple(a for a in rank_actions if not a.is_comm) for rank_actions in self.actions))

    def steps(self, rank: int) -> tuple[tuple[Action, ...], ...]:
        """Rank ``rank``'s program as executor steps (see :func:`group_steps`)."""
        return group_steps(self.actions[rank])


def group_steps(actions: Sequence[Action]) -> tuple[tuple[Action, ...], ...]:
    """Split a rank's program into steps: one compute action, or a maximal run of adjacent
    communication actions, which the executor posts together (one ``batch_isend_irecv``) and
    waits on before the next step.

    Example:
        steps = group_steps(add_communication(one_f_one_b(2, 2)).actions[0])
        [len(s) for s in steps]   # [1, 1, 1, 2, 1, 1, 1]: SEND_F1 and RECV_B0 go together
    """
    steps: list[tuple[Action, ...]] = []
    batch: list[Action] = []
    for a in actions:
        if a.is_comm:
            batch.append(a)
            continue
        if batch:
            steps.append(tuple(batch))
            batch = []
        steps.append((a,))
    if batch:
        steps.append(tuple(batch))
    return tuple(steps)


def _schedule(name: str, orders: Sequence[Sequence[tuple[str, int, int]]], n_microbatches: int,
              stage_to_rank: tuple[int, ...]) -> Schedule:
    """A compute-only schedule from per-rank ``(kind, stage, microbatch)`` triples."""
    return Schedule(tuple(tuple(Action(k, s, m) for k, s, m in order) for order in orders),
                    n_microbatches=n_microbatches, stage_to_rank=stage_to_rank, name=name)


# ----------------------------------------------------------------------------- generators


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


# ----------------------------------------------------------------------------- dependencies
# A compute action waits on events ("F", s, mb) forward done, ("G", s, mb) input gradient of
# stage s done (by B or I), ("I", s, mb) backward-input done; it produces some of them.


def _needs(a: Action, n_stages: int) -> list[tuple[str, int, int]]:
    s, mb = a.stage, a.microbatch
    if a.kind == "F":
        return [("F", s - 1, mb)] if s > 0 else []
    if a.kind in ("B", "I"):
        return [("F", s, mb)] + ([("G", s + 1, mb)] if s < n_stages - 1 else [])
    return [("I", s, mb)]  # W


def _produces(a: Action) -> list[tuple[str, int, int]]:
    s, mb = a.stage, a.microbatch
    return {"F": [("F", s, mb)], "B": [("G", s, mb)], "I": [("G", s, mb), ("I", s, mb)],
            "W": []}[a.kind]


def _event_str(event: tuple[str, int, int]) -> str:
    kind, s, mb = event
    return {"F": f"F(stage={s}, mb={mb})", "G": f"the input gradient of stage {s} mb {mb} (B or I)",
            "I": f"I(stage={s}, mb={mb})"}[kind]


def _recv_for(a: Action, sched: Schedule) -> Optional[Action]:
    """The receive compute action ``a`` needs on its rank, if its input lives on another rank."""
    s, mb, s2r = a.stage, a.microbatch, sched.stage_to_rank
    if a.kind == "F" and s > 0 and s2r[s - 1] != s2r[s]:
        return Action("RECV_F", s, mb, peer=s2r[s - 1])
    if a.kind in ("B", "I") and s < sched.n_stages - 1 and s2r[s + 1] != s2r[s]:
        return Action("RECV_B", s, mb, peer=s2r[s + 1])
    return None


def _send_for(a: Action, sched: Schedule) -> Optional[Action]:
    """The send that follows compute action ``a``, if its output goes to another rank."""
    s, mb, s2r = a.stage, a.microbatch, sched.stage_to_rank
    if a.kind == "F" and s < sched.n_stages - 1 and s2r[s + 1] != s2r[s]:
        return Action("SEND_F", s, mb, peer=s2r[s + 1])
    if a.kind in ("B", "I") and s > 0 and s2r[s - 1] != s2r[s]:
        return Action("SEND_B", s, mb, peer=s2r[s - 1])
    return None


def _counterpart(a: Action, sched: Schedule) -> Action:
    """The matching action on the peer: SEND_F(s) <-> RECV_F(s+1), SEND_B(s) <-> RECV_B(s-1)."""
    kind, other = {"SEND_F": ("RECV_F", a.stage + 1), "RECV_F": ("SEND_F", a.stage - 1),
                   "SEND_B": ("RECV_B", a.stage - 1), "RECV_B": ("SEND_B", a.stage + 1)}[a.kind]
    return Action(kind, other, a.microbatch, peer=sched.stage_to_rank[a.stage])


# ----------------------------------------------------------------------------- simulation


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


# ----------------------------------------------------------------------------- validation


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


# ----------------------------------------------------------------------------- communication


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


# ----------------------------------------------------------------------------- files


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


# ----------------------------------------------------------------------------- text views


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
