"""What each action waits on and produces, and the P2P action that pairs with it.

    _needs(Action("B", 0, 1), 2)                   # [("F", 0, 1), ("G", 1, 1)]: its forward, the next stage's gradient
    _counterpart(send, sched)                      # the receive it meets
"""

from __future__ import annotations

from typing import Optional

from shardfn.partition.pipeline.schedules.types import Action, Schedule

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
