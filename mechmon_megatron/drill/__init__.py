"""Fault drills: the product's proof that mechanism monitors warn before the loss diverges.

``mechmon drill --out DIR`` runs a campaign on the reference trainer and writes the lead-time
table::

    campaign = build_campaign(quick, seeds, faults)      healthy runs + one run per fault, seed
    run_campaign(campaign, DIR, jobs)                     DIR/runs/<name>/{train,metrics}.jsonl
        every run trains to the end: on_alarm log, run_past_alarm (the divergence is observed)
    write_report(campaign, DIR, ...)
        per run: divergence step vs the healthy run of the same seed (evaluate.divergence_step)
                 every detector replayed offline over the same logs (evaluate.replay):
                 mechmon (attn + router families), loss_spike, loss_z, grad_norm_z, global
                 lead = divergence - alarm, lead % of (divergence - fault start), attribution
        healthy runs: false alarms
        -> DIR/drill.json, DIR/drill.md, DIR/plots/<run>.png

:func:`emulation_check` recomputes the fault's premise (bf16 emulation close to fp32 without
bias; injected bias gives a sign-consistent delta error) for the report.
"""

from mechmon_megatron.drill.campaign import (
    DEFAULT_SEEDS,
    DIVERGENCE_MARGIN,
    DRILL_DETECTORS,
    FAULT_CLASSES,
    FAULT_START,
    FAULTS,
    Campaign,
    DrillRun,
    build_campaign,
    train_config,
)
from mechmon_megatron.drill.emulation import emulation_check
from mechmon_megatron.drill.evaluate import (
    DETECTORS,
    DetectorResult,
    divergence_step,
    evaluate_run,
    replay,
)
from mechmon_megatron.drill.report import evaluate_campaign, write_report
from mechmon_megatron.drill.runner import run_campaign, run_dir, train_one

__all__ = [
    "DEFAULT_SEEDS",
    "DETECTORS",
    "DIVERGENCE_MARGIN",
    "DRILL_DETECTORS",
    "FAULT_CLASSES",
    "FAULT_START",
    "FAULTS",
    "Campaign",
    "DetectorResult",
    "DrillRun",
    "build_campaign",
    "divergence_step",
    "emulation_check",
    "evaluate_campaign",
    "evaluate_run",
    "replay",
    "run_campaign",
    "run_dir",
    "train_config",
    "train_one",
    "write_report",
]
