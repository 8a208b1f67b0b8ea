"""Run configs: one YAML file, typed nested dataclasses, dotted command-line overrides.

A run config has the sections ``model``, ``mesh``, ``rules``, ``train``, ``data``, ``pipeline``,
``partition`` and ``runtime``; every section but ``model`` is optional and every key has a
default. ``model.name`` names the model: a registered name (``llama``), a dotted module path or a
``.py`` file (relative to the YAML file; ``shardfn.models.get`` resolves it), and the section's
remaining keys are validated by that model's ``Config.from_dict``.

    cfg = load_config("examples/configs/llama_tiny.yaml", ["train.steps=50", "model.n_layers=2"])
    cfg.train.steps, cfg.mesh.world_size  # (50, 1)

Overrides are ``section.key=value`` (nested: ``train.checkpoint.every=100``); values are parsed as
YAML scalars (``1e-3`` is a float, ``null`` is None, ``[dp, fsdp]`` is a list). An unknown section
or key -- in the file or in an override -- is a ``ValueError`` that names the dotted key and lists
the valid ones.

``rules`` maps logical axis names (the names models give their dims, plus the activation axes
``batch`` and ``seq``) to a mesh axis, a list of mesh axes, or null (replicated). The file's rules
are merged over ``partition.layouts.axes.DEFAULT_RULES``, so a file only states what it changes. The
layout facts themselves (mesh axes, default rules, schedule names, divisibility) live in
``shardfn.partition``; this module only reads and validates the file.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Union

import yaml

from shardfn.core.precision import DTYPES, PRECISIONS
from shardfn.core.units import parse_bytes
from shardfn.partition.layouts.axes import (
    AXIS_ORDER,
    DEFAULT_RULES,
    LOGICAL_AXES,
    check_batch,
    check_seq,
    data_size,
    mesh_axes,
    resolve_rules,
    seq_split,
)
from shardfn.partition.passes import DEFAULT_BUCKET_BYTES
from shardfn.partition.passes.remat import POLICIES as REMAT_POLICIES
from shardfn.partition.pipeline.schedules import SCHEDULES, canonical_name
from shardfn.partition.spec import entry_axes

CONFIG_DIR = Path(__file__).resolve().parent / "examples" / "configs"
"""The packaged example configs (``shardfn/examples/configs``)."""

DEFAULT_CONFIG = CONFIG_DIR / "llama_tiny.yaml"


# ----------------------------------------------------------------------------- sections


@dataclass
class MeshConfig:
    """Device-mesh axis sizes; the world size is their product."""

    pp: int = 1  # pipeline stages
    dp: int = 1  # data parallel (replicated parameters)
    fsdp: int = 1  # fully sharded data parallel (ZeRO-3)
    cp: int = 1  # context parallel: the sequence split (partition.spmd.context_rules)
    ep: int = 1  # expert parallel
    tp: int = 1  # tensor parallel

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.cp * self.ep * self.tp

    def axes(self) -> dict[str, int]:
        """``{"pp": .., "dp": .., "fsdp": .., "ep": .., "tp": ..}``, major to minor (for ``sf.Mesh``),
        with ``"cp"`` after ``fsdp`` when it is > 1 (``partition.layouts.axes.mesh_axes``)."""
        return mesh_axes({name: getattr(self, name) for name in AXIS_ORDER})

    def validate(self) -> None:
        for name in AXIS_ORDER:
            _check(getattr(self, name) >= 1, f"mesh.{name}", "must be >= 1", getattr(self, name))


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (and after the last); 0 disables checkpointing
    # step_XXXXXXXX/ directories (runtime/checkpoint.py), any mesh loads any; null: the run's own,
    # runs/<config name>-<hash of the model, train and data keys> (runtime.run_identity.run_directory)
    dir: Union[str, None] = None
    keep: int = 2  # number of most recent complete checkpoints kept
    # auto: resume from the newest complete checkpoint in dir when every > 0; true (--resume):
    # resume from it, an error if there is none; false: start at step 0, an error if dir holds any
    resume: Union[bool, str] = "auto"

    def validate(self) -> None:
        _check(self.every >= 0, "train.checkpoint.every", "must be >= 0 (0 disables)", self.every)
        _check(self.keep >= 1, "train.checkpoint.keep", "must be >= 1", self.keep)
        _check(self.resume in ("auto", True, False), "train.checkpoint.resume", "must be auto, true or false",
               self.resume)


NONFINITE = ("raise", "skip")
"""``train.nonfinite``: what a step with a NaN/Inf loss or gradient norm does (runtime/train.py)."""


@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 16  # the GLOBAL batch (rows per step over all ranks)
    seq_len: int = 128
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: Union[float, None] = 1.0  # max global gradient norm; null disables clipping
    seed: int = 0  # parameter init and batch order
    log_every: int = 10
    # torch.compile on one device: true or "regional" compiles one layer once and runs it for every layer
    # (core/regional.py; first step ~ one layer's compile), "whole" the whole step as one graph; under a
    # mesh, any of them compiles each rank's program with inductor
    compile: Union[bool, str] = False
    init_from: Union[str, None] = None  # a directory of HF-format *.safetensors: the initial params (models/hf/)
    nonfinite: str = "raise"  # a NaN/Inf loss or grad_norm: "raise" stops the run, "skip" skips that update
    precision: str = "fp32"  # "bf16": fp32 master weights and optimizer state, bf16 compute (core/precision.py)
    reduce_dtype: str = "fp32"  # the dtype gradient sums travel in between ranks
    remat: str = "none"  # activation checkpointing: none | full | selective (partition/passes/remat.py)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "log_every"):
            _check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1", getattr(self, name))
        _check(self.lr >= 0, "train.lr", "must be >= 0", self.lr)
        _check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0", self.warmup_steps)
        _check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        _check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0", self.weight_decay)
        _check(0 <= self.b1 < 1, "train.b1", "must be in [0, 1)", self.b1)
        _check(0 <= self.b2 < 1, "train.b2", "must be in [0, 1)", self.b2)
        _check(self.eps > 0, "train.eps", "must be > 0", self.eps)
        _check(self.grad_clip is None or self.grad_clip > 0, "train.grad_clip", "must be > 0 or null", self.grad_clip)
        _check(self.nonfinite in NONFINITE, "train.nonfinite", f"must be one of {', '.join(NONFINITE)}", self.nonfinite)
        _check(self.precision in PRECISIONS, "train.precision", f"must be one of {', '.join(PRECISIONS)}",
               self.precision)
        _check(self.reduce_dtype in DTYPES, "train.reduce_dtype", f"must be one of {', '.join(DTYPES)}",
               self.reduce_dtype)
        _check(self.compile in (False, True, "regional", "whole"), "train.compile",
               "must be false, true, regional or whole", self.compile)
        _check(self.remat in REMAT_POLICIES, "train.remat", f"must be one of {', '.join(REMAT_POLICIES)}", self.remat)
        self.checkpoint.validate()


@dataclass
class DataConfig:
    path: Union[str, None] = None  # a text file (bytes are tokens); null: the embedded corpus
    corpus_bytes: int = 262_144  # size of the embedded corpus

    def validate(self) -> None:
        _check(self.corpus_bytes >= 1, "data.corpus_bytes", "must be >= 1", self.corpus_bytes)


@dataclass
class PipelineConfig:
    schedule: str = "1f1b"  # a schedule name (partition.pipeline.schedules.SCHEDULES)
    microbatches: int = 1  # per step (and per data-parallel rank)
    stages: Union[int, None] = None  # null: one stage per pp rank
    # with an MoE exchange in the stages: each overlapped pair (DualPipeV's F + the other chunk's B)
    # takes turns at its all-to-all waits (docs/pipeline.md); false: one member after the other
    overlap_pairs: bool = False

    def validate(self) -> None:
        _check(canonical_name(self.schedule) in SCHEDULES, "pipeline.schedule",
               f"must be one of {', '.join(SCHEDULES)}", self.schedule)
        _check(self.microbatches >= 1, "pipeline.microbatches", "must be >= 1", self.microbatches)
        _check(self.stages is None or self.stages >= 1, "pipeline.stages", "must be >= 1 or null", self.stages)


@dataclass
class PartitionConfig:
    auto: bool = False  # search placements the specs and rules leave open
    # the auto-sharder's solve (partition.auto.solve): HiGHS' time limit in seconds; the gap to its
    # lower bound a plan must be proven within (else a warning, or an error with auto_strict); the
    # hardware profile that prices it (a bundled name or a YAML path)
    auto_time_limit_s: float = 10.0
    auto_mip_gap: float = 0.05
    auto_hardware: str = "h100"
    auto_strict: bool = False
    memory_budget: Union[int, None] = None  # bytes per rank (YAML may say "40GiB"); null: no limit
    # fsdp: re-gather parameters for the backward (true) or keep the forward's gathered copies
    # (false: under pp, once per step for all microbatches); null: false under pp, else true
    reshard_after_forward: Union[bool, None] = None
    # gradient all-reduces / reduce-scatters coalesced into buckets of this many bytes (YAML may
    # say "25MiB"); 0 or null: one collective per tensor. 25 MiB is DDP's bucket_cap_mb default
    bucket_bytes: Union[int, None] = DEFAULT_BUCKET_BYTES
    # collectives issued as early as their inputs allow and waited on at first use
    # (partition/passes/overlap.py); null: on where parameters are stored sharded (mesh.fsdp > 1), whose
    # gathers it prefetches, measured faster there and not elsewhere (docs/passes.md);
    # overlap_bytes bounds the gathered bytes issued ahead ("64MiB";
    # null: two layers' worth, FSDP's prefetch of one layer ahead)
    overlap: Union[bool, None] = None
    overlap_bytes: Union[int, None] = None
    # Megatron sequence parallelism over tp: between the matmul blocks the residual stream and the
    # norms hold 1/tp of the tokens (reduce-scatter after a block, all-gather before the next)
    sequence_parallel: bool = False
    # the MoE exchange in this many token groups: one group's all-to-all in flight while the
    # experts run on another's (1: one exchange each way, only the shared experts overlap it)
    ep_chunks: int = 1
    # expert parallelism: each expert takes at most this times its even share of a rank's tokens
    # (the rest are dropped, as GShard's capacity); 0: dropless
    capacity_factor: float = 0.0

    def validate(self) -> None:
        if isinstance(self.memory_budget, str):
            self.memory_budget = parse_bytes(self.memory_budget, "partition.memory_budget")
        if isinstance(self.overlap_bytes, str):
            self.overlap_bytes = parse_bytes(self.overlap_bytes, "partition.overlap_bytes")
        _check(self.overlap_bytes is None or self.overlap_bytes >= 0, "partition.overlap_bytes",
               "must be >= 0 or null (null: two layers of gathered weights)", self.overlap_bytes)
        if isinstance(self.bucket_bytes, str):
            self.bucket_bytes = parse_bytes(self.bucket_bytes, "partition.bucket_bytes")
        _check(self.bucket_bytes is None or self.bucket_bytes >= 0, "partition.bucket_bytes",
               "must be >= 0 or null (0 or null: no bucketing)", self.bucket_bytes)
        _check(isinstance(self.ep_chunks, int) and self.ep_chunks >= 1, "partition.ep_chunks",
               "must be an integer >= 1 (1: no chunking)", self.ep_chunks)
        _check(self.capacity_factor >= 0, "partition.capacity_factor", "must be >= 0 (0: dropless)",
               self.capacity_factor)
        _check(self.auto_time_limit_s > 0, "partition.auto_time_limit_s", "must be > 0 (seconds)",
               self.auto_time_limit_s)
        _check(self.auto_mip_gap >= 0, "partition.auto_mip_gap", "must be >= 0 (0.05: within 5% of the bound)",
               self.auto_mip_gap)
        if self.auto:
            from shardfn.partition.cost.hardware import available_hardware, load_hardware

            try:
                load_hardware(self.auto_hardware)
            except ValueError:
                _check(False, "partition.auto_hardware",
                       f"must be one of {available_hardware()} or the path of a profile YAML", self.auto_hardware)
        _check(self.memory_budget is None or self.memory_budget > 0, "partition.memory_budget",
               "must be > 0 or null", self.memory_budget)
        _check(self.reshard_after_forward in (None, True, False), "partition.reshard_after_forward",
               "must be true, false or null", self.reshard_after_forward)


@dataclass
class RuntimeConfig:
    timeout_s: float = 600.0  # multi-process runs: every rank is stopped after this long
    nproc: Union[int, None] = None  # local processes to launch; null: the mesh's world size
    device: str = "cpu"  # "cpu", "cuda" (each rank of a mesh on its cuda:LOCAL_RANK, over NCCL), "cuda:1", ...
    threads: Union[int, None] = None  # CPU intra-op threads (torch.set_num_threads); null: torch's default

    def validate(self) -> None:
        _check(self.timeout_s > 0, "runtime.timeout_s", "must be > 0", self.timeout_s)
        _check(self.nproc is None or self.nproc >= 1, "runtime.nproc", "must be >= 1 or null", self.nproc)
        _check(self.threads is None or self.threads >= 1, "runtime.threads", "must be >= 1 or null", self.threads)
        import torch

        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            _check(False, "runtime.device", "must be a torch device such as cpu, cuda or cuda:1", self.device)


@dataclass
class RunConfig:
    """A whole run. ``model`` is the model's own ``Config`` (from the registry entry ``model_name``)."""

    model: Any
    model_name: str
    mesh: MeshConfig = field(default_factory=MeshConfig)
    rules: dict = field(default_factory=lambda: _deepcopy(DEFAULT_RULES))
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    source: Union[str, None] = None  # the YAML file this came from, if any

    @property
    def data_parallel_size(self) -> int:
        """How many ways the global batch is split: the product of the ``batch`` rule's mesh axes."""
        return data_size(self.rules, self.mesh.axes())

    def to_dict(self) -> dict:
        """Plain nested dict (YAML/JSON-serializable) that :func:`config_from_dict` reads back.

        Example:
            again = config_from_dict(cfg.to_dict())
        """
        model = dataclasses.asdict(self.model) if dataclasses.is_dataclass(self.model) else dict(vars(self.model))
        out = {"model": {"name": self.model_name, **model}}
        for name in _SECTIONS:
            value = getattr(self, name)
            out[name] = dict(value) if isinstance(value, dict) else dataclasses.asdict(value)
        return out


_SECTIONS: dict[str, type] = {
    "mesh": MeshConfig,
    "rules": dict,
    "train": TrainConfig,
    "data": DataConfig,
    "pipeline": PipelineConfig,
    "partition": PartitionConfig,
    "runtime": RuntimeConfig,
}
VALID_SECTIONS = ("model", *_SECTIONS)


# ----------------------------------------------------------------------------- loading


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float (YAML 1.2), not as the string YAML 1.1 gives."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_value(text: str) -> Any:
    """A command-line value as a YAML scalar (``50`` -> 50, ``1e-3`` -> 0.001, ``null`` -> None).

    Example:
        parse_value("[dp, fsdp]")  # ['dp', 'fsdp']
    """
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


def parse_override(item: str) -> tuple[str, Any]:
    """``"train.steps=50"`` -> ``("train.steps", 50)``.

    Example:
        parse_override("model.n_layers=2")  # ('model.n_layers', 2)
    """
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key or "." not in key or any(not part for part in key.split(".")):
        raise ValueError(f"bad override {item!r}: write section.key=value, e.g. train.steps=50 "
                         f"(sections: {', '.join(VALID_SECTIONS)})")
    return key, parse_value(value)


def resolve_path(path: str | Path | None) -> Path:
    """The config file for ``path``: a file, or the name of a packaged config (``llama_tiny``).

    Example:
        resolve_path("llama3_8b")  # .../shardfn/examples/configs/llama3_8b.yaml
    """
    if path is None:
        return DEFAULT_CONFIG
    p = Path(path)
    if p.is_file():
        return p
    for candidate in (CONFIG_DIR / p.name, CONFIG_DIR / f"{p.name}.yaml"):
        if p.parent == Path(".") and candidate.is_file():
            return candidate
    names = ", ".join(available_configs()) or "(none)"
    raise FileNotFoundError(f"config file {str(path)!r} not found; give a path to a YAML file or one of "
                            f"the packaged configs: {names}")


def available_configs() -> list[str]:
    """Names of the packaged example configs."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read a YAML run config, apply dotted overrides, validate everything.

    Args:
        path: a YAML file, the name of a packaged config, or ``None`` for ``llama_tiny``.
        overrides: ``"section.key=value"`` strings, applied in order after the file.

    Returns:
        The validated :class:`RunConfig`.

    Raises:
        ValueError: an unknown section or key (the message names the dotted key and the valid
            keys), a value of the wrong type, or a bad model config (``model.<key>``).
        FileNotFoundError: no such file or packaged config.

    Example:
        cfg = load_config(None, ["train.steps=20"])
        cfg.model_name, cfg.train.steps  # ('llama', 20)
    """
    file = resolve_path(path)
    try:
        raw = yaml.load(file.read_text(), Loader=_Loader)
    except yaml.YAMLError as e:
        raise ValueError(f"{file}: not valid YAML: {e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: a run config is a mapping of sections ({', '.join(VALID_SECTIONS)}), "
                         f"got {type(raw).__name__}")
    _model_file_beside(raw, file)
    cfg = config_from_dict(raw, overrides)
    cfg.source = str(file)
    return cfg


def _model_file_beside(raw: dict, file: Path) -> None:
    """A relative ``model.name: mymodel.py`` in a YAML file names the file beside it: made absolute
    (on the command line, a relative path is from the current directory)."""
    model = raw.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    if isinstance(name, str) and name.endswith(".py") and not Path(name).is_absolute():
        beside = file.resolve().parent / name
        if beside.is_file():
            model["name"] = str(beside)


def config_from_dict(raw: dict, overrides: Iterable[str] = ()) -> RunConfig:
    """:func:`load_config` for an already-parsed mapping.

    Example:
        cfg = config_from_dict({"model": {"name": "llama"}}, ["train.steps=5"])
    """
    raw = _deepcopy(raw)
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)

    unknown = [k for k in raw if k not in VALID_SECTIONS]
    if unknown:
        raise ValueError(f"unknown config section {unknown[0]!r}; valid sections: {', '.join(VALID_SECTIONS)}")
    model_name, model_cfg = _build_model(raw.get("model"))
    sections = {}
    for name, cls in _SECTIONS.items():
        section = raw.get(name)
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise ValueError(f"config section {name!r} must be a mapping of keys, got {section!r}")
        sections[name] = _build_rules(section) if cls is dict else _build(cls, section, name)
    cfg = RunConfig(model=model_cfg, model_name=model_name, **sections)
    _validate_run(cfg)
    return cfg


# ----------------------------------------------------------------------------- internals


def _check(ok: bool, key: str, requirement: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{key} {requirement}, got {value!r}")


def _deepcopy(x):
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"cannot override {key!r}: {'.'.join(parents[: i + 1])!r} is a value, not a section")
        node = child
    node[leaf] = value


def _build_model(section: Any) -> tuple[str, Any]:
    from shardfn import models

    if not isinstance(section, dict) or "name" not in section:
        raise ValueError(f"the config needs a model section with a name, e.g. `model: {{name: llama, ...}}`; "
                         f"got {section!r}")
    fields = dict(section)
    name = fields.pop("name")
    if not isinstance(name, str):
        raise ValueError(f"model.name must be a string (a registered name, a module path or a .py file), got {name!r}")
    try:
        model = models.get(name)
    except (KeyError, ValueError) as e:
        raise ValueError(f"model.name: {e.args[0] if e.args else e}") from None
    return name, model.config_from_dict(fields)


def _build_rules(section: dict) -> dict:
    rules = _deepcopy(DEFAULT_RULES)
    for logical, target in section.items():
        if logical not in LOGICAL_AXES:
            raise ValueError(f"unknown config key 'rules.{logical}'; valid logical axes: {', '.join(LOGICAL_AXES)}")
        names = _rule_names(target, f"rules.{logical}")
        for n in names:
            if n not in AXIS_ORDER:
                raise ValueError(f"rules.{logical}: unknown mesh axis {n!r}; valid mesh axes: {', '.join(AXIS_ORDER)}")
        if len(set(names)) != len(names):
            raise ValueError(f"rules.{logical} names a mesh axis twice: {target!r}")
        rules[logical] = list(target) if isinstance(target, (list, tuple)) else target
    return rules


def _rule_names(target: Any, key: str) -> list[str]:
    if target is None or isinstance(target, str) or (
            isinstance(target, (list, tuple)) and all(isinstance(t, str) for t in target)):
        return entry_axes(target)
    raise ValueError(f"{key} must be a mesh axis name, a list of names, or null; got {target!r}")


def _build(cls: type, section: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in section.items():
        dotted = f"{prefix}.{key}"
        if key not in names:
            raise ValueError(f"unknown config key {dotted!r}; valid keys in {prefix!r}: {', '.join(names)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ValueError(
                    f"{dotted} is a section (keys: {', '.join(f.name for f in dataclasses.fields(hint))}), "
                    f"got {value!r}"
                )
            kwargs[key] = _build(hint, value, dotted)
        else:
            kwargs[key] = _coerce(value, hint, dotted)
    obj = cls(**kwargs)
    if prefix in _SECTIONS:  # nested sections are validated by their parent
        obj.validate()
    return obj


def _coerce(value: Any, hint: Any, key: str) -> Any:
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"{key} must not be null; give {_a(_type_names(options))}")
    for t in options:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, str):
            return value
    if key in ("partition.memory_budget", "partition.bucket_bytes",
               "partition.overlap_bytes") and isinstance(value, str):
        return value  # "40GiB": parsed by PartitionConfig.validate
    if str in options and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{key} must be {_a(_type_names(options))}, got {value!r} ({type(value).__name__})")


def _type_names(options: tuple) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in options)


def _a(noun: str) -> str:
    """``"an int"``, ``"a str or null"``: the noun with its article."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _validate_run(cfg: RunConfig) -> None:
    check_batch(cfg.train.batch_size, cfg.data_parallel_size, cfg.pipeline.microbatches,
                data_axes=entry_axes(cfg.rules.get("batch")))
    axes = cfg.mesh.axes()
    check_seq(cfg.train.seq_len, seq_split(resolve_rules(cfg.rules, axes), axes))
