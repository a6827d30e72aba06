"""A one-fault campaign on the drill's tiny dense GPT (2 x 64, 4 heads, seq 64, batch 16, Adam
2e-3 constant after 20 warm-up steps, seed 1234), for tests that train it with the trainer."""

from __future__ import annotations

from typing import Any

__all__ = ["lr_campaign"]


def lr_campaign(name: str, steps: int, sharpness_interval: int, onset: int,
                factor: float = 30.0) -> dict[str, Any]:
    """Its healthy run and one LR step fault (``factor`` times from ``onset``), monitor
    interval 10."""
    return {
        "name": f"{name}_test",
        "steps": steps,
        "seeds": [1234],
        "monitor": {"interval": 10, "sharpness_interval": sharpness_interval},
        "models": {"dense": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                             "seq_length": 64}},
        "optim": {"lr": 2.0e-3, "min_lr": 2.0e-3, "warmup_steps": 20, "schedule": "constant"},
        "data": {"global_batch_size": 16, "max_bytes": 2_000_000},
        "faults": [{"name": name, "class": "lr", "model": "dense", "onset": onset,
                    "lr": {"factor": factor, "ramp_steps": 0}}],
    }
