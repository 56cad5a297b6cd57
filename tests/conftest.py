"""Test markers: `gpu` tests need a Hopper GPU (sm_90) and flash3's compiled kernels;
they are skipped elsewhere (CI has no GPU), and run on the device with `make test-gpu`.
Fixtures: `seed`, a per-test seed for the random inputs."""
import zlib

import pytest
import torch


def hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper (sm_90) GPU and the compiled extension")


def pytest_collection_modifyitems(config, items):
    if hopper_available():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request) -> int:
    """A seed from the test id: every test draws its own inputs, the same on every run."""
    return zlib.crc32(request.node.nodeid.encode())
