"""Schedules as data: actions, per-rank action lists, the error a broken one raises.

    a = parse_action("F0@s1")                      # Action(kind='F', microbatch=0, stage=1)
    stage_to_rank_map(2, 4, "v")                   # (0, 1, 1, 0)
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

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
