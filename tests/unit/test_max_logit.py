"""The max attention logit: computed per head by the attention emulation, judged by the
comparison rules ``max_logit_z`` and ``qk_clip`` in a drill."""

from __future__ import annotations

import math

import torch

from mechmon_megatron.config import load_config
from mechmon_megatron.drill import evaluate_run
from mechmon_megatron.faults.core_attention import BF16FlashAttention, head_max_logits

CONFIG = load_config({"detectors": {"global": {"enabled": False}, "attn": {"enabled": False},
                                    "optim": {"enabled": False}, "router": {"enabled": False},
                                    "fp8": {"enabled": False}}})


def test_emulation_records_each_heads_max_unmasked_logit_over_its_forwards():
    torch.manual_seed(0)
    q, b, n, g, k = 6, 2, 4, 2, 8
    att = BF16FlashAttention(1, n, g, softmax_scale=k ** -0.5, causal=True)
    seen = []
    for _ in range(2):
        query, key = torch.randn(q, b, n, k), torch.randn(q, b, g, k)
        att(query, key, torch.randn(q, b, g, k), None)
        q_BNQK = query.permute(1, 2, 0, 3).double()
        k_BNSK = key.repeat_interleave(n // g, dim=2).permute(1, 2, 0, 3).double()
        s_BNQS = q_BNQK @ k_BNSK.transpose(-1, -2) * k ** -0.5
        s_BNQS = s_BNQS.masked_fill(torch.ones(q, q, dtype=torch.bool).triu(1), -math.inf)
        seen.append(s_BNQS.amax(dim=(0, 2, 3)))
    expected_N = torch.maximum(seen[0], seen[1])
    assert att.current_max_attn_logits.shape == (n,)
    assert torch.allclose(att.current_max_attn_logits.double(), expected_N, rtol=1e-6, atol=1e-6)
    att.current_max_attn_logits = None  # the trainer's reset before each step
    att(torch.randn(q, b, n, k), torch.randn(q, b, g, k), torch.randn(q, b, g, k), None)
    assert not torch.equal(att.current_max_attn_logits, expected_N.float())


def test_head_max_logits_ignores_masked_scores():
    q_BNQK = torch.ones(1, 1, 2, 1)
    k_BNSK = torch.tensor([[[[1.0], [50.0]]]])
    mask = torch.tensor([[False, True], [False, False]])
    assert head_max_logits(q_BNQK, k_BNSK, mask, 1.0).tolist() == [50.0]
    assert head_max_logits(q_BNQK[:, :, :1], k_BNSK, mask[:1], 1.0).tolist() == [1.0]


def _train(steps: int, logit_at: dict[int, float]) -> list[dict]:
    return [{"step": s, "loss": 2.0 + 0.01 * math.sin(s), "grad_norm": 1.0,
             "max_logit": logit_at.get(s, 10.0 + 0.1 * math.sin(0.7 * s))}
            for s in range(1, steps + 1)]


def test_max_logit_rules_detect_a_jump_and_the_qk_clip_threshold_after_the_onset():
    faulty = _train(1000, {s: 30.0 for s in range(600, 700)} | {800: 150.0})
    ev = evaluate_run(faulty, [], _train(1000, {}), 500, CONFIG)
    assert ev["detectors"]["max_logit_z"]["alarm_step"] == 600
    assert ev["detectors"]["max_logit_z"]["false_alarm_step"] is None
    assert ev["detectors"]["qk_clip"]["alarm_step"] == 800


def test_runs_without_a_logged_max_logit_give_the_rules_nothing():
    rows = [{k: v for k, v in r.items() if k != "max_logit"} for r in _train(600, {})]
    ev = evaluate_run(rows, [], rows, 300, CONFIG)
    for rule in ("max_logit_z", "qk_clip"):
        assert ev["detectors"][rule]["alarm_step"] is None
        assert ev["detectors"][rule]["false_alarm_step"] is None
