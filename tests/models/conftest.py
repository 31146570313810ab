import pytest
import torch


@pytest.fixture(autouse=True)
def seeded():
    """Every model test starts from seed 0."""
    torch.manual_seed(0)
