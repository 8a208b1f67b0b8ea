import pytest
import torch.distributed as dist


@pytest.fixture
def clean_process_group():
    """Tests that create a Mesh in this process start and end with no process group."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
