"""Fixtures shared by the CPU kernel tests."""
import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def single_threaded_torch():
    """The references here are tiny; torch's OpenMP threads would only fight the kernel pool for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pool():
    from ktrans.kernels import cpu

    return cpu.make_pool(2)
