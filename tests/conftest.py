"""Shared pytest fixtures."""
import pytest
import torch


@pytest.fixture(autouse=True)
def seed_torch():
    """Every test starts from the same random state, so a failure reproduces when the test is run alone."""
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; without it they are skipped, not failed (CI has no GPU)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
