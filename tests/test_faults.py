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


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the orphan check reads /proc")
def test_sigkill_mid_step_names_the_rank_and_reaps_every_process(monkeypatch, tagged):
    message, seconds = _failure(monkeypatch, "kill:1:2", _train_worker, (SMALL,), timeout_s=60)
    assert message.startswith("rank 1 died: it was killed by SIGKILL"), message
    assert seconds < 60, f"the death was seen after {seconds:.0f} s, not at once"


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the orphan check reads /proc")
def test_a_hung_rank_is_named_within_the_timeout(monkeypatch, tagged):
    timeout_s = 6
    message, seconds = _failure(monkeypatch, "hang:1:2", _train_worker, (SMALL,), timeout_s=timeout_s)
    assert message.startswith("rank 1 hung: it neither finished nor failed while rank(s) 0 waited"), message
    assert f"runtime.timeout_s={timeout_s} s" in message
    # startup (imports, tracing) + the collective timeout + the launcher's settle time
    assert seconds < 40 + timeout_s + launch.SETTLE_S, f"{seconds:.0f} s"


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
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "shardfn train: rank 1 died: it was killed by SIGKILL" in done.stderr
    assert time.monotonic() - start < 120


# ----------------------------------------------------------------------------- Ctrl-C

RUN_ON = ["model.n_layers=1", "train.batch_size=4", "train.seq_len=16", "train.steps=100000",
          "train.log_every=100000", "train.checkpoint.every=2", "train.checkpoint.dir=ckpt"]


def _ctrl_c(tmp_path, *args) -> tuple[int, str]:
    """Run ``shardfn train ARGS`` in its own session and, once it has logged its first step and
    saved a checkpoint, send SIGINT to its process group (what Ctrl-C in a terminal does)."""
    from shardfn.runtime.checkpoint import latest_checkpoint

    cmd = [sys.executable, "-m", "shardfn.cli", "train", *RUN_ON, *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                break
        deadline = time.monotonic() + 120
        while latest_checkpoint(tmp_path / "ckpt") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the orphan check reads /proc")
@pytest.mark.parametrize("nproc", [[], ["--nproc", "2", "mesh.dp=2"]], ids=["one-process", "nproc-2"])
def test_ctrl_c_stops_every_rank_and_says_how_to_resume(nproc, tmp_path, tagged):
    code, err = _ctrl_c(tmp_path, *nproc)
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
