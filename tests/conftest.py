"""Shared pytest fixtures."""
import pytest
import torch


@pytest.fixture(autouse=True)
def seed_torch():
    """Every test starts from the same random state, so a failure reproduces when the test is run alone."""
    torch.manual_seed(0)
    yield
