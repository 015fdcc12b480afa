"""Benchmarks set the process-wide torch thread count; every test here gets it back afterwards."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
