"""Faults on real gloo ranks (runtime/launch.py): a rank SIGKILLed mid-step, a hung rank, a rank
that raises, a run that makes no progress, Ctrl-C, and the CLI's exit code. Each run is stopped
within a bound of ``runtime.timeout_s``, the error names the rank, and no process of the run is left."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardfn.config import load_config
from shardfn.runtime import launch
from shardfn.runtime.launch import RankFailed, spawn
from shardfn.runtime.train import train

SMALL = ["mesh.dp=2", "train.steps=6", "train.batch_size=4", "train.seq_len=16", "train.log_every=1000"]
TAG = "SHARDFN_FAULT_TEST_TAG"


def _train_worker(overrides):
    return train(load_config("llama_tiny", overrides), log=lambda _: None).history[-1]["loss"]


def _sleep_worker(seconds):
    time.sleep(seconds)  # no progress calls, no collectives


def _processes_tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment holds ``TAG=tag`` (the run's ranks and their children)."""
    found, needle = [], f"{TAG}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and not _is_our_resource_tracker(entry):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found


def _is_our_resource_tracker(entry: Path) -> bool:
    """multiprocessing's resource tracker: one per launching process, it lives as long as this one."""
    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parent == os.getpid() and b"multiprocessing.resource_tracker" in (entry / "cmdline").read_bytes()


@pytest.fixture
def tagged(monkeypatch):
    """Tag the ranks' environment; after the test, assert none of them (or their children) lives."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)
    yield tag
    assert _processes_tagged(tag) == [], "a process of the run outlived it"


def _failure(monkeypatch, fault, worker, args, timeout_s):
    monkeypatch.setenv(launch.FAULT_ENV, fault)
    start = time.monotonic()
    with pytest.raises(RankFailed) as err:
        spawn(worker, 2, args=args, timeout_s=timeout_s)
    return str(err.value), time.monotonic() - start


def _stamped_train_worker(overrides, stamps):
    """``_train_worker`` that writes, before each fault check, when it made it (``time.monotonic``,
    one clock for every process of this machine) to ``stamps/RANK``: the last stamp of a rank the
    fault stopped is when it died or hung."""
    inject = launch._inject

    def stamped(fault, step):
        Path(stamps, os.environ["RANK"]).write_text(repr(time.monotonic()))
        inject(fault, step)

    launch._inject = stamped
    return _train_worker(overrides)


def _seconds_of_a_short_run() -> float:
    """How long 2 ranks take to start and run one step here, now: a measure of how busy the machine is."""
    start = time.monotonic()
    spawn(_train_worker, 2, args=([*SMALL, "train.steps=1"],), timeout_s=600)
    return time.monotonic() - start


def _fault_and_its_time(monkeypatch, tmp_path, fault, timeout_s):
    """Run ``fault`` on 2 ranks: the message, the seconds from the fault to the launcher's answer,
    and the seconds the ranks took to get there (start-up: how busy this machine is now)."""
    start = time.monotonic()
    message, _ = _failure(monkeypatch, fault, _stamped_train_worker, (SMALL, str(tmp_path)), timeout_s)
    answered = time.monotonic()
    stamp = tmp_path / fault.split(":")[1]
    assert stamp.exists(), f"the run stopped before the fault: {message}"
    faulted = float(stamp.read_text())
    return message, answered - faulted, faulted - start


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the orphan check reads /proc")
def test_sigkill_mid_step_names_the_rank_and_reaps_every_process(monkeypatch, tagged, tmp_path):
    timeout_s = 60
    message, after_death, _ = _fault_and_its_time(monkeypatch, tmp_path, "kill:1:2", timeout_s)
    assert message.startswith("rank 1 died: it was killed by SIGKILL"), message
    # seen from the exit itself: no collective timeout (timeout_s) had run out
    assert after_death < timeout_s, f"the death was seen {after_death:.0f} s after it, not at once"


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the orphan check reads /proc")
def test_a_hung_rank_is_named_within_the_timeout(monkeypatch, tagged, tmp_path):
    # every collective's bound, start-up's included: from how long a short run takes on this machine now
    timeout_s = max(6, round(1.5 * _seconds_of_a_short_run()))
    message, after_hang, startup = _fault_and_its_time(monkeypatch, tmp_path, "hang:1:2", timeout_s)
    assert message.startswith("rank 1 hung: it neither finished nor failed while rank(s) 0 waited"), message
    assert f"runtime.timeout_s={timeout_s} s" in message
    # found by the peers' collective timeout, or at the latest by the launcher's no-progress bound, then
    # settled; what a busy machine adds is allowed in proportion to how long the ranks took to start
    bound = timeout_s + launch.GRACE_S + launch.SETTLE_S + max(10.0, startup)
    assert timeout_s <= after_hang < bound, f"{after_hang:.1f} s after the hang (bound {bound:.0f} s)"


def test_a_rank_that_raises_is_named_with_its_error(monkeypatch, tagged):
    message, _ = _failure(monkeypatch, "raise:0:1", _train_worker, (SMALL,), timeout_s=60)
    assert message.startswith("rank 0 failed: RuntimeError: fault injected by SHARDFN_TEST_FAULT=raise:0:1 at step 1")
    assert "Traceback" in message, "the rank's traceback comes with it"


def test_no_progress_stops_the_run_after_timeout_plus_grace(monkeypatch, tagged):
    monkeypatch.setattr(launch, "GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 0 did not finish: no rank made progress for \d+ s "
                                         r"\(runtime.timeout_s=2 s \+ 1 s\); ranks 0, 1 did not finish"):
        spawn(_sleep_worker, 2, args=(3600,), timeout_s=2)
    assert time.monotonic() - start < 30


def test_fault_hook_rejects_a_malformed_value(monkeypatch):
    monkeypatch.setenv(launch.FAULT_ENV, "explode:1")
    with pytest.raises(ValueError, match="SHARDFN_TEST_FAULT='explode:1': write KIND:RANK:STEP with KIND one of kill"):
        launch.progress(0)


def test_blame_prefers_the_dead_rank_over_its_peers_connection_errors():
    closed = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    assert (
        launch.blame(2, {}, {0: closed}, {0: 1, 1: -9}, 30)
        == f"rank 1 died: it was killed by SIGKILL; then rank 0 failed: {closed}"
    )
    assert (
        launch.blame(2, {}, {}, {0: None, 1: 3}, 30) == "rank 1 died: it exited with code 3 without reporting an error"
    )
    own = "ValueError: batch too small\nTraceback ..."
    assert launch.blame(2, {}, {0: closed, 1: own}, {0: 1, 1: 1}, 30).startswith("rank 1 failed: ValueError: batch "
                                                                                 "too small")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the orphan check reads /proc")
def test_cli_exits_nonzero_naming_the_killed_rank(tmp_path, tagged):
    env = {**os.environ, launch.FAULT_ENV: "kill:1:2", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "shardfn.cli", "train", "--config", "llama_tiny", "--nproc", "2",
           *SMALL, "runtime.timeout_s=60"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # a bound
    assert done.returncode == 1, done.stderr[-2000:]
    # "died", not "hung": seen from the exit, not from runtime.timeout_s (the test above times it)
    assert "shardfn train: rank 1 died: it was killed by SIGKILL" in done.stderr


# ----------------------------------------------------------------------------- Ctrl-C

RUN_ON = ["model.n_layers=1", "train.batch_size=4", "train.seq_len=16", "train.steps=100000",
          "train.log_every=100000", "train.checkpoint.every=2", "train.checkpoint.dir=ckpt"]


def _as_in_a_terminal() -> None:
    """Give the child the SIGINT a foreground job in a terminal has. A suite started in the background
    (``cmd &`` in a script, ``nohup``) runs with SIGINT ignored, and an ignored SIGINT is inherited: the
    run would never see the Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c(tmp_path, *args) -> tuple[int, str]:
    """Run ``shardfn train ARGS`` in its own session and, once it has logged its first step and
    saved a checkpoint, send SIGINT to its process group (what Ctrl-C in a terminal does).

    The waits below are bounds against a run that never gets there, not expectations of speed."""
    from shardfn.runtime.checkpoint import latest_checkpoint

    cmd = [sys.executable, "-m", "shardfn.cli", "train", *RUN_ON, *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_as_in_a_terminal)
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                break
        assert not _ignores(proc.pid, signal.SIGINT), "the run inherited an ignored SIGINT: no Ctrl-C reaches it"
        deadline = time.monotonic() + 600
        while latest_checkpoint(tmp_path / "ckpt") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=600)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores ``signum`` (Linux: the SigIgn mask of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"no SigIgn line in /proc/{pid}/status")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the orphan check reads /proc")
@pytest.mark.parametrize("nproc, started", [([], "foreground"), (["--nproc", "2", "mesh.dp=2"], "foreground"),
                                            ([], "background")],
                         ids=["one-process", "nproc-2", "one-process-suite-in-background"])
def test_ctrl_c_stops_every_rank_and_says_how_to_resume(nproc, started, tmp_path, tagged):
    """``started="background"``: this process ignores SIGINT, as a suite started with ``&`` from a
    script does; the run must still get the Ctrl-C a terminal would send it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if started == "background" else None
    try:
        code, err = _ctrl_c(tmp_path, *nproc)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    assert code == 130, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    match = re.fullmatch(r"shardfn train: interrupted; the last complete checkpoint is (ckpt/step_\d{8}) \(step "
                         r"\d+\); resume with: shardfn train .*train\.checkpoint\.dir=ckpt.* --resume\n", err)
    assert match, err
    assert (tmp_path / match.group(1)).is_dir()


def test_the_summary_leaves_the_tracebacks_out():
    own = 'ValueError: batch too small\nTraceback (most recent call last):\n  File "x.py", line 1\nValueError'
    closed = "RuntimeError: [pair.cc:534] Connection closed by peer\nTraceback (most recent call last):\n ..."
    assert launch.cause(2, {}, {0: closed, 1: own}, {0: 1, 1: 1}) == ("raised", 1)
    assert launch.blame(2, {}, {0: closed, 1: own}, {0: 1, 1: 1}, 30, brief=True) == (
        "rank 1 failed: ValueError: batch too small; then rank 0 failed: RuntimeError: [pair.cc:534] Connection "
        "closed by peer")
    assert "Traceback" in launch.blame(2, {}, {0: closed, 1: own}, {0: 1, 1: 1}, 30)
