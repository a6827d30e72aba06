"""Shared pytest setup: deterministic seeds, the repository root on sys.path, strict mode.

``MECHMON_STRICT=1`` (inherited by spawned ranks and CLI subprocesses): any error a monitor
catches and counts fails the step, so a test never passes on top of a silently void signal.
Tests that inject failures set ``strict: false`` in their config.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Spawned ranks already use one thread each; the parent does too, so the small dense kernels of
# the unit tests don't fight the ranks (or each other) for the two cores.
torch.set_num_threads(1)
os.environ.setdefault("MECHMON_STRICT", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
