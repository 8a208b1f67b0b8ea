"""Sharded checkpoints (runtime/checkpoint.py): layout on disk, atomic saves, keep-K, exact resume
on one device and on gloo meshes (pipeline ones too), resharding on load, a save killed midway, and bad input."""

import json
import math
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fixtures import trained_state
from torch.distributed.tensor import DTensor

from shardfn import models
from shardfn.config import load_config
from shardfn.core.pytree import flatten_with_paths, tree_leaves
from shardfn.runtime import checkpoint as ck
from shardfn.runtime import data
from shardfn.runtime import run_identity as ri
from shardfn.runtime.launch import RankFailed, spawn
from shardfn.runtime.train import train
from shardfn.runtime.train_step import make_optimizer

SMALL = ["train.batch_size=4", "train.seq_len=16", "train.log_every=1000", "train.warmup_steps=2"]


def _state(config=None, overrides=(), steps=1):
    """``(cfg, params, opt_state)`` after ``steps`` real optimizer steps (every state leaf nonzero)."""
    cfg, _, params, state = trained_state(config, [*SMALL, *overrides], steps=steps)
    return cfg, params, state


def _fresh(cfg):
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, cfg.train.seed + 1)  # other values, same shapes
    return params, make_optimizer(cfg.train, model).init(params)


def _assert_trees_equal(a, b):
    fa, fb = flatten_with_paths(a), flatten_with_paths(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        assert x.dtype == y.dtype and torch.equal(x, y), path


def _run(config, overrides, metrics=None):
    return train(load_config(config, [*SMALL, *overrides]), metrics_path=metrics, log=lambda _: None)


def _losses(metrics_path):
    return {r["step"]: r["loss"] for r in map(json.loads, Path(metrics_path).read_text().splitlines())}


# ----------------------------------------------------------------------------- one process


def test_roundtrip_is_bitwise_with_step_data_position_and_rng(tmp_path):
    cfg, params, state = _state("moe_tiny", steps=2)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    path = ck.save_checkpoint(tmp_path, 2, params, state, config=cfg.to_dict())
    torch.rand(10)  # the generator moves on; the checkpoint holds where it was
    like_p, like_s = _fresh(cfg)
    loaded = ck.load_checkpoint(path, like_p, like_s, config=cfg.to_dict())
    assert (loaded.step, loaded.data_position) == (2, 2)
    _assert_trees_equal(loaded.params, params)
    _assert_trees_equal(loaded.opt_state, state)
    assert type(loaded.opt_state) is type(state) and torch.equal(loaded.rng_state, rng)
    assert not torch.equal(like_p["embed"], params["embed"]), "the _like trees are not written into"


def test_layout_on_disk_keys_and_meta(tmp_path):
    cfg, params, state = _state()
    path = ck.save_checkpoint(tmp_path, 7, params, state, config=cfg.to_dict())
    assert path == tmp_path / "step_00000007" and ck.checkpoint_path(tmp_path, 7) == path
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "COMPLETE", "__0_0.distcp", "meta.json"]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == meta["data_position"] == 7 and meta["world_size"] == 1
    assert meta["config"]["model"]["name"] == "llama" and meta["mesh"]["fsdp"] == 1
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    assert {"params.embed", "opt_state.1.0.mu.embed", "opt_state.1.0.count", "train.step",
            "train.data_position", "rng.cpu.rank0"} <= keys
    assert len([k for k in keys if k.startswith("params.")]) == len(flatten_with_paths(params))


def test_keep_k_and_incomplete_saves_are_never_latest(tmp_path):
    params = {"w": torch.arange(4.0)}
    from shardfn.core import optim

    state = optim.adamw(0.1).init(params)
    for step in (1, 2, 3, 4):
        ck.save_checkpoint(tmp_path, step, {"w": params["w"] + step}, state, keep=2)
    assert [p.name for p in ck.complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    # A killed save (tmp dir, even one holding everything), a dir without the marker, one without
    # DCP's index: none is ever the latest, and none loads.
    shutil.copytree(tmp_path / "step_00000004", tmp_path / "step_00000009.tmp")
    shutil.copytree(tmp_path / "step_00000004", tmp_path / "step_00000008")
    (tmp_path / "step_00000008" / "COMPLETE").unlink()
    shutil.copytree(tmp_path / "step_00000004", tmp_path / "step_00000007")
    (tmp_path / "step_00000007" / ".metadata").unlink()
    assert ck.latest_checkpoint(tmp_path).name == "step_00000004"
    for bad in ("step_00000009.tmp", "step_00000008", "step_00000007"):
        with pytest.raises(ValueError, match="not a complete checkpoint"):
            ck.load_checkpoint(tmp_path / bad, params, state)
    loaded = ck.load_checkpoint(ck.latest_checkpoint(tmp_path), params, state)
    assert loaded.step == 4 and torch.equal(loaded.params["w"], params["w"] + 4)
    ck.save_checkpoint(tmp_path, 10, params, state, keep=2)  # the next save clears the killed one
    assert not (tmp_path / "step_00000009.tmp").exists()
    assert ck.latest_checkpoint(tmp_path).name == "step_00000010"


def _interrupted_fsync(_fd):
    raise KeyboardInterrupt


def _interrupted_torch_save(*_args, **_kwargs):
    """What a Ctrl-C inside ``torch.save`` looks like: the zip writer's ``__exit__`` runs while the
    interrupt unwinds and raises its own error, with the interrupt as its context."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


@pytest.mark.parametrize("where", ["fsync", "torch.save"])
def test_ctrl_c_inside_a_save_is_a_keyboard_interrupt_and_publishes_nothing(tmp_path, monkeypatch, where):
    """DCP catches a Ctrl-C in its writer and wraps it in a CheckpointException, sometimes behind
    the error torch.save's cleanup raised: the save raises KeyboardInterrupt again (so the run
    stops with 130 and its resume line) and leaves the last complete checkpoint the latest."""
    from shardfn.core import optim

    params = {"w": torch.arange(4.0)}
    state = optim.adamw(0.1).init(params)
    ck.save_checkpoint(tmp_path, 1, params, state)

    if where == "fsync":
        monkeypatch.setattr(os, "fsync", _interrupted_fsync)
    else:
        monkeypatch.setattr(torch, "save", _interrupted_torch_save)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 2, params, state)
    monkeypatch.undo()
    assert ck.latest_checkpoint(tmp_path).name == "step_00000001"
    assert not (tmp_path / "step_00000002").exists()


@pytest.mark.parametrize("config", ["llama_tiny", "moe_tiny"])
def test_resume_is_exact_on_one_device(tmp_path, config):
    common = ["train.steps=4", "train.checkpoint.every=2"]
    full = _run(config, [*common, f"train.checkpoint.dir={tmp_path / 'a'}"])
    shutil.copytree(tmp_path / "a" / "step_00000002", tmp_path / "b" / "step_00000002")
    resumed = _run(config, [*common, f"train.checkpoint.dir={tmp_path / 'b'}", "train.checkpoint.resume=true"])
    assert [r["step"] for r in resumed.history] == [3, 4]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in resumed.history] == [r[key] for r in full.history[2:]]
    _assert_trees_equal(resumed.params, full.params)
    _assert_trees_equal(resumed.opt_state, full.opt_state)


def test_a_different_model_or_optimizer_is_named(tmp_path):
    cfg, params, state = _state()
    path = ck.save_checkpoint(tmp_path, 1, params, state, config=cfg.to_dict())
    other = load_config(None, [*SMALL, "model.dim=32", "model.ffn_dim=128"])
    with pytest.raises(ValueError) as e:
        ck.load_checkpoint(path, *_fresh(other), config=other.to_dict())
    msg = str(e.value)
    assert "'params.embed' has shape (256, 64), this run's has (256, 32)" in msg
    assert "model.dim is 64 in the checkpoint and 32 here" in msg and "train.checkpoint.dir" in msg
    no_clip = load_config(None, [*SMALL, "train.grad_clip=null"])
    with pytest.raises(ValueError, match=r"has no 'opt_state\.0\.count'.*different model or optimizer"):
        ck.load_checkpoint(path, *_fresh(no_clip))
    more = {**params, "extra": torch.ones(2)}
    with pytest.raises(ValueError, match=r"has no 'params\.extra'"):
        ck.load_checkpoint(path, more, make_optimizer(cfg.train, models.get("llama")).init(more))
    half = {k: v.to(torch.bfloat16) if k == "embed" else v for k, v in params.items()}
    with pytest.raises(ValueError, match=r"'params\.embed' is torch\.float32, this run's is torch\.bfloat16"):
        ck.load_checkpoint(path, half, state)


def test_resume_policy_errors(tmp_path):
    def cfg(*extra):  # the train.checkpoint section that resume_path reads
        return load_config(None, [*SMALL, f"train.checkpoint.dir={tmp_path}", *extra]).train.checkpoint

    with pytest.raises(ValueError, match=r"train.checkpoint.resume=true \(--resume\).*holds no complete checkpoint"):
        ri.resume_path(cfg("train.checkpoint.resume=true"))
    assert ri.resume_path(cfg("train.checkpoint.every=2")) is None  # auto, first run
    _, params, state = _state()
    ck.save_checkpoint(tmp_path, 3, params, state)
    assert ri.resume_path(cfg("train.checkpoint.every=2")) == tmp_path / "step_00000003"
    assert ri.resume_path(cfg()) is None  # auto without checkpointing: nothing is read
    assert ri.resume_path(cfg("train.checkpoint.resume=true")) == tmp_path / "step_00000003"
    with pytest.raises(ValueError, match=r"resume=false.*newest: step_00000003.*fresh"):
        ri.resume_path(cfg("train.checkpoint.every=2", "train.checkpoint.resume=false"))
    assert ri.resume_path(cfg("train.checkpoint.every=2", "mesh.pp=2")) == tmp_path / "step_00000003"  # any layout
    with pytest.raises(ValueError, match="train.checkpoint.resume must be auto, true or false"):
        cfg("train.checkpoint.resume=sometimes")


def test_cli_resume_flag(tmp_path, capsys):
    from shardfn.cli import main

    args = ["train", *SMALL, "train.steps=2", "model.n_layers=1", f"train.checkpoint.dir={tmp_path}"]
    assert main([*args, "--resume"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main([*args, "train.checkpoint.every=2"]) == 0
    capsys.readouterr()
    assert main([*args, "train.steps=3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resuming from {tmp_path / 'step_00000002'} (step 2)" in out and "steps 2->3" in out


def test_the_default_directory_is_the_runs_own(tmp_path, monkeypatch, capsys):
    from shardfn.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["train", *SMALL, "model.n_layers=1", "train.checkpoint.every=2"]
    assert main([*args, "train.steps=2"]) == 0
    (own,) = (tmp_path / "runs").iterdir()
    assert own.name.startswith("llama_tiny-")
    assert f"checkpoints every 2 steps in runs/{own.name}" in capsys.readouterr().out
    assert main([*args, "train.steps=2", "train.lr=1e-3"]) == 0  # another run: not the first one's checkpoint
    out = capsys.readouterr().out
    assert "resuming" not in out and "steps 0->2" in out
    assert len(list((tmp_path / "runs").iterdir())) == 2
    assert main([*args, "train.steps=3"]) == 0  # the same command, with more steps: resumes its own
    out = capsys.readouterr().out
    assert (f"resuming from runs/{own.name}/step_00000002 (step 2); changed since the checkpoint: "
            f"train.steps 2 -> 3\n") in out


def test_run_id_names_what_is_trained():
    def rid(*overrides):
        return ri.run_id(load_config(None, [*SMALL, *overrides]).to_dict())

    assert rid() == rid("train.steps=7", "train.log_every=3", "mesh.dp=2", "runtime.threads=2",
                        "train.checkpoint.every=5", "pipeline.microbatches=2")
    assert len({rid(), rid("train.lr=1e-3"), rid("model.n_layers=1"), rid("train.seed=1"),
                rid("data.corpus_bytes=4096")}) == 5
    cfg = load_config(None, SMALL)
    assert ri.run_directory(cfg) == f"runs/llama_tiny-{rid()}" and cfg.train.checkpoint.dir is None
    assert ri.with_run_directory(cfg).train.checkpoint.dir == ri.run_directory(cfg)
    assert ri.run_directory(load_config(None, [*SMALL, "train.checkpoint.dir=mine"])) == "mine"


def test_resume_prints_what_changed_and_refuses_another_model(tmp_path, capsys):
    from shardfn.cli import main

    args = ["train", *SMALL, "train.steps=2", "train.checkpoint.every=2", f"train.checkpoint.dir={tmp_path}"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "train.lr=1e-3", "train.steps=3", "runtime.threads=2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"resuming from {tmp_path / 'step_00000002'} (step 2); changed since the checkpoint: "
                          f"train.lr 0.003 -> 0.001, train.steps 2 -> 3\n"), out
    for nproc in ([], ["--nproc", "2", "mesh.dp=2"]):  # refused before any rank is spawned
        assert main([*args, "train.steps=4", "model.n_layers=1", *nproc]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"shardfn train: error: checkpoint {tmp_path / 'step_00000003'} holds another model: "
                              f"model.n_layers is 2 there and 1 here. Resume it with the model it was saved with")
        assert "Traceback" not in err and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match=r"holds another model: model\.n_layers is 2 there and 1 here"):
        _run(None, ["train.steps=4", "model.n_layers=1", "train.checkpoint.every=2",
                    f"train.checkpoint.dir={tmp_path}"])
    meta = tmp_path / "step_00000003" / "meta.json"  # as saved before model.init_std existed
    saved = json.loads(meta.read_text())
    del saved["config"]["model"]["init_std"]
    meta.write_text(json.dumps(saved))
    now = load_config(None, [*SMALL, "train.lr=1e-3", "train.steps=3", "train.checkpoint.every=2"])
    assert ri.check_resume(meta.parent, now.to_dict()) == ["model.init_std null -> 0.02"]


# ----------------------------------------------------------------------------- gloo meshes


def _die_inside_save(step: int) -> None:
    """SIGKILL this process inside the save of ``step``, right after its shard file is written."""
    import torch.distributed.checkpoint as dcp

    write = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        done = write(self, plan, planner)
        done.wait()
        if Path(self.path).name == f"step_{step:08d}.tmp":
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    dcp.FileSystemWriter.write_data = write_then_die


def _train_worker(config, overrides, metrics=None, kill=None):
    """A rank's run: ``kill=(rank, step)`` dies inside that save; returns the gathered final state."""
    import torch.distributed as dist

    from shardfn.runtime.partitioned import full

    if kill is not None and dist.get_rank() == kill[0]:
        _die_inside_save(kill[1])
    result = _run(config, overrides, metrics)
    return {"losses": [r["loss"] for r in result.history], "params": full(result.params),
            "opt_state": full(result.opt_state)}


def _exact_resume_worker(config, overrides, d):
    """2N steps, saving after N; then a restore of step N (DTensors, this mesh's layout) and N more
    steps from it, with the same compiled step: both halves' losses and states, per rank."""
    from shardfn.runtime.build import build_step
    from shardfn.runtime.partitioned import full

    cfg = load_config(config, [*SMALL, *overrides])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, cfg.train.seed)
    step_fn = build_step(cfg, model, params)
    params, state = step_fn.place(params)
    tokens = data.from_config(cfg.data)
    batches = [data.get_batch(tokens, s, batch_size=4, seq_len=16) for s in range(4)]
    p, s, losses = params, state, []
    for i, b in enumerate(batches):
        p, s, m = step_fn(p, s, b)
        losses.append(float(m["loss"]))
        if i == 1:
            ck.save_checkpoint(d, 2, p, s, config=cfg.to_dict())
            at_2 = full((p, s))
    loaded = ck.restore(ck.latest_checkpoint(d), step_fn, *step_fn.place(model.init(cfg.model, cfg.train.seed)),
                        config=cfg.to_dict())
    assert all(isinstance(x, DTensor) for x in tree_leaves((loaded.params, loaded.opt_state)))
    p, s, again = loaded.params, loaded.opt_state, []
    for b in batches[loaded.step:]:
        p, s, m = step_fn(p, s, b)
        again.append(float(m["loss"]))
    return {"losses": losses, "again": again, "at_2": at_2, "loaded": full((loaded.params, loaded.opt_state)),
            "end": full((p, s))}


def _reshard_save_worker(config, overrides, d):
    """Save a known state (one device's, after 1 step) as DTensors of this mesh's layout."""
    from shardfn.runtime.partitioned import distribute, layout, mesh_from_config

    cfg, params, state = _state(config, overrides)
    mesh = mesh_from_config(cfg)
    specs = layout(cfg, models.get(cfg.model_name), params, state, mesh)
    p, s = distribute(params, specs["params"], mesh), distribute(state, specs["opt_state"], mesh)
    assert {tuple(x.placements) for x in tree_leaves(p)} > {tuple(x.placements) for x in tree_leaves(p)[:1]}
    return str(ck.save_checkpoint(d, 1, p, s, config=cfg.to_dict()))


def _reshard_load_worker(config, overrides, path):
    """Load ``path`` in this mesh's layout (each rank its own shards), gathered; then train on from it."""
    from shardfn.runtime.build import build_step
    from shardfn.runtime.partitioned import full

    cfg = load_config(config, [*SMALL, *overrides])
    model = models.get(cfg.model_name)
    params = model.init(cfg.model, cfg.train.seed + 1)
    step = build_step(cfg, model, params)
    like = step.to_checkpoint(*step.place(params))
    assert all(isinstance(x, DTensor) for x in tree_leaves(like))
    loaded = ck.load_checkpoint(path, *like)
    resumed = _run(config, [*overrides, "train.steps=2", f"train.checkpoint.dir={Path(path).parent}",
                            "train.checkpoint.resume=true"])
    return {"params": full(loaded.params), "opt_state": full(loaded.opt_state), "step": loaded.step,
            "losses": [r["loss"] for r in resumed.history]}


@pytest.mark.slow  # the one-device killed-save tests and the mesh resume tests stay in the default suite
def test_killed_save_keeps_the_previous_one_and_resume_is_exact_on_a_mesh(tmp_path):
    # A 2N-step run (N=2) on fsdp=2 whose rank 1 is SIGKILLed inside the save after step 2N (its
    # shard written, the others not); then N + resume + N in fresh processes.
    config, d = "llama_tiny", tmp_path / "ckpt"
    common = ["mesh.fsdp=2", "train.steps=6", "train.checkpoint.every=2", "train.checkpoint.keep=2",
              f"train.checkpoint.dir={d}"]
    with pytest.raises(RankFailed):
        spawn(_train_worker, 2, args=(config, common, str(tmp_path / "killed.jsonl"), (1, 4)), timeout_s=600)
    killed = _losses(tmp_path / "killed.jsonl")
    assert sorted(killed) == [1, 2, 3, 4], "the killed run got through step 4 before its save"
    tmp = d / "step_00000004.tmp"
    assert list(tmp.glob("*.distcp")) and not (tmp / "COMPLETE").exists() and not (d / "step_00000004").exists()
    assert ck.latest_checkpoint(d) == d / "step_00000002"
    assert ck.load_checkpoint(d / "step_00000002", *_fresh(load_config(config, SMALL))).step == 2  # it loads

    resume = [*common, "train.checkpoint.resume=true"]
    resumed = spawn(_train_worker, 2, args=(config, resume, str(tmp_path / "resumed.jsonl")), timeout_s=600)
    again = _losses(tmp_path / "resumed.jsonl")
    assert sorted(again) == [3, 4, 5, 6]
    assert [again[3], again[4]] == [killed[3], killed[4]], "bitwise: N + resume + N is the 2N-step run"
    assert resumed[0]["losses"] == resumed[1]["losses"] == [again[k] for k in (3, 4, 5, 6)]
    assert sorted(p.name for p in d.iterdir()) == ["step_00000004", "step_00000006"], "keep 2; the killed save cleared"


def test_resume_is_exact_on_a_moe_mesh(tmp_path):
    out = spawn(_exact_resume_worker, 2, args=("moe_tiny", ["mesh.dp=2"], str(tmp_path)), timeout_s=300)
    for rank in out:
        assert rank["again"] == rank["losses"][2:], "bitwise: N + resume + N is the 2N-step run"
        _assert_trees_equal(rank["loaded"], rank["at_2"])
        _assert_trees_equal(rank["end"][0], out[0]["end"][0])


def test_reshard_on_load_dp2_tp2_to_fsdp2_and_one_device(tmp_path):
    config, d = "llama_tiny", tmp_path / "ckpt"
    path = Path(spawn(_reshard_save_worker, 4, args=(config, ["mesh.dp=2", "mesh.tp=2"], str(d)), timeout_s=600)[0])
    assert len(list(path.glob("*.distcp"))) == 4 and ck.read_meta(path)["world_size"] == 4
    _, params, state = _state(config)  # what the 4 ranks saved
    # One device: plain tensors read from every rank's shards.
    loaded = ck.load_checkpoint(path, *_fresh(load_config(config, SMALL)))
    _assert_trees_equal(loaded.params, params)
    _assert_trees_equal(loaded.opt_state, state)
    # fsdp=2 on 2 ranks: each rank reads its shards of the new layout, then trains on from them.
    out = spawn(_reshard_load_worker, 2, args=(config, ["mesh.fsdp=2"], str(path)), timeout_s=600)
    for rank in out:
        assert rank["step"] == 1
        _assert_trees_equal(rank["params"], params)
        _assert_trees_equal(rank["opt_state"], state)
    on_one = _run(config, ["train.steps=2", f"train.checkpoint.dir={d}", "train.checkpoint.resume=true"])
    assert [r["step"] for r in on_one.history] == [2]
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor([on_one.history[0]["loss"]]),
                               rtol=1e-5, atol=0)


PP = ["pipeline.schedule=1f1b", "pipeline.microbatches=2", "train.steps=4"]


def _pipeline_resume_worker(config, mesh, d):
    """On a pp mesh: 4 steps straight; 2 steps saving; a resume of those to step 4; and a resume
    of a one-device checkpoint (``d/one``) to step 4. Losses of each, per rank."""
    def losses(*overrides):
        return [r["loss"] for r in _run(config, [*PP, *mesh, *overrides]).history]

    return {
        "straight": losses(),
        "first_half": losses("train.steps=2", "train.checkpoint.every=2", f"train.checkpoint.dir={d}/pp"),
        "resumed": losses("train.checkpoint.every=2", f"train.checkpoint.dir={d}/pp", "train.checkpoint.resume=true"),
        "from_one_device": losses(
            f"train.checkpoint.dir={d}/one", "train.checkpoint.every=2", "train.checkpoint.resume=true"
        ),
    }


@pytest.mark.parametrize("config,mesh,nproc", [
    ("llama_tiny", ["mesh.pp=2"], 2),
    pytest.param("moe_tiny", ["mesh.pp=2", "mesh.ep=2"], 4, marks=pytest.mark.slow),
    pytest.param("moe_tiny", ["mesh.pp=2", "mesh.fsdp=2", "mesh.ep=2", "train.batch_size=8"], 8,
                 marks=pytest.mark.slow),  # 2 microbatches of a row per data rank
], ids=["pp2", "pp2xep2", "pp2xfsdp2xep2"])
def test_pipeline_runs_resume_exactly_and_load_under_another_layout(tmp_path, config, mesh, nproc):
    same = [o for o in mesh if o.startswith("train.")]  # the batch: the one-device runs compare losses
    one = [*PP, *same, "train.steps=2", "train.checkpoint.every=2", f"train.checkpoint.dir={tmp_path}/one"]
    on_one = [r["loss"] for r in _run(config, one).history]
    out = spawn(_pipeline_resume_worker, nproc, args=(config, mesh, str(tmp_path)), timeout_s=300)
    for rank in out:
        straight = rank["straight"]
        assert rank["first_half"] == straight[:2]
        assert rank["resumed"] == straight[2:], "bitwise: 2 steps + resume + 2 is the 4-step pp run"
        # a one-device checkpoint cut to the stages: the same steps 3 and 4 as the pp run's
        torch.testing.assert_close(torch.tensor(rank["from_one_device"]), torch.tensor(straight[2:]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(on_one), torch.tensor(out[0]["straight"][:2]), rtol=1e-5, atol=0)
    # each stage wrote its own layer range (and, over ep, its experts) as chunks of the global tensors
    path = tmp_path / "pp" / "step_00000002"
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    cfg = load_config(config, SMALL)
    params = {k: v for k, v in saved.items() if k.startswith("params.")}
    for key, md in params.items():  # the chunks tile each tensor (DCP refuses overlaps)
        assert sum(math.prod(c.sizes) for c in md.chunks) == math.prod(md.size), key
    if config == "llama_tiny":  # its two stages split the layers stack; moe_tiny's hold one stack each
        assert any(c.offsets[0] > 0 for md in params.values() for c in md.chunks), "layer ranges from both stages"
    if "mesh.ep=2" in mesh:
        experts = [md for k, md in params.items() if ".experts." in k]
        assert experts and all({c.offsets[1] for c in md.chunks} == {0, md.size[1] // 2} for md in experts)
    if "mesh.fsdp=2" in mesh:  # the embed dim (2 of an expert leaf [layers, E, embed, F]) split too
        w1 = params["params.moe_layers.experts.w1"]
        assert {c.offsets[2] for c in w1.chunks} == {0, w1.size[2] // 2}
    assert ck.read_meta(path)["world_size"] == nproc and len(list(path.glob("*.distcp"))) == nproc
    # one device resumes from the pp checkpoint
    assert ck.load_checkpoint(path, *_fresh(cfg)).step == 2
    shutil.copytree(path, tmp_path / "pp_at_2" / path.name)  # the resumed pp run also saved step 4 there
    resumed = _run(config, [*PP, *same, "train.checkpoint.every=2", f"train.checkpoint.dir={tmp_path}/pp_at_2",
                            "train.checkpoint.resume=true"])
    assert [r["step"] for r in resumed.history] == [3, 4]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in resumed.history]), torch.tensor(out[0]["straight"][2:]),
                               rtol=1e-5, atol=0)


def test_blocks_save_and_load_as_chunks_of_the_global_tensor(tmp_path):
    from shardfn.runtime.checkpoint_blocks import Blocks, BlocksLoadPlanner, BlocksSavePlanner

    w = torch.arange(12.0).reshape(4, 3)
    sd = {"w": Blocks((4, 3), torch.float32, [((0, 0), w[:1]), ((1, 0), w[1:])]), "s": torch.tensor(7)}
    with ck._dcp_call():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path), planner=BlocksSavePlanner(), no_dist=True)
        chunks = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata["w"].chunks
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((0, 0), (1, 3)), ((1, 0), (3, 3))]
        whole = {"w": torch.zeros(4, 3), "s": torch.tensor(0)}
        dcp.load(whole, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
        assert torch.equal(whole["w"], w) and int(whole["s"]) == 7
        rows = torch.zeros(2, 3)  # rows 0..1: half from each saved chunk
        part = {"w": Blocks((4, 3), torch.float32, [((0, 0), rows)]), "s": torch.tensor(0)}
        dcp.load(part, storage_reader=dcp.FileSystemReader(tmp_path), planner=BlocksLoadPlanner(), no_dist=True)
    assert torch.equal(rows, w[:2])
    with pytest.raises(ValueError, match=r"a block of shape \(2, 3\) at \(3, 0\) lies outside \(4, 3\)"):
        Blocks((4, 3), torch.float32, [((3, 0), rows)])


def test_config_changes_name_each_key_and_take_a_missing_key_as_null():
    saved = load_config(None, SMALL).to_dict()
    now = load_config(None, [*SMALL, "train.lr=1e-3", "mesh.dp=2", "runtime.threads=3",
                             "train.checkpoint.dir=elsewhere"]).to_dict()
    assert ri.config_changes(saved, now) == [("mesh.dp", 1, 2), ("train.lr", 0.003, 0.001)]
    del saved["model"]["init_std"]
    saved["model"]["added_later"] = None
    assert [k for k, *_ in ri.config_changes(saved, now)] == ["mesh.dp", "model.init_std", "train.lr"]
