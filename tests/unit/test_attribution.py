"""Attribution of crafted finding sets to a fault class with evidence."""

from __future__ import annotations

import pytest

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank, Finding, diagnose, parse_location


def _finding(
    signal: str, onset: int, step: int | None = None, score: float = 6.0, detector: str = "cusum"
) -> Finding:
    family = signal.split("/", 1)[0]
    return Finding(
        detector,
        signal,
        family,
        step if step is not None else onset + 300,
        onset,
        1.0,
        2.0,
        0.1,
        score,
    )


ATTN = "attn/delta2/entropy/layer_7/head_3"
ROUTER = "router/entropy_mean/layer_4"
LOSS = "global/loss"


def test_attention_first_is_an_attention_fault_even_if_loss_follows():
    d = diagnose([_finding(LOSS, 900), _finding(ATTN, 500)])
    assert (d.fault_class, d.first_family, d.families) == ("attention", "attn", ["attn", "global"])
    assert d.description == "biased low-precision attention / QK drift"
    assert (d.onset_step, d.alarm_step) == (500, 1200)


def test_router_first_is_router_collapse():
    d = diagnose([_finding(ROUTER, 200), _finding(ATTN, 400)])
    assert d.fault_class == "router_collapse" and d.first_family == "router"


def test_update_ratios_of_the_router_group_alone_name_the_router_not_the_learning_rate():
    alone = diagnose([_finding("optim/update_ratio_step/router", 3200),
                      _finding("optim/update_ratio_step/router/layer_2", 3200)])
    assert (alone.fault_class, alone.families) == ("router_collapse", ["router"])
    assert {e["family"] for e in alone.evidence} == {"router"}
    # a learning-rate fault moves every group: the router group among them stays `lr`
    every = diagnose([_finding("optim/update_ratio_step/router", 3300),
                      _finding("optim/update_ratio_step/qkv", 3300)])
    assert (every.fault_class, every.families) == ("lr", ["optim"])
    sharp = diagnose([_finding("optim/sharpness/eos_ratio", 300, detector="bounds")])
    assert sharp.fault_class == "lr"


def test_the_sharpness_bound_names_the_router_when_its_top_eigenvector_lives_there():
    from mechmon_megatron.detect import attribution

    eos = _finding("optim/sharpness/eos_ratio", 300, detector="bounds")
    share, mlp, qkv = (f"{attribution.SHARE}{g}" for g in ("router", "mlp", "qkv"))
    router = attribution.locate(eos, {share: 0.4, mlp: 0.3, qkv: 0.3})
    assert router.locus == "router"  # the largest part of the mode
    assert diagnose([router]).fault_class == "router_collapse"
    for table in ({share: 0.3, mlp: 0.4, qkv: 0.3}, {share: float("nan"), mlp: 1.0},
                  {share: 0.0}, {}):  # elsewhere, or no estimate
        assert attribution.locate(eos, table).locus is None
        assert diagnose([attribution.locate(eos, table)]).fault_class == "lr"
    # a group's update ratio is not located by the mode: another group's keeps it `lr`
    ratio = _finding("optim/update_ratio_step/qkv", 300)
    assert attribution.locate(ratio, {share: 0.9}).locus is None
    assert diagnose([router, attribution.locate(ratio, {share: 0.9})]).fault_class == "lr"
    # through the bank: the same sample's share sets the locus of the bound's finding
    cfg = load_config({"detectors": {"warmup_samples": 3, "attn": {"enabled": False},
                                     "router": {"enabled": False}, "global": {"enabled": False},
                                     "fp8": {"enabled": False}}})
    bank = DetectorBank(cfg, ["optim/sharpness/eos_ratio", share])
    found = []
    for step in range(1, 12):
        eos_ratio = 3.0 if step >= 8 else 0.5
        found += bank.update(step, {"optim/sharpness/eos_ratio": eos_ratio, share: 0.8})
    bounds = [f for f in found if f.detector == "bounds"]
    assert bounds and all(f.locus == "router" for f in bounds)
    assert bank.diagnosis().fault_class == "router_collapse"
    assert Finding(**bounds[0].to_dict()) == bounds[0]  # the locus survives the state round trip


def test_the_whole_model_update_ratio_names_the_router_when_the_router_makes_its_update():
    from mechmon_megatron.detect import attribution

    def table(router: float, mlp: float) -> dict[str, float]:
        sq = attribution.UPDATE_SQ  # per key: summed over the layers of each group
        return {f"{sq}router/layer_1": router / 2, f"{sq}router/layer_2": router / 2,
                f"{sq}mlp/layer_1": mlp / 2, f"{sq}mlp/layer_2": mlp / 2,
                f"{sq}qkv/layer_1": 1.0, f"{sq}embedding": 2.0, f"{sq}norm": float("nan")}

    ratio = _finding("optim/update_ratio_step/all", 300)
    router_side = _finding("router/entropy_mean/layer_2", 300)
    located = attribution.locate(ratio, table(router=40.0, mlp=3.0))
    assert located.locus == "router"  # the router's updates make the whole-model ratio
    assert diagnose([located, router_side]).fault_class == "router_collapse"
    # every group's updates grown alike (a learning-rate fault): the router stays ~1%
    for tab in (table(router=0.05, mlp=3.0), table(router=3.0, mlp=3.0), {}):
        kept = attribution.locate(ratio, tab)
        assert kept.locus is None
        assert diagnose([kept, router_side]).fault_class == "compound"
    # a sharpness finding in that sample too, even where the mode straddles groups
    eos = _finding("optim/sharpness/eos_ratio", 300, detector="robust_z")
    split = {f"{attribution.SHARE}router": 0.28, f"{attribution.SHARE}embedding": 0.33}
    assert attribution.locate(eos, split).locus is None
    assert attribution.locate(eos, {**split, **table(router=40.0, mlp=3.0)}).locus == "router"
    # only the whole-model ratio is located by the update: a group's ratio keeps its group
    qkv = _finding("optim/update_ratio_step/qkv", 300)
    assert attribution.locate(qkv, table(router=40.0, mlp=3.0)).locus is None


def test_global_only_is_a_global_fault():
    d = diagnose([_finding(LOSS, 100, detector="nonfinite", score=float("inf"))])
    assert (d.fault_class, d.families) == ("global", ["global"])


def test_two_families_at_the_same_onset_are_compound_naming_both():
    d = diagnose([_finding(ROUTER, 300), _finding(ATTN, 300)])
    assert d.fault_class == "compound" and d.families == ["attn", "router"]
    assert d.description == "compound: attention + router_collapse"


def test_the_loss_or_grad_norm_at_a_mechanisms_onset_is_its_symptom_not_a_compound():
    grad = "global/grad_norm"
    d = diagnose([_finding(grad, 3100, score=36.0), _finding(ROUTER, 3100)])
    assert (d.fault_class, d.first_family) == ("router_collapse", "router")
    assert d.families == ["router", "global"]  # still listed as evidence
    wide = diagnose([_finding(ROUTER, 300), _finding(grad, 350)], compound_window=100)
    assert wide.fault_class == "router_collapse"
    assert diagnose([_finding(grad, 200), _finding(ROUTER, 300)]).fault_class == "global"


def test_compound_window_widens_what_counts_as_together():
    findings = [_finding(ATTN, 300), _finding(ROUTER, 500), _finding(LOSS, 2000)]
    assert diagnose(findings).fault_class == "attention"
    wide = diagnose(findings, compound_window=200)
    assert wide.fault_class == "compound" and wide.description.endswith("+ router_collapse")


def test_evidence_is_ordered_by_onset_then_score_and_names_layer_and_head():
    d = diagnose(
        [
            _finding(LOSS, 900),
            _finding(ATTN, 500, score=7.0),
            _finding("attn/dwq/entropy/layer_2/min", 500, score=9.0),
        ]
    )
    assert [e["signal"] for e in d.evidence] == ["attn/dwq/entropy/layer_2/min", ATTN, LOSS]
    assert [(e["layer"], e["head"]) for e in d.evidence] == [(2, None), (7, 3), (None, None)]
    first = d.evidence[0]
    assert (first["baseline_location"], first["baseline_scale"], first["value"]) == (2.0, 0.1, 1.0)
    assert d.to_dict()["evidence"] == d.evidence


@pytest.mark.parametrize(
    ("signal", "expected"),
    [
        ("attn/layer_delta2/entropy/layer_12", (12, None)),
        ("attn/delta3/fro/layer_1/head_15", (1, 15)),
        ("router/maxvio/layer_30", (30, None)),
        ("global/grad_norm", (None, None)),
    ],
)
def test_layer_and_head_are_parsed_from_signal_names(signal, expected):
    assert parse_location(signal) == expected


def test_no_findings_is_an_error():
    with pytest.raises(ValueError, match="no findings"):
        diagnose([])


def test_bank_diagnosis_uses_alarming_findings_only_and_the_configured_window():
    config = load_config(
        {
            "detectors": {
                "compound_window": 10_000,
                "attn": {"bounds": {"max": 10.0}},
                "router": {"bounds": {"max": 10.0}},
            }
        }
    )
    bank = DetectorBank(config, [ATTN.replace("head_3", "min"), ROUTER, LOSS])
    bank.update(0, {LOSS: 2.0})
    assert bank.diagnosis() is None
    bank.update(100, {ATTN.replace("head_3", "min"): 11.0})
    assert bank.diagnosis().fault_class == "attention"
    bank.update(200, {ROUTER: 11.0})
    assert bank.diagnosis().fault_class == "compound"
