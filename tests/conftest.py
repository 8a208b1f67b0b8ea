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


@pytest.fixture(autouse=True, scope="module")
def no_process_group_between_files():
    """A process group one test file leaves (a fake mesh built for planning) is not the next
    file's: each file starts and ends with none."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
