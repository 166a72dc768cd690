"""Shared fixtures of the plugin tests. GPU tests are marked ``@pytest.mark.gpu`` (deselected by
default; run with ``-m gpu`` on a machine with a CUDA GPU) and take the ``cuda_torch`` fixture,
which skips them when torch or a GPU is missing."""

import pytest


@pytest.fixture(scope="session")
def cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch
