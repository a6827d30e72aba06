"""A recorded corpus re-scored in seconds: the `dev` campaign's attention fault in the first layer
of a 3-layer multi-query model with qk-layernorm (truncation, 6 bits, every row, onset 2,500 of
5,000 steps; AdamW weight decay 0.1, warm-up, cosine to 10 %, clip 1.0) and its healthy twin.

This is the run on which the product's own signature once went unreported: the layer's Delta2
entropy sat 0.3-0.8 nats below its twin's from the first sample after onset. The logs were
recorded once (``tests/data/drill_corpus/``); the test scores them with the shipped detectors
through ``mechmon drill --rescore`` and holds the result: the fault is detected, named
``attention``, within 2 samples of its oracle step and before every comparison rule, and the
healthy twin stays silent.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from mechmon_megatron.cli import main
from mechmon_megatron.drill import build_campaign, load_campaign

CORPUS = Path(__file__).resolve().parents[1] / "data" / "drill_corpus"


def _recorded(tmp_path: Path) -> tuple[Path, Path]:
    """The corpus copied to ``tmp_path``, each run keyed to today's trainer config (the key says
    which config a finished run was trained with; the logs are what is scored)."""
    campaign = tmp_path / "corpus.yaml"
    shutil.copy(CORPUS / "corpus.yaml", campaign)
    out = tmp_path / "out"
    for run in build_campaign(load_campaign(str(campaign))).runs:
        src, dst = CORPUS / "runs" / run.name, out / "runs" / run.name
        dst.mkdir(parents=True)
        shutil.copy(src / "run.json", dst / "run.json")
        for log in ("train.jsonl", "metrics.jsonl"):
            (dst / log).write_bytes(gzip.decompress((src / f"{log}.gz").read_bytes()))
        (dst / "drill_key").write_text(run.key() + "\n")
    return campaign, out


def test_recorded_attention_fault_is_detected_at_its_oracle_step_and_the_twin_is_silent(
        tmp_path: Path) -> None:
    campaign, out = _recorded(tmp_path)
    code = main(["drill", "--campaign", str(campaign), "--out", str(out), "--rescore",
                 "--no-plots"])
    report = json.loads((out / "drill.json").read_text())
    rows = {r["name"]: r for r in report["runs"]}
    healthy, faulty = rows["healthy-mqa_ln-s11"], rows["attn_trunc_first-s11"]
    assert code == 0  # every target met
    assert healthy["detectors"]["mechmon"]["false_alarm_step"] is None
    mech = faulty["detectors"]["mechmon"]
    assert faulty["oracle_step"] is not None
    assert mech["alarm_step"] is not None and mech["fault_class"] == "attention"
    assert faulty["oracle_lag"]["mechmon"] <= 2
    for rule in ("loss_spike", "loss_z", "grad_norm_z", "max_logit_z", "qk_clip"):
        other = faulty["detectors"][rule]["alarm_step"]
        assert other is None or mech["alarm_step"] < other, rule
