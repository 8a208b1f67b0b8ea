"""Two members of an overlapped pair taking turns at their waits (``runtime.interleave``), on one
process: the order of their compute, the turn log, errors, and the pipeline trace of a pair."""

import threading

import pytest

from shardfn.runtime import executor
from shardfn.runtime.interleave import handoff, run_pair


def test_the_second_member_computes_while_the_first_waits():
    """The first member's wait can only end because the second runs during it (a one-thread
    run of the two in turn would wait forever), and each resumes only on its turn."""
    order, sent = [], threading.Event()

    def first():
        order.append("F: up to its exchange")
        with handoff():
            assert sent.wait(timeout=10), "the second member did not run while the first waited"
        order.append("F: after its exchange")

    def second():
        order.append("B: while F's exchange is in flight")
        sent.set()
        with handoff():
            pass
        order.append("B: after its own exchange")

    log = run_pair(first, second)
    assert order == ["F: up to its exchange", "B: while F's exchange is in flight", "F: after its exchange",
                     "B: after its own exchange"]
    assert [(who, event) for who, event, _ in log] == [
        (0, "start"), (0, "handoff"), (1, "start"), (1, "handoff"), (0, "resume"), (0, "end"), (1, "resume"),
        (1, "end")]
    times = [ns for _, _, ns in log]
    assert times == sorted(times)


def test_handoff_outside_a_pair_waits_in_place():
    ran = []
    with handoff():   # no pair: nothing to switch to, and nothing blocks
        ran.append(threading.get_ident())
    assert ran == [threading.get_ident()]   # the body ran once, here


def test_a_members_error_is_raised_after_both_are_done():
    finished = []

    def first():
        with handoff():
            pass
        raise ValueError("bad forward")

    def second():
        with handoff():
            pass
        finished.append(True)

    with pytest.raises(ValueError, match="bad forward"):
        run_pair(first, second)
    assert finished == [True]


def test_a_pairs_trace_splits_each_member_at_its_handoffs():
    """Each member's compute event is cut into the stretches it held the turn; between them an
    ``EP`` event (its exchange in flight while the other computed), drawn on thread 1."""
    log = [(0, "start", 0), (0, "handoff", 10), (1, "start", 11), (1, "handoff", 30), (0, "resume", 31),
           (0, "end", 40), (1, "resume", 41), (1, "end", 50)]
    f = [{"name": "F2@s1", "kind": "F", "stage": 1, "mb": 2, "start_ns": 0, "end_ns": 40, "rank": 2}]
    b = [{"name": "WAIT_B0@s2", "kind": "P2P", "stage": 2, "mb": 0, "start_ns": 11, "end_ns": 15, "rank": 2},
         {"name": "B0@s2", "kind": "B", "stage": 2, "mb": 0, "start_ns": 15, "end_ns": 50, "rank": 2}]
    events = executor._pair_events(f, b, log, 2)
    assert [(e["name"], e["kind"], e["start_ns"], e["end_ns"]) for e in events] == [
        ("F2@s1", "F", 0, 10), ("EXCHANGE_F2@s1", "EP", 10, 31), ("WAIT_B0@s2", "P2P", 11, 15),
        ("B0@s2", "B", 15, 30), ("EXCHANGE_B0@s2", "EP", 30, 41), ("F2@s1", "F", 31, 40), ("B0@s2", "B", 41, 50)]
    # busy time: F 10 + 9, B 15 + 9; the EP and P2P stretches are idle
    assert executor.bubble_fraction(events) == pytest.approx(1 - 43 / 50)


def test_on_cpu_a_pair_has_no_streams_and_keeps_nothing_past_its_end():
    import torch

    held = torch.ones(3)
    seen = []
    run_pair(lambda: seen.append("F"), lambda: seen.append("B"), device=torch.device("cpu"), keep=[held])
    assert seen == ["F", "B"]


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_second_member_runs_on_its_own_stream_joined_at_both_ends():
    import torch

    from shardfn.runtime.interleave import side_stream

    device = torch.device("cuda", torch.cuda.current_device())
    main = torch.cuda.current_stream(device)
    x = torch.randn(2048, 2048, device=device)
    y = x @ x                                                  # queued on the main stream before the pair
    streams, out = {}, {}

    def first():
        streams["F"] = torch.cuda.current_stream(device)
        out["F"] = (x @ x).sum()

    def second():
        streams["B"] = torch.cuda.current_stream(device)
        assert torch.cuda.current_device() == device.index
        out["B"] = (y @ x).sum()                               # reads the main stream's y: joined at the start

    run_pair(first, second, device=device, keep=[y])
    assert streams["F"] == main and streams["B"] == side_stream(device) and streams["B"] != main
    assert torch.cuda.current_stream(device) == main            # this thread is back on its stream
    torch.testing.assert_close(out["B"], ((x @ x) @ x).sum(), rtol=1e-3, atol=1e-1)  # read on main: joined at the end
