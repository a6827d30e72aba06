"""The DeepSpeed optim probe's micro-batch cache and loss reduction (no DeepSpeed needed)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mechmon_megatron.integrations.deepspeed.probe_batch import BatchCache, scalar_loss


def test_a_scalar_loss_is_the_tensor_its_loss_attribute_or_a_tuples_first_item():
    loss = torch.tensor(2.5, dtype=torch.bfloat16)
    assert scalar_loss(loss).dtype == torch.float32
    assert scalar_loss(SimpleNamespace(loss=torch.tensor([1.0]))).item() == 1.0
    assert scalar_loss((torch.tensor(3.0), torch.zeros(4))).item() == 3.0
    assert scalar_loss(torch.zeros(2)) is None
    assert scalar_loss(torch.tensor(1)) is None
    assert scalar_loss({"logits": torch.zeros(2)}) is None


def test_the_cache_keeps_references_to_each_steps_first_forward_only_when_active():
    cache = BatchCache()
    first, second = torch.arange(3), torch.arange(4)
    cache.capture(1, (first,), {})
    assert cache.step is None
    cache.active = True
    cache.capture(1, (first,), {"mask": None})
    cache.observe(torch.tensor(0.5))
    cache.capture(1, (second,), {})
    cache.observe(torch.zeros(2))
    assert cache.step == 1 and cache.args[0] is first and cache.kwargs == {"mask": None}
    assert cache.reducible
    cache.capture(2, (second,), {})
    cache.observe(torch.zeros(2))
    assert cache.args[0] is second and not cache.reducible
