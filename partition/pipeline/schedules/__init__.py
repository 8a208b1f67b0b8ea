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

One module per idea: ``types`` (actions, schedules, errors), ``generators`` (the five schedules
and their names), ``dependencies`` (what each action waits on), ``simulate``, ``validate``,
``communication`` (sends and receives, overlapped pairs), ``files`` (YAML and CSV tables) and
``text`` (tables and timelines as text). Every public name is importable from here.
"""


from shardfn.partition.pipeline.schedules.communication import add_communication, pair_overlaps
from shardfn.partition.pipeline.schedules.files import dump_schedule, load_schedule
from shardfn.partition.pipeline.schedules.generators import (
    SCHEDULES,
    canonical_name,
    dualpipev,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    stages_per_rank,
    zbh1,
)
from shardfn.partition.pipeline.schedules.simulate import Simulation, Slot, simulate
from shardfn.partition.pipeline.schedules.text import format_table, format_timeline
from shardfn.partition.pipeline.schedules.types import (
    COMM_KINDS,
    COMPUTE_KINDS,
    DEFAULT_COSTS,
    Action,
    Schedule,
    ScheduleError,
    group_steps,
    parse_action,
    stage_to_rank_map,
)
from shardfn.partition.pipeline.schedules.validate import validate

__all__ = [
    "COMPUTE_KINDS", "COMM_KINDS", "DEFAULT_COSTS", "SCHEDULES", "canonical_name", "stages_per_rank",
    "Action", "Schedule", "ScheduleError", "Slot", "Simulation",
    "parse_action", "stage_to_rank_map", "group_steps",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zbh1", "dualpipev", "get_schedule",
    "add_communication", "pair_overlaps", "validate", "simulate",
    "load_schedule", "dump_schedule", "format_table", "format_timeline",
]
