"""Detection: per-signal baselines, detectors, the detector bank and fault attribution.

Pure Python (no torch.distributed, no framework): the bank runs identically on every rank over
the reduced signal table, so every rank reaches the same findings at the same step.
"""

from mechmon_megatron.detect.attribution import Diagnosis, diagnose, parse_location
from mechmon_megatron.detect.bank import DetectorBank
from mechmon_megatron.detect.base import Detector, Finding
from mechmon_megatron.detect.baseline import Baseline
from mechmon_megatron.detect.channel import SignalChannel
from mechmon_megatron.detect.detectors import (
    Bounds,
    Cusum,
    LossSpike,
    NonFinite,
    RobustZ,
    ZSpike,
)
from mechmon_megatron.detect.patterns import compile_pattern

__all__ = [
    "Baseline",
    "Bounds",
    "Cusum",
    "Detector",
    "DetectorBank",
    "Diagnosis",
    "Finding",
    "LossSpike",
    "NonFinite",
    "RobustZ",
    "SignalChannel",
    "ZSpike",
    "compile_pattern",
    "diagnose",
    "parse_location",
]
