import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared machine: one thread each (two spinning threads under load cost ~100x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
