"""Shared pytest setup: deterministic seeds, the repository root on sys.path, strict mode.

``MECHMON_STRICT=1`` (inherited by spawned ranks and CLI subprocesses): any error a monitor
catches and counts fails the step, so a test never passes on top of a silently void signal.
Tests that inject failures set ``strict: false`` in their config.
"""

import os
import shutil
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Spawned ranks already use one thread each; the parent does too, so the small dense kernels of
# the unit tests don't fight the ranks (or each other) for the two cores.
torch.set_num_threads(1)
os.environ.setdefault("MECHMON_STRICT", "1")


_EXT_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Build torch JIT extensions (DeepSpeed's CPU shm op) in a directory of this session's own.

    A build killed midway leaves its ``lock`` file in the shared cache, and torch then waits for
    it forever: every later DeepSpeed engine in every later session hangs. A private directory
    (inherited by spawned ranks and subprocesses) costs one ~30 s build a session.
    """
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="mechmon-torch-ext-")
        config.stash[_EXT_DIR] = os.environ["TORCH_EXTENSIONS_DIR"]


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_EXT_DIR, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def deepspeed_ops() -> None:
    """Build DeepSpeed's CPU shm op once, in this process, before ranks race for it."""
    pytest.importorskip("deepspeed.comm.torch").build_shm_op()


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
