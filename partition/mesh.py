"""``Mesh``: named device-mesh axes over a real (or fake, for planning) process group.

    mesh = Mesh({"dp": 2, "tp": 2})          # needs 4 ranks: torchrun, or `shardfn train --nproc 4`
    plan = Mesh({"ep": 64, "pp": 16}, fake=True)   # one process, no collectives run

On GPUs each process computes on ``cuda:LOCAL_RANK`` (:func:`local_device`): torchrun sets
``LOCAL_RANK`` (the rank within its node), and so does ``shardfn train --nproc N``. A mesh on
``"cuda"`` makes that device current before NCCL sees it, so every collective of the process
group and of the device mesh's subgroups runs on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardfn.core._torch_private import gloo_worker_threads, one_gloo_worker_thread

_LAUNCH_HINT = (
    "launch one process per rank, e.g. `torchrun --nproc-per-node N ...` or "
    "`shardfn train --nproc N ...`, or pass fake=True to plan without running collectives"
)


@dataclass(frozen=True, eq=False)
class Mesh:
    """A named device mesh. ``axes`` maps axis name -> size, major to minor.

    Axes of size 1 are kept (so specs naming them stay valid) but get no device-mesh dim, so
    they cost nothing: ``dims`` are the axes the device mesh really has.

    Args:
        axes: ordered mapping of axis name to size, e.g. ``{"dp": 2, "tp": 2}``.
        fake: build the mesh on torch's fake process group (planning only; nothing is sent).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (nccl); default: cuda when available.
    """

    axes: dict
    fake: bool = False
    device: str | None = None

    def __post_init__(self):
        axes = dict(self.axes)
        if not axes:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh({'dp': 1})")
        for name, size in axes.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"mesh axis names are identifiers; got {name!r}")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes are positive integers")
        object.__setattr__(self, "axes", axes)
        device = self.device or ("cuda" if torch.cuda.is_available() and not self.fake else "cpu")
        object.__setattr__(self, "device", device)
        _ensure_process_group(self.size, fake=self.fake, device=device)
        world = dist.get_world_size()
        if world != self.size:
            raise ValueError(
                f"the mesh {axes} has {self.size} devices but the world size is {world}; "
                f"make the product of the axis sizes equal {world}, or launch {self.size} processes"
            )
        if device == "cuda":
            torch.cuda.set_device(local_device_index())
        dims = tuple(a for a, s in axes.items() if s > 1) or (next(iter(axes)),)
        object.__setattr__(self, "dims", dims)
        dm = init_device_mesh(device, tuple(axes[a] for a in dims), mesh_dim_names=dims)
        if not self.fake and len(dims) == 1 and (gloo_worker_threads(dm.get_group(dims[0])) or 1) > 1:
            dm = _own_world_group(device, dims)
        object.__setattr__(self, "device_mesh", dm)
        if not self.fake:  # DTensor's cached decisions name the groups of an equal, older mesh
            from shardfn.core._torch_private import clear_sharding_cache

            clear_sharding_cache()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.axes.values())

    @property
    def size(self) -> int:
        n = 1
        for s in self.axes.values():
            n *= s
        return n

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def placements(self, spec, ndim: int, *, where: str = "value") -> tuple:
        """DTensor placements over this mesh's dims for ``spec`` (see ``spec.to_placements``)."""
        from shardfn.partition.spec import to_placements

        return to_placements(spec, ndim, self.dims, where=where, known=self.names)

    def axis_of_group(self, group_name: str) -> str:
        """The mesh axis whose process group has this name (as functional collectives record it)."""
        for name in self.dims:
            if self.device_mesh.get_group(name).group_name == group_name:
                return name
        raise KeyError(f"no mesh axis owns process group {group_name!r}")

    def gloo_worker_threads(self) -> int | None:
        """The most worker threads any of this mesh's gloo groups runs its collectives on; None
        where it has none (nccl, fake). Groups shardfn creates have one; a default group made by
        ``init_process_group("gloo")`` before the mesh keeps gloo's two.

            Mesh({"fsdp": 2}).gloo_worker_threads()   # 1 under `shardfn train --nproc 2`
        """
        if self.fake or self.device_mesh is None:
            return None
        counts = [gloo_worker_threads(self.device_mesh.get_group(d)) for d in self.dims]
        return max((c for c in counts if c is not None), default=None)

    def sub(self, names) -> "Mesh":
        """The mesh of the axes ``names`` through this rank (the others held at its coordinate):
        a pipeline stage's mesh is ``mesh.sub(["dp", "fsdp", "ep", "tp"])``. Its collectives run on
        this mesh's process groups; nothing is initialised. When every kept axis has size 1 the
        result is a one-device mesh with no device-mesh dims (``size == 1``), for code that runs
        without DTensors.

            stage_mesh = Mesh({"pp": 2, "fsdp": 2}).sub(["fsdp"])   # Mesh(fsdp=2), this rank's pp slice
        """
        unknown = [n for n in names if n not in self.axes]
        if unknown:
            raise ValueError(f"Mesh.sub: unknown axes {unknown}; the mesh has {tuple(self.axes)}")
        sub = object.__new__(Mesh)
        object.__setattr__(sub, "axes", {n: self.axes[n] for n in self.axes if n in names})
        object.__setattr__(sub, "fake", self.fake)
        object.__setattr__(sub, "device", self.device)
        dims = tuple(d for d in self.dims if d in names and self.axes[d] > 1)
        object.__setattr__(sub, "dims", dims)
        object.__setattr__(sub, "device_mesh", self.device_mesh[dims] if dims else None)
        return sub

    def coordinate(self) -> dict[str, int]:
        """This rank's coordinate along each axis."""
        coord = dict(zip(self.dims, self.device_mesh.get_coordinate())) if self.device_mesh is not None else {}
        return {a: coord.get(a, 0) for a in self.names}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.axes.items())
        return f"Mesh({inner}{', fake' if self.fake else ''})"


def _ensure_process_group(size: int, *, fake: bool, device: str) -> None:
    if not fake:
        # every gloo group made from here on (this one, the mesh's subgroups): collectives in flight
        # together are safe on one worker thread; a group made before keeps its own count
        one_gloo_worker_thread()
    if dist.is_initialized():
        if fake and dist.get_backend() == "fake" and dist.get_world_size() != size:
            dist.destroy_process_group()  # planning another world size in the same process
        else:
            return
    if fake:
        from shardfn.core._torch_private import fake_store

        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=size)
        return
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        if device == "cuda":  # NCCL binds the group to the current device: make it this rank's first
            torch.cuda.set_device(local_device_index())
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_device_index()))
        else:
            dist.init_process_group("gloo")
        return
    if size == 1:
        # A one-device mesh needs no launcher: a private single-rank gloo group.
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return
    raise RuntimeError(
        f"Mesh of {size} devices: no process group is initialised and the torchrun variables "
        f"(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are not set; {_LAUNCH_HINT}"
    )


def local_device_index() -> int:
    """This process's GPU index: ``LOCAL_RANK`` where the launcher set it, else the global rank
    modulo the visible GPUs (0 outside a process group).

        local_device_index()   # 3 for the fourth rank of a node under torchrun
    """
    if "LOCAL_RANK" in os.environ:
        index = int(os.environ["LOCAL_RANK"])
    else:
        index = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    count = torch.cuda.device_count()
    if count and index >= count:
        raise RuntimeError(f"LOCAL_RANK {index} but this node shows {count} CUDA device(s); launch at most "
                           f"{count} processes per node (torchrun --nproc-per-node {count}), or set "
                           f"CUDA_VISIBLE_DEVICES")
    return index


def local_device(device: str | torch.device) -> torch.device:
    """The device this process computes on for ``runtime.device`` ``device``: ``"cuda"`` (no
    index) becomes ``cuda:LOCAL_RANK`` (:func:`local_device_index`); anything else stays as given.

        local_device("cuda")     # cuda:1 on LOCAL_RANK=1
        local_device("cuda:0")   # cuda:0 (a single-device run that picks its GPU)
        local_device("cpu")      # cpu
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_device_index())
    return device


def _own_world_group(device: str, dims: tuple[str, ...]):
    """A one-dim device mesh over every rank on a gloo group of its own, made with one worker
    thread. ``init_device_mesh`` hands a mesh over the whole world the default group itself;
    one the user made (``init_process_group("gloo")`` before the mesh, as under torchrun) runs
    on gloo's two worker threads, where collectives in flight together corrupted memory, so the
    overlap pass would have to stay off. Subgroups of a several-dim mesh are made after
    :func:`one_gloo_worker_thread` and need none of this."""
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group(list(range(dist.get_world_size())))  # the default group's backends
    return DeviceMesh.from_group(group, device, mesh_dim_names=dims)


_FAKE: dict = {"world": None, "meshes": {}}


def fake_mesh(axes: dict) -> Mesh:
    """A :class:`Mesh` of ``axes`` on torch's fake process group, one per shape while that group lives.

    DTensor caches sharding decisions keyed by meshes that compare equal, so a second mesh of a
    shape already seen would get collectives on the first one's process groups; this reuses the
    mesh of each shape, and clears that cache when the fake group is rebuilt (another world size).

    Example:
        mesh = fake_mesh({"dp": 16, "ep": 64})   # 1024 simulated ranks in this process
    """
    from shardfn.core._torch_private import clear_sharding_cache

    key = tuple(axes.items())
    alive = dist.is_initialized() and dist.group.WORLD is _FAKE["world"]
    if alive and key in _FAKE["meshes"]:
        return _FAKE["meshes"][key]
    mesh = Mesh(dict(axes), fake=True)
    if dist.group.WORLD is not _FAKE["world"]:
        clear_sharding_cache()
        _FAKE.update(world=dist.group.WORLD, meshes={})
    _FAKE["meshes"][key] = mesh
    return mesh
