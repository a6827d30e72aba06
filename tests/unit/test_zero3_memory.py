"""The ZeRO-3 sharpness probe's memory refusal, on doubles of DeepSpeed's partitioned params
(its CUDA path cannot run here; the decision is plain arithmetic on the attributes it reads)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mechmon_megatron.integrations.deepspeed.zero3 import zero3_memory_problem


class _Part:
    """The ``ds_tensor`` attributes the check reads."""

    def __init__(self, cuda: bool, element_size: int) -> None:
        self.is_cuda, self.device, self._size = cuda, "cuda:0", element_size

    def element_size(self) -> int:
        return self._size


def _params(numel: int, cuda: bool = True, element_size: int = 2) -> list[SimpleNamespace]:
    # A 70B-class model in 8 tensors of bf16 partitions.
    return [SimpleNamespace(ds_numel=numel // 8, ds_tensor=_Part(cuda, element_size))] * 8


def test_a_full_gradient_larger_than_half_the_free_memory_refuses_the_probe(monkeypatch):
    free = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    why = zero3_memory_problem(_params(70 * 10**9))  # 70e9 x (2 + 4) B = 391 GiB
    assert why is not None and "391.2 GiB" in why and "80.0 GiB free here" in why
    assert zero3_memory_problem(_params(1 * 10**9)) is None  # 5.6 GiB: fits
    # 7e9 x (2 + 4) B = 39.1 GiB is under half of 80 GiB; with fp32 partitions, 52.2 GiB is not
    assert zero3_memory_problem(_params(7 * 10**9)) is None
    assert zero3_memory_problem(_params(7 * 10**9, element_size=4)) is not None


def test_partitions_in_host_memory_are_not_checked(monkeypatch):
    def boom(device=None):
        raise AssertionError("mem_get_info called for host partitions")

    monkeypatch.setattr(torch.cuda, "mem_get_info", boom)
    assert zero3_memory_problem(_params(70 * 10**9, cuda=False)) is None
    assert zero3_memory_problem([]) is None
