"""A run config resolved once for planning: the value the estimate, the search and the text read.

Instead of each step of ``make_plan`` and ``search`` asking ``models.get`` and the layout rules,
:func:`resolve` does it once: the run config with ``--dtype`` / ``--checkpointing`` applied, the
model module, the hardware and its achieved rates, the memory a plan must fit in, and a cache of
each mesh's parameter shards (``plan.runmodel.Shape``), so every layout of a search that shares a
mesh shares its shapes.

    run = resolve(load_config("deepseek_v3_671b"), hardware="h100", dtype=torch.bfloat16)
    est = run.estimate(Layout(pp=8, fsdp=2, ep=32, microbatches=8, schedule="interleaved_1f1b",
                              checkpointing=True))
    est["tokens_per_s_per_device"], est["memory"]["device_bytes"] <= run.capacity_bytes
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from shardfn.partition.cost.hardware import Hardware
from shardfn.partition.cost.model import Rates
from shardfn.plan.layout import Layout, PlanError
from shardfn.plan.runmodel import RunSpec, Shape, floor_bytes, model_shape, run_estimate


def run_config(cfg, dtype: torch.dtype = torch.float32, checkpointing: bool | None = None):
    """``cfg`` with the planner's ``--dtype`` / ``--checkpointing`` as the run's own keys:
    ``bfloat16`` is ``train.precision=bf16``, checkpointing ``train.remat=full`` (False: ``none``).

        run_config(cfg, torch.bfloat16, True).train.remat   # "full"
    """
    train = cfg.train
    if dtype == torch.bfloat16:
        train = dataclasses.replace(train, precision="bf16")
    elif dtype != torch.float32:
        raise PlanError("train.precision", f"cannot plan dtype {dtype}; use float32 or bfloat16")
    if checkpointing is not None:
        train = dataclasses.replace(train, remat="full" if checkpointing else "none")
    return cfg if train is cfg.train else dataclasses.replace(cfg, train=train)


@dataclass
class Resolved:
    """One run config, resolved for planning (see the module docstring).

    Attributes:
        cfg: the run config with the planner's dtype applied (``train.remat`` as the config or
            ``checkpointing`` says; a layout's ``checkpointing`` picks ``full`` or ``none``).
        model: the model module (``models.get(cfg.model_name)``).
        rates: the hardware's achieved rates (``partition.cost.model.Rates``); ``hardware`` its profile.
        capacity_bytes: ``partition.memory_budget`` if set, else the device's memory.
        budgeted: the capacity is the budget.
    """

    cfg: Any
    model: ModuleType
    rates: Rates
    capacity_bytes: int
    budgeted: bool
    _shapes: dict = field(default_factory=dict, repr=False)

    @property
    def hardware(self) -> Hardware:
        return self.rates.hardware

    def with_checkpointing(self, checkpointing: bool | None) -> "Resolved":
        """The same run with ``train.remat`` set as ``checkpointing`` says (``full`` or ``none``;
        None: as the config has it), sharing this one's caches."""
        cfg = run_config(self.cfg, checkpointing=checkpointing)
        return self if cfg is self.cfg else dataclasses.replace(self, cfg=cfg)

    def spec(self, layout: Layout) -> RunSpec:
        """What the run does beyond ``layout``: the config's remat, precision, compile and
        sequence parallelism (``plan.runmodel.RunSpec.of``)."""
        return RunSpec.of(self.cfg)

    def shape(self, layout: Layout) -> Shape:
        """The model's parameter shards on ``layout``'s mesh (``pp`` aside), made once per mesh."""
        key = tuple(layout.axes(include_pp=False).items())
        if key not in self._shapes:
            self._shapes[key] = model_shape(self.cfg, layout, self.model)
        return self._shapes[key]

    def floor_bytes(self, layout: Layout) -> float:
        """Device bytes the estimate of ``layout`` cannot go below (``runmodel.floor_bytes``)."""
        if layout.checkpointing != (self.cfg.train.remat != "none"):
            return self.with_checkpointing(layout.checkpointing).floor_bytes(layout)
        rows = self.cfg.train.batch_size // layout.data_size // layout.microbatches
        return floor_bytes(self.shape(layout), layout, self.spec(layout), rows * self.cfg.train.seq_len // layout.cp)

    def estimate(self, layout: Layout, *, bound: bool = False) -> dict:
        """The one estimate of a GPU run of ``layout`` (``plan.runmodel.run_estimate``), with
        ``fits``: its device bytes within :attr:`capacity_bytes`. ``bound``: the step time
        without the pipeline bubble (a lower bound; no schedule simulated), the rest exact.

        Example:
            resolve(cfg, hardware="h100").estimate(Layout(fsdp=8))["tokens_per_s_per_device"]
        """
        if layout.checkpointing != (self.cfg.train.remat != "none"):
            return self.with_checkpointing(layout.checkpointing).estimate(layout, bound=bound)
        est = run_estimate(self.cfg, layout, hardware=self.rates, spec=self.spec(layout), shape=self.shape(layout),
                           bound=bound)
        est["capacity_bytes"] = self.capacity_bytes
        est["fits"] = est["memory"]["device_bytes"] <= self.capacity_bytes
        return est


def resolve(cfg, *, hardware: str | Hardware | Rates = "h200", dtype: torch.dtype = torch.float32,
            checkpointing: bool | None = None) -> Resolved:
    """Resolve ``cfg`` for planning once (model module, hardware rates, capacity).

    Example:
        run = resolve(load_config("llama3_8b"), hardware="h100_96gb", dtype=torch.bfloat16)
        run.estimate(Layout(fsdp=8))["time"]["step_s"]
    """
    from shardfn import models

    cfg = run_config(cfg, dtype, checkpointing)
    rates = hardware if isinstance(hardware, Rates) else Rates.of(hardware)
    budget = cfg.partition.memory_budget
    return Resolved(cfg, models.get(cfg.model_name), rates, int(budget or rates.hardware.hbm_bytes), bool(budget))
