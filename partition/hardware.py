"""Hardware profiles: peak FLOP/s, memory, links; an alpha-beta model of collectives.

A profile is a small YAML file (``examples/hardware/<name>.yaml``) with published datasheet
numbers; :func:`load_hardware` reads one by name or path into a frozen :class:`Hardware`.

    hw = load_hardware("h100")
    hw.collective_time("all_reduce", 64 << 20, group_size=8, intra_node=True)  # ~2.9e-4 s

Collective sizes follow the partitioner's reports (``partition.report``): ``nbytes`` is the full
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

PROFILE_DIR = Path(__file__).resolve().parent.parent / "examples" / "hardware"
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

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "hardware profile") -> "Hardware":
        """Build from a mapping; ValueError names a missing or unknown key."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
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
        return cls(**values)

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
                f"or pass the path of a YAML file with the fields of shardfn.partition.hardware.Hardware"
            )
    elif not path.is_file():
        raise ValueError(f"hardware profile {text!r} does not exist; valid names are {available_hardware()}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile {path}: expected a mapping of fields, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    return Hardware.from_dict(data, where=f"hardware profile {path}")
