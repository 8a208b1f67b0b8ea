"""Pipeline schedules: theory values of the simulator, generator validity, validator messages,
deadlock-free communication placement, table files and the ``schedule`` CLI."""

import json
import random
import sys

import pytest

from shardfn.cli import schedule as schedule_cli
from shardfn.partition.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    add_communication,
    dualpipev,
    dump_schedule,
    format_table,
    format_timeline,
    get_schedule,
    gpipe,
    group_steps,
    interleaved_1f1b,
    load_schedule,
    one_f_one_b,
    pair_overlaps,
    parse_action,
    simulate,
    stage_to_rank_map,
    validate,
    zbh1,
)

SIZES = [(2, 2), (2, 4), (2, 5), (4, 4), (4, 8), (4, 12), (8, 16)]


def cells(*rows: str):
    """Per-rank action tuples from space-separated cells: cells("F0@s0 B0@s0", "...")."""
    return tuple(tuple(parse_action(c) for c in row.split()) for row in rows)


# ----------------------------------------------------------------------------- theory


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_gpipe_and_1f1b_bubble_is_textbook(make, p, m):
    sim = simulate(make(p, m))  # F=1, B=2
    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert sim.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize("p,m", SIZES)
def test_1f1b_with_backward_split_into_i_then_w(p, m):
    # The textbook value holds for B as one 2-unit action; as I then W (1 unit each) the gradient
    # leaves the stage one unit earlier, so the bubble shrinks, though not as far as ZB-H1's.
    sched = one_f_one_b(p, m)
    split = validate(Schedule(tuple(tuple(b for a in acts for b in (
        [Action("I", a.stage, a.microbatch), Action("W", a.stage, a.microbatch)]
        if a.kind == "B" else [a])) for acts in sched.actions), m, sched.stage_to_rank))
    assert simulate(zbh1(p, m)).bubble <= simulate(split).bubble < simulate(sched).bubble


@pytest.mark.parametrize("p,m", SIZES)
def test_peak_inflight(p, m):
    assert simulate(gpipe(p, m)).peak_inflight == (m,) * p
    expected = tuple(min(p - r, m) for r in range(p))  # 1F1B: p - r on rank r, at most p
    assert simulate(one_f_one_b(p, m)).peak_inflight == expected
    assert simulate(zbh1(p, m)).peak_inflight == expected  # ZB-H1 keeps 1F1B's memory


@pytest.mark.parametrize("p,m", SIZES)
def test_zbh1_bubble_is_a_third_of_1f1b(p, m):
    zb = simulate(zbh1(p, m)).bubble
    assert zb == pytest.approx((p - 1) / (3 * m + p - 1))  # (p-1)(F+I-W) idle per rank
    assert zb < simulate(one_f_one_b(p, m)).bubble


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble(p, m, v):
    sched = validate(get_schedule("interleaved_1f1b", p, m, n_virtual=v))
    assert sched.n_stages == p * v and sched.stage_to_rank == stage_to_rank_map(p, p * v)
    sim = simulate(sched)
    assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    assert sim.bubble < simulate(one_f_one_b(p, m)).bubble


def test_interleaved_needs_multiple_of_ranks():
    with pytest.raises(ValueError, match=r"multiple of n_ranks .*n_microbatches=6, n_ranks=4.*use 4 or 8"):
        interleaved_1f1b(4, 6)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 6), (4, 8), (4, 10), (8, 16)])
def test_dualpipev(p, m):
    sched = validate(get_schedule("dualpipev", p, m))
    assert sched.stage_to_rank == tuple(list(range(p)) + list(range(p - 1, -1, -1)))
    assert all(sched.stages_of(r) == (r, 2 * p - 1 - r) for r in range(p))
    sim = simulate(sched)
    busy = 2 * m * 3  # two stages, F + backward (B, or I + W) = 3 units each microbatch
    assert sim.makespan == busy + p - 1  # measured: p - 1 idle units per rank
    assert sim.bubble < simulate(zbh1(p, m)).bubble
    assert max(sim.peak_inflight) == 2 * p + 1  # half-size activations: p + 1/2 full ones
    with pytest.raises(ValueError, match="n_microbatches >= 2 \\* n_ranks"):
        dualpipev(p, 2 * p - 1)


# ----------------------------------------------------------------------------- generators


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 12])
def test_every_generator_validates(name, p, m):
    try:
        sched = get_schedule(name, p, m)
    except ValueError as e:  # the documented size limits only
        assert ("multiple of n_ranks" in str(e) and m % p) or ("2 * n_ranks" in str(e) and m < 2 * p)
        return
    assert validate(sched) is sched and sched.has_communication
    assert validate(sched.compute_only()).n_microbatches == m
    # the same compute order stays deadlock-free when communication is placed for other costs
    validate(add_communication(sched.compute_only(), costs={"F": 1, "B": 3, "I": 2, "W": 0.5}))


def test_get_schedule_errors_list_options():
    with pytest.raises(ValueError, match="valid names: gpipe, 1f1b, interleaved_1f1b, zbh1, dualpipev"):
        get_schedule("pipedream", 4, 8)
    with pytest.raises(ValueError, match="use interleaved_1f1b"):
        get_schedule("1f1b", 4, 8, n_virtual=2)
    assert get_schedule("Interleaved-1F1B", 2, 4).n_stages == 4  # case and dashes are forgiven


def test_stage_to_rank_map():
    assert stage_to_rank_map(4, 8) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_to_rank_map(4, 8, "v") == (0, 1, 2, 3, 3, 2, 1, 0)
    with pytest.raises(ValueError, match="valid styles"):
        stage_to_rank_map(2, 4, "zigzag")


def _random_compute_order(rng: random.Random, p: int, v: int, m: int, style: str) -> Schedule:
    """A random feasible compute order: run the pipeline picking any ready action at random."""
    s2r = stage_to_rank_map(p, p * v, style)
    n = p * v
    done, orders = set(), [[] for _ in range(p)]
    split = {(s, mb): rng.random() < 0.5 for s in range(n) for mb in range(m)}
    todo = {(k, s, mb) for s in range(n) for mb in range(m)
            for k in (("I", "W") if split[(s, mb)] else ("B",)) + ("F",)}
    while todo:
        ready = sorted(t for t in todo if all(d in done for d in {
            "F": [("F", t[1] - 1, t[2])] if t[1] else [],
            "B": [("F", t[1], t[2])] + ([("G", t[1] + 1, t[2])] if t[1] < n - 1 else []),
            "W": [("I", t[1], t[2])]}[t[0] if t[0] != "I" else "B"]))
        k, s, mb = rng.choice(ready)
        todo.remove((k, s, mb))
        done |= {(k, s, mb)} | ({("G", s, mb)} if k in "BI" else set())
        orders[s2r[s]].append(Action(k, s, mb))
    return Schedule(tuple(map(tuple, orders)), m, s2r, name="random")


def test_add_communication_is_deadlock_free_on_random_orders():
    rng = random.Random(0)
    for trial in range(60):
        p, v, m = rng.choice([2, 3, 4]), rng.choice([1, 2]), rng.randint(1, 5)
        sched = _random_compute_order(rng, p, v, m, rng.choice(["loop", "v"] if v == 2 else ["loop"]))
        full = add_communication(sched)  # validates, including the blocking-P2P run
        assert full.compute_only() == sched
        sends = [a for acts in full.actions for a in acts if a.kind.startswith("SEND")]
        recvs = [a for acts in full.actions for a in acts if a.kind.startswith("RECV")]
        assert len(sends) == len(recvs) > 0


def test_add_communication_layout():
    full = add_communication(one_f_one_b(2, 2))
    assert [a.cell for a in full.actions[0]] == [
        "F0@s0", "SEND_F0@s0", "F1@s0", "SEND_F1@s0", "RECV_B0@s0", "B0@s0", "RECV_B1@s0", "B1@s0"]
    assert [a.cell for a in full.actions[1]] == [
        "RECV_F0@s1", "F0@s1", "RECV_F1@s1", "B0@s1", "SEND_B0@s1", "F1@s1", "B1@s1", "SEND_B1@s1"]
    assert all(a.peer == 1 for a in full.actions[0] if a.is_comm)
    assert [len(step) for step in full.steps(0)] == [1, 1, 1, 2, 1, 1, 1]  # SEND_F1 + RECV_B0 batched
    # stages on the same rank exchange nothing: DualPipeV's turn at the bottom of the V is local
    v = get_schedule("dualpipev", 2, 4)
    assert not [a for a in v.actions[1] if a.is_comm and a.stage in (1, 2) and a.peer == 1]
    with pytest.raises(ValueError, match="already has communication"):
        add_communication(full)


def test_group_steps():
    f, s, r, b = (parse_action(c) for c in ("F0@s0", "SEND_F0@s0", "RECV_B0@s0", "B0@s0"))
    assert group_steps([f, s, r, b]) == ((f,), (s, r), (b,))
    assert group_steps([s]) == ((s,),)


def test_pair_overlaps_moves_the_forwards_send_after_the_pair_and_the_backwards_receive_before_it():
    original = get_schedule("dualpipev", 2, 4)
    paired, pairs = pair_overlaps(original)
    assert sorted(f"{r}:{f.cell}+{b.cell}" for r, f, b in pairs) == [
        "0:F2@s3+B0@s0", "0:F3@s0+B1@s3", "0:F3@s3+B1@s0", "1:F2@s1+B0@s2", "1:F2@s2+B0@s1", "1:F3@s1+B1@s2"]
    rank0 = " ".join(a.cell for a in paired.actions[0])
    assert "F3@s0 SEND_F3@s0 B1@s3" in " ".join(a.cell for a in original.actions[0])
    assert "F3@s0 B1@s3 SEND_F3@s0" in rank0 and "RECV_B0@s0 F2@s3 B0@s0" in rank0
    assert validate(paired) is paired
    assert [sorted(map(str, a)) for a in paired.actions] == [sorted(map(str, a)) for a in original.actions]
    for p, m in [(4, 8), (4, 12), (8, 16)]:   # every size pairs (none falls back)
        assert pair_overlaps(get_schedule("dualpipev", p, m))[1]
    one = get_schedule("1f1b", 4, 8)
    assert pair_overlaps(one) == (one, frozenset())


def test_pair_overlaps_makes_no_pair_when_the_moved_messages_would_not_validate(monkeypatch):
    from shardfn.partition.pipeline.schedules import communication

    def refuse(schedule):
        raise ScheduleError("blocked")

    original = get_schedule("dualpipev", 2, 6)
    monkeypatch.setattr(communication, "validate", refuse)  # the validator pair_overlaps asks
    assert pair_overlaps.__wrapped__(original) == (original, frozenset())


# ----------------------------------------------------------------------------- validator


def check_error(actions, match, rank, step, s2r=(0, 1), m=1):
    sched = Schedule(cells(*actions), m, s2r)
    with pytest.raises(ScheduleError, match=match) as info:
        validate(sched)
    assert (info.value.rank, info.value.step) == (rank, step)
    return info.value


def test_backward_before_forward():
    err = check_error(["F0@s0 F1@s0 B0@s0 B1@s0", "F0@s1 B0@s1 B1@s1 F1@s1"],
                      r"^rank 1 step 2: B\(stage=1, mb=1\) runs before F\(stage=1, mb=1\) \(step 3\)",
                      rank=1, step=2, m=2)
    assert err.action == Action("B", 1, 1)


def test_w_before_i():
    check_error(["F0@s0 W0@s0 I0@s0", "F0@s1 B0@s1"],
                r"^rank 0 step 1: W\(stage=0, mb=0\) runs before I\(stage=0, mb=0\) \(step 2\)",
                rank=0, step=1)


def test_receive_without_send():
    check_error(["F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0", "RECV_F0@s1 F0@s1 B0@s1"],
                r"^rank 0 step 2: RECV_B\(stage=0, mb=0\) has no matching SEND_B from rank 1",
                rank=0, step=2)


def test_missing_receive_in_a_schedule_with_communication():
    check_error(["F0@s0 SEND_F0@s0 B0@s0", "RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1"],
                r"^rank 0 step 2: B\(stage=0, mb=0\) needs RECV_B\(stage=0, mb=0\) from rank 1 before it",
                rank=0, step=2)


def test_deadlock_from_misordered_sends_and_receives():
    # Rank 0 sends F1 only after waiting for B0's gradient, while rank 1 waits for F1 first.
    err = check_error(["F0@s0 SEND_F0@s0 F1@s0 RECV_B0@s0 B0@s0 SEND_F1@s0 RECV_B1@s0 B1@s0",
                       "RECV_F0@s1 F0@s1 RECV_F1@s1 F1@s1 B0@s1 SEND_B0@s1 B1@s1 SEND_B1@s1"],
                      r"^deadlock with blocking P2P batches", rank=0, step=3, m=2)
    msg = str(err)
    assert "rank 0 step 3: RECV_B(stage=0, mb=0) from rank 1 waits for SEND_B(stage=1, mb=0) (rank 1 step 5)" in msg
    assert "rank 1 step 2: RECV_F(stage=1, mb=1) from rank 0 waits for SEND_F(stage=0, mb=1) (rank 0 step 5)" in msg
    # the same compute order with derived communication runs
    validate(add_communication(Schedule(cells(*["F0@s0 F1@s0 B0@s0 B1@s0", "F0@s1 F1@s1 B0@s1 B1@s1"]), 2, (0, 1))))


def test_messages_between_two_ranks_pair_up_in_order():
    check_error(["F0@s0 F1@s0 SEND_F1@s0 SEND_F0@s0 RECV_B0@s0 B0@s0 RECV_B1@s0 B1@s0",
                 "RECV_F0@s1 RECV_F1@s1 F0@s1 B0@s1 SEND_B0@s1 F1@s1 B1@s1 SEND_B1@s1"],
                r"^rank 1 step 0: RECV_F\(stage=1, mb=0\) from rank 0 would receive SEND_F\(stage=0, mb=1\)",
                rank=1, step=0, m=2)


def test_compute_only_cycle_is_a_deadlock():
    err = check_error(["F0@s0 B0@s0 F1@s0 B1@s0", "F1@s1 F0@s1 B0@s1 B1@s1"],
                      r"^deadlock: the ranks wait on each other", rank=0, step=1, m=2)
    assert "rank 1 step 0: F(stage=1, mb=1) waits for F(stage=0, mb=1) from rank 0" in str(err)


def test_duplicate_missing_and_misplaced_actions():
    check_error(["F0@s0 F0@s0 B0@s0", "F0@s1 B0@s1"], r"^rank 0 step 1: F\(stage=0, mb=0\) is a duplicate \(first at "
                                                      r"step 0\)",
                rank=0, step=1)
    check_error(["F0@s0 B0@s0", "F0@s1 I0@s1"], r"^rank 1: W\(stage=1, mb=0\) is missing", rank=1, step=None)
    check_error(["F0@s0 F1@s0 B0@s0 B1@s0", "F0@s1 B0@s1"], r"^rank 1: F\(stage=1, mb=1\) is missing",
                rank=1, step=None, m=2)
    check_error(["F0@s0 B0@s0 F0@s1", "B0@s1"], r"^rank 0 step 2: F\(stage=1, mb=0\) is on rank 0, but stage 1 lives "
                                                r"on rank 1",
                rank=0, step=2)
    check_error(["B0@s0", "F0@s1 B0@s1"], r"^rank 0 step 0: B\(stage=0, mb=0\) needs F\(stage=0, mb=0\) "
                r"before it, and rank 0 never runs it", rank=0, step=0)
    check_error(
        ["F0@s0 B0@s0 W0@s0", "F0@s1 B0@s1"],
        r"^rank 0 step 2: W\(stage=0, mb=0\) but the backward is a full B",
        rank=0,
        step=2,
    )
    check_error(["F0@s0 SEND_F0@s0 B0@s0", "F0@s1 B0@s1"], r"is not needed: stages 0 and 1 both live on rank 0",
                rank=0, step=1, s2r=(0, 0))


# ----------------------------------------------------------------------------- files and views


@pytest.mark.parametrize("suffix", [".yaml", ".csv"])
@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "dualpipev"])
def test_dump_load_round_trip(tmp_path, suffix, name):
    for sched in (get_schedule(name, 2, 4), get_schedule(name, 2, 4, communication=False)):
        path = dump_schedule(sched, tmp_path / f"s{suffix}")
        assert load_schedule(path) == sched


def test_example_files_load(tmp_path):
    zb = validate(load_schedule("examples/schedules/zb_2x4.yaml"))
    assert zb.actions == zbh1(2, 4).actions and zb.name == "zb_2x4"
    csv = validate(load_schedule("examples/schedules/1f1b_2x4.csv"))
    assert csv.actions == one_f_one_b(2, 4).actions and csv.stage_to_rank == (0, 1)


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ranks:\n  - [F0@s0, F0s0]\n")
    with pytest.raises(ValueError, match=r"bad.yaml: rank 0 cell 1: cannot read 'F0s0': a cell is KIND"):
        load_schedule(bad)
    bad.write_text("rank: []\n")
    with pytest.raises(ValueError, match="'ranks' list"):
        load_schedule(bad)
    bad.write_text("ranks:\n  - F0@s0\n  - F0@s0\n")
    with pytest.raises(ValueError, match="stage 0 appears on ranks 0 and 1"):
        load_schedule(bad)
    bad.write_text("ranks: []\nsteps: 3\n")
    with pytest.raises(ValueError, match="unknown key 'steps'; valid keys: ranks, name"):
        load_schedule(bad)


def test_text_views():
    sched = one_f_one_b(2, 2)
    assert format_table(sched).splitlines()[1].split() == ["step", "0", "F0@s0", "F0@s1"]
    assert format_timeline(sched, simulate(sched)).splitlines() == [
        "rank 0  F0 F1 .  .  B0 ~  .  B1 ~", "rank 1  .  F0 B0 ~  F1 B1 ~  .  ."]


# ----------------------------------------------------------------------------- CLI


def test_cli_json(capsys):
    assert schedule_cli.main(["--name", "1f1b", "--stages", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"bubble", "peak_inflight", "makespan", "actions", "n_ranks", "n_stages"} <= set(out)
    assert out["bubble"] == pytest.approx(3 / 11) and out["peak_inflight"] == [4, 3, 2, 1]
    assert out["makespan"] == 33 and len(out["actions"]) == 4


def test_cli_text_file_and_errors(capsys, tmp_path):
    assert schedule_cli.main(["--file", "examples/schedules/zb_2x4.yaml", "--save", str(tmp_path / "s.csv")]) == 0
    out = capsys.readouterr().out
    assert "bubble         0.0769" in out and "peak_inflight  2 1" in out
    assert load_schedule(tmp_path / "s.csv").has_communication
    assert schedule_cli.main(["--name", "interleaved_1f1b", "--stages", "4", "--microbatches", "6"]) == 2
    assert "multiple of n_ranks" in capsys.readouterr().err
    assert schedule_cli.main(["--costs", "F=1,B"]) == 2
    assert "KIND=TIME" in capsys.readouterr().err


def test_cli_plot_without_matplotlib(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert schedule_cli.main(["--plot", str(tmp_path / "t.png")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    assert schedule_cli.main(["--name", "dualpipev", "--stages", "2", "--microbatches", "4",
                              "--plot", str(path), "--json"]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
