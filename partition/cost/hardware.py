"""Hardware profiles: peak FLOP/s, memory, links; an alpha-beta model of collectives.

A profile is a small YAML file (``examples/hardware/<name>.yaml``) with published datasheet
numbers; :func:`load_hardware` reads one by name or path into a frozen :class:`Hardware`.

    hw = load_hardware("h100")
    hw.collective_time("all_reduce", 64 << 20, group_size=8, intra_node=True)  # ~2.9e-4 s

Collective sizes follow the partitioner's reports (``partition.spmd.report``): ``nbytes`` is the full
buffer on one rank -- the tensor for all-reduce, the *gathered output* for all-gather, the
*unreduced input* for reduce-scatter, the local buffer for all-to-all. With ``n`` ranks, link
bandwidth ``bw`` and per-step latency ``alpha`` (ring algorithms)::

    all_reduce      2 (n-1)/n * B / bw + 2 (n-1) alpha
    all_gather        (n-1)/n * B / bw +   (n-1) alpha
    reduce_scatter    (n-1)/n * B / bw +   (n-1) alpha
    all_to_all        (n-1)/n * B / bw +   (n-1) alpha
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

PROFILE_DIR = Path(__file__).resolve().parents[2] / "examples" / "hardware"
"""Where named profiles live (``load_hardware("h100")`` reads ``h100.yaml`` here)."""

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the links around it. Rates are per device; bytes are bytes.

    Attributes:
        name: profile name (``"h100"``).
        peak_flops_bf16: dense BF16 tensor-core FLOP/s.
        peak_flops_fp32: FP32 FLOP/s.
        hbm_bytes: device memory.
        hbm_bandwidth: device-memory bandwidth, bytes/s.
        intra_node_bandwidth: per-device, one-direction bandwidth inside a node (NVLink), bytes/s.
        intra_node_latency: seconds per ring step inside a node.
        inter_node_bandwidth: per-device bandwidth between nodes (one NIC per GPU), bytes/s.
        inter_node_latency: seconds per ring step between nodes.
        gpus_per_node: devices sharing the intra-node fabric (72 for an NVL72 domain).
        efficiency: the profile's achieved-rate table (:class:`Efficiency`); a bundled profile
            carries its own, so a renamed or modified copy (``dataclasses.replace(hw, name=...)``)
            keeps it. None: the table of the bundled profile of the same name, else peak rates.

    Example:
        hw = Hardware.from_dict(yaml.safe_load(open("my_gpu.yaml")))
        hw.peak_flops(torch.bfloat16)
    """

    name: str
    peak_flops_bf16: float
    peak_flops_fp32: float
    hbm_bytes: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    gpus_per_node: int
    efficiency: "Efficiency | None" = None

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "hardware profile") -> "Hardware":
        """Build from a mapping; ValueError names a missing or unknown key.

        ``efficiency`` is optional: the name of a bundled table (``efficiency: h100`` for a
        slower-network copy of an H100 profile); without it a bundled name brings its own table.
        """
        fields = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "efficiency"}
        unknown = sorted(set(d) - set(fields) - {"efficiency"})
        missing = sorted(set(fields) - set(d))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(fields)}")
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}")
        values = {}
        for key in fields:
            value = d[key]
            if key == "name":
                values[key] = str(value)
                continue
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{where}: {key} must be a number, got {value!r}") from None
            if value <= 0:
                raise ValueError(f"{where}: {key} must be positive, got {value!r}")
            values[key] = int(value) if key == "gpus_per_node" else value
        table = d.get("efficiency", values["name"])
        if table is not None and not isinstance(table, Efficiency):
            if str(table).lower() not in EFFICIENCY and "efficiency" in d:
                raise ValueError(f"{where}: efficiency must name a bundled rate table, one of {sorted(EFFICIENCY)}; "
                                 f"got {table!r}")
            table = EFFICIENCY.get(str(table).lower())
        return cls(**values, efficiency=table)

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for matmuls in ``dtype`` (16-bit types use the BF16 tensor-core rate)."""
        return self.peak_flops_fp32 if dtype in (torch.float32, torch.float64) else self.peak_flops_bf16

    def link(self, intra_node: bool) -> tuple[float, float]:
        """``(bandwidth bytes/s, latency s)`` of the intra- or inter-node fabric."""
        if intra_node:
            return self.intra_node_bandwidth, self.intra_node_latency
        return self.inter_node_bandwidth, self.inter_node_latency

    def collective_time(self, op: str, nbytes: float, group_size: int, intra_node: bool) -> float:
        """Seconds for one collective of ``nbytes`` (see the module docstring) over ``group_size``
        devices, by the ring alpha-beta model. A group of one costs nothing.

            hw.collective_time("all_gather", 1 << 30, 8, intra_node=True)
        """
        if op not in COLLECTIVE_OPS:
            raise ValueError(f"unknown collective {op!r}; valid ops are {COLLECTIVE_OPS}")
        n = int(group_size)
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw, alpha = self.link(intra_node)
        steps = (n - 1) / n
        if op == "all_reduce":
            return 2 * steps * nbytes / bw + 2 * (n - 1) * alpha
        return steps * nbytes / bw + (n - 1) * alpha


def available_hardware() -> list[str]:
    """Names of the bundled profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_hardware(name_or_path: "str | Path | Hardware") -> Hardware:
    """A bundled profile by name (``"h100"``), or a YAML file by path.

        hw = load_hardware("gb200")
        hw = load_hardware("configs/my_cluster.yaml")
    """
    if isinstance(name_or_path, Hardware):
        return name_or_path
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith((".yaml", ".yml")) or path.is_file()):
        path = PROFILE_DIR / f"{text.lower()}.yaml"
        if not path.is_file():
            raise ValueError(
                f"unknown hardware {text!r}; valid names are {available_hardware()}, "
                f"or pass the path of a YAML file with the fields of shardfn.partition.cost.hardware.Hardware"
            )
    elif not path.is_file():
        raise ValueError(f"hardware profile {text!r} does not exist; valid names are {available_hardware()}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile {path}: expected a mapping of fields, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    return Hardware.from_dict(data, where=f"hardware profile {path}")


@dataclass(frozen=True)
class Efficiency:
    """What a device achieves of its peaks on a training step's kernels (the run model's rates).

    Attributes:
        matmul: ``((smallest of M, N, K), share of peak FLOP/s)`` rows, increasing; a bf16 GEMM
            of that smallest dimension reaches that share (log-linear in between, clamped outside).
        attention: share of peak of a causal flash-attention forward + backward (FLOPs counted
            causally: half the square).
        hbm: share of ``hbm_bandwidth`` a streaming element-wise kernel reaches.
        intra_bus: share of ``intra_node_bandwidth`` a large NCCL collective reaches (bus bandwidth).
        inter_bus: share of ``inter_node_bandwidth`` likewise across nodes.
        clock: share of the datasheet clock the part sustains in a training step (its power limit);
            scales every compute rate, not the peak used for MFU.
        source: where the numbers come from.

    Example:
        eff = efficiency("h100"); eff.matmul_share(8192, 4096, 4096)   # 0.79
    """

    matmul: tuple
    attention: float
    hbm: float
    intra_bus: float
    inter_bus: float
    clock: float = 1.0
    source: str = ""

    def matmul_share(self, m: float, n: float, k: float) -> float:
        """Share of peak one ``[m, k] @ [k, n]`` GEMM reaches, by its smallest dimension."""
        import math

        small = max(1.0, min(m, n, k))
        rows = self.matmul
        if small <= rows[0][0]:
            return rows[0][1]
        for (d0, e0), (d1, e1) in zip(rows, rows[1:]):
            if small <= d1:
                t = (math.log(small) - math.log(d0)) / (math.log(d1) - math.log(d0))
                return e0 + t * (e1 - e0)
        return rows[-1][1]


_HOPPER_MATMUL = ((64, 0.12), (128, 0.25), (256, 0.42), (512, 0.58), (1024, 0.70), (2048, 0.76), (4096, 0.79),
                  (8192, 0.80))
_AMPERE_MATMUL = ((64, 0.15), (128, 0.30), (256, 0.50), (512, 0.68), (1024, 0.78), (2048, 0.84), (4096, 0.86),
                  (8192, 0.87))
_MAMF = ("largest-shape share: the maximum achievable matmul FLOPS measured by the mamf-finder of "
         "stas00/ml-engineering (A100 SXM ~268 of 312 TFLOP/s, H100 SXM ~792 of 989); smaller shapes: "
         "estimated (tile and wave quantization), to be replaced by a measurement on the device")
_FLASH = ("attention: FlashAttention-2 (the flash kernel of torch's SDPA) causal fwd+bwd, head dim 128, "
          "long sequences, from the FlashAttention-2 paper (A100, ~190 TFLOP/s) and the FlashAttention-3 "
          "paper's FA2 baseline on H100 (~330 TFLOP/s)")
_NCCL = ("buses: nccl-tests bus bandwidth at large sizes, ~80% of NVLink and ~85% of the NIC's line rate; "
         "hbm: a streaming kernel's ~80% of the datasheet bandwidth")

EFFICIENCY: dict[str, Efficiency] = {
    "a100": Efficiency(_AMPERE_MATMUL, 0.60, 0.80, 0.80, 0.85, 1.0, f"{_MAMF}; {_FLASH}; {_NCCL}"),
    "h100": Efficiency(_HOPPER_MATMUL, 0.33, 0.80, 0.80, 0.85, 1.0, f"{_MAMF}; {_FLASH}; {_NCCL}"),
    # 500 W power limit: the clock share is the run model's one fitted time constant (fitted on
    # TorchTitan's Llama 3.1 8B FSDP 8 run, docs/plan.md); everything else as h100
    "h100_96gb": Efficiency(_HOPPER_MATMUL, 0.33, 0.80, 0.80, 0.85, 0.63,
                            f"{_MAMF}; {_FLASH}; {_NCCL}; clock: fitted (docs/plan.md)"),
    "h200": Efficiency(_HOPPER_MATMUL, 0.33, 0.80, 0.80, 0.85, 1.0, f"{_MAMF}; {_FLASH}; {_NCCL}"),
    "b200": Efficiency(_HOPPER_MATMUL, 0.33, 0.80, 0.80, 0.85, 1.0, f"as h200 (not measured); {_NCCL}"),
    "gb200": Efficiency(_HOPPER_MATMUL, 0.33, 0.80, 0.80, 0.85, 1.0, f"as h200 (not measured); {_NCCL}"),
}
"""Achieved shares of peak per bundled profile; other profiles get :data:`DEFAULT_EFFICIENCY`."""

DEFAULT_EFFICIENCY = Efficiency(((1, 1.0),), 1.0, 1.0, 1.0, 1.0, 1.0, "peak rates (no table for this profile)")


def efficiency(hw: "Hardware | str") -> Efficiency:
    """The achieved-rate table of a profile: the one it carries, else the bundled table of its
    name, else peak rates.

        efficiency("h100").attention     # 0.33
    """
    if isinstance(hw, Hardware) and hw.efficiency is not None:
        return hw.efficiency
    name = hw if isinstance(hw, str) else hw.name
    return EFFICIENCY.get(str(name).lower(), DEFAULT_EFFICIENCY)
