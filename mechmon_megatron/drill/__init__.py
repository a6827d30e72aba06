"""Fault drills: the product's proof that mechanism monitors warn before the loss diverges.

``mechmon drill --campaign FILE|NAME --out DIR`` runs a campaign on the reference trainer and
writes the lead-time table::

    spec = load_campaign(FILE | quick | full | long)     strict YAML (spec.py)
    campaign = build_campaign(spec, --config)            healthy run per (model, seed) + one run
                                                         per (fault, seed); shipped mechmon
                                                         defaults + intervals, on_alarm log
    run_campaign(campaign, DIR, jobs)                     DIR/runs/<name>/{train,metrics}.jsonl
        every run trains to the end; a finished run with the same config key is reused
    write_report(campaign, DIR, ...)
        per run: divergence (+1 nat) and degradation (+0.25 nat) vs the same-seed healthy run
                 every detector replayed over the logs (evaluate.py): mechmon, loss_spike,
                 loss_z, grad_norm_z, max_logit_z, qk_clip (replay.py); alarms before onset
                 are false
                 alarms, alarms the healthy twin shares are not detections
                 lead = divergence - alarm, lead % of (divergence - onset), attribution
        healthy runs and controls: false alarms per 10k steps
        -> DIR/drill.json (schema in docs/drill.md), DIR/drill.md, DIR/plots/<run>.png

:func:`emulation_check` recomputes the attention fault's premise for the report.
"""

from mechmon_megatron.drill.campaign import (
    EXPECTED_CLASS,
    KIND_FAMILY,
    Campaign,
    DrillRun,
    build_campaign,
    mechmon_section,
)
from mechmon_megatron.drill.emulation import emulation_check
from mechmon_megatron.drill.evaluate import (
    BASELINE_DETECTORS,
    DEGRADATION_MARGIN,
    DETECTORS,
    DIVERGENCE_MARGIN,
    DetectorResult,
    evaluate_run,
    gap_step,
    loss_ema,
    monitor_config,
)
from mechmon_megatron.drill.fault_spec import FaultSpec
from mechmon_megatron.drill.report import SCHEMA_VERSION, evaluate_campaign, write_report
from mechmon_megatron.drill.runner import is_done, run_campaign, run_dir, train_one
from mechmon_megatron.drill.spec import SHIPPED, CampaignSpec, load_campaign

__all__ = [
    "BASELINE_DETECTORS",
    "DEGRADATION_MARGIN",
    "DETECTORS",
    "DIVERGENCE_MARGIN",
    "EXPECTED_CLASS",
    "KIND_FAMILY",
    "SCHEMA_VERSION",
    "SHIPPED",
    "Campaign",
    "CampaignSpec",
    "DetectorResult",
    "DrillRun",
    "FaultSpec",
    "build_campaign",
    "emulation_check",
    "evaluate_campaign",
    "evaluate_run",
    "gap_step",
    "is_done",
    "load_campaign",
    "loss_ema",
    "mechmon_section",
    "monitor_config",
    "run_campaign",
    "run_dir",
    "train_one",
    "write_report",
]
