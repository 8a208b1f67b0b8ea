"""Which device a process computes on (``runtime.device``; ``partition.mesh.local_device``): on
GPUs each rank takes ``cuda:LOCAL_RANK``, as torchrun and ``shardfn train --nproc`` number them."""

import pytest
import torch

from shardfn.config import load_config
from shardfn.partition.mesh import local_device, local_device_index
from shardfn.runtime.partitioned import device_kind


def test_cuda_without_an_index_is_this_ranks_local_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert local_device("cuda") == torch.device("cuda", 0)
    assert local_device("cuda:0") == torch.device("cuda", 0)   # an explicit index stays
    assert local_device("cpu") == torch.device("cpu")


def test_local_rank_names_the_gpu_and_a_rank_past_the_node_says_how_to_launch(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert local_device_index() == 3 and local_device("cuda") == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="nproc-per-node 2"):
        local_device_index()


def test_the_mesh_backend_follows_runtime_device():
    assert device_kind(load_config(None, ["runtime.device=cuda"])) == "cuda"
    assert device_kind(load_config(None, ["runtime.device=cuda:1"])) == "cuda"
    assert device_kind(load_config(None, [])) == "cpu"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_one_rank_nccl_mesh_runs_on_the_local_gpu(monkeypatch, clean_process_group):
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.runtime.launch import free_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    mesh = sf.Mesh({"dp": 1}, device="cuda")
    assert dist.get_backend() == "nccl" and torch.cuda.current_device() == 0
    x = torch.ones(4, device=local_device("cuda"))
    dist.all_reduce(x)
    assert x.device == torch.device("cuda", 0) and mesh.device == "cuda"
