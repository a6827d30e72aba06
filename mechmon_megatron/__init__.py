"""mechmon_megatron: mechanism-driven monitors for LLM training instability.

One training step, as the monitors see it::

    begin_step(t)                      arm router capture if t is a monitored step
    forward/backward(t)                router hooks record per-token routing statistics
    optimizer.step()                   weights W(t)
    end_step(t, loss, grad_norm)       every delta steps:
        monitors      -> local signals     (QK-update spectra of W(t) - W(t - delta), router stats)
        reduce        -> full signal table (one SUM all-reduce over the world group)
        detectors     -> findings          (robust z / CUSUM / bounds against warm-up baselines)
        consensus     -> verdict           (one MAX all-reduce: every rank acts at the same step)
        actions/sinks -> log, warn, checkpoint-and-exit; jsonl / TensorBoard / W&B
"""

__version__ = "0.1.0"
