"""Fixtures of the reference-engine tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Run the reference model on one intra-op thread (its operations are small; see replay())."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
