"""Shared pytest fixtures."""
import os

import pytest
import torch

# Without a GPU the Triton kernels' tests (marked `triton`) run under Triton's interpreter. Triton reads the flag
# when a kernel is decorated, so it is set before any test module imports ktrans.kernels.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _hf_deltanet_in_torch() -> None:
    """transformers' Qwen3-Next calls fla-core's kernels for its DeltaNet whenever fla-core imports (its hub-kernel
    fallback, on any device: on a CPU they fail, on a GPU they change the numerics). fla-core is a test dependency
    (KGatedDeltaNetFLA), and the oracle is transformers' own torch code: the two functions are unwrapped back to it."""
    try:
        import fla  # noqa: F401
    except ImportError:
        return
    import inspect

    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as hf
    except ImportError:  # no transformers: the tests that need the oracle skip themselves
        return
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        if hasattr(hf, name):
            setattr(hf, name, inspect.unwrap(getattr(hf, name)))


_hf_deltanet_in_torch()


@pytest.fixture(autouse=True)
def seed_torch():
    """Every test starts from the same random state, so a failure reproduces when the test is run alone."""
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; without it they are skipped, not failed (CI has no GPU). Tests marked `triton`
    need triton to import (a test dependency); with it they run compiled on CUDA, interpreted without."""
    try:
        import triton  # noqa: F401
    except ImportError:
        no_triton = pytest.mark.skip(reason="triton does not import (pip install -e '.[test]')")
        for item in items:
            if "triton" in item.keywords:
                item.add_marker(no_triton)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def triton_device() -> torch.device:
    """Where a `triton` test's tensors live: the GPU when there is one, else the CPU (interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
