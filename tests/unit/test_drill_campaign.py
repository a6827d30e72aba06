"""Campaign files: strict loading that names the field, the shipped campaigns, the runs built."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mechmon_megatron.config import load_config
from mechmon_megatron.drill import SHIPPED, build_campaign, load_campaign
from mechmon_megatron.drill.spec import campaign_path

_SMALL = {
    "steps": 100,
    "seeds": [1, 2],
    "models": {"dense": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}},
    "faults": [{"name": "attn", "class": "attention", "model": "dense", "onset": 0.5}],
}


def _with(path: str, value) -> dict:
    data = yaml.safe_load(yaml.safe_dump(_SMALL))
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return data


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_campaign_loads_and_pairs_each_fault_run_with_its_healthy_run(name):
    campaign = build_campaign(load_campaign(name))
    runs = campaign.by_name()
    assert campaign.name == name
    for run in campaign.runs:
        if run.healthy is None:
            continue
        partner = runs[run.healthy]
        assert (partner.model, partner.seed, partner.fault) == (run.model, run.seed, "healthy")
        assert partner.config["attention"] == run.config["attention"]
        assert partner.config["mechmon"] == run.config["mechmon"]
        assert 0 < run.fault_start < campaign.steps


def test_a_typo_in_a_campaign_file_is_refused_naming_the_dotted_field(tmp_path):
    bad = _with("models.dense.num_layer", 2)
    with pytest.raises(ValueError, match=r"campaign\.models\.dense\.num_layer: unknown key; "
                                         r"did you mean 'num_layers'\?"):
        load_campaign(bad)
    path = Path(tmp_path) / "c.yaml"
    path.write_text(yaml.safe_dump(_with("faults.0.onse", 10)))
    with pytest.raises(ValueError, match=r"campaign\.faults\[0\]\.onse: unknown key; "
                                         r"did you mean 'onset'\?"):
        load_campaign(path)
    with pytest.raises(ValueError, match=r"campaign\.faults\[0\]\.attention\.bits: invalid"):
        load_campaign(_with("faults.0.attention", {"bits": 9}))
    with pytest.raises(ValueError, match=r"campaign\.faults\[0\]\.model: invalid value 'moe'"):
        load_campaign(_with("faults.0.model", "moe"))
    with pytest.raises(ValueError, match=r"campaign\.faults\[0\]\.onset: invalid value 1\.5"):
        load_campaign(_with("faults.0.onset", 1.5))
    with pytest.raises(ValueError, match=r"campaign\.monitor\.intervall: unknown key"):
        load_campaign(_with("monitor", {"intervall": 10}))
    with pytest.raises(ValueError, match=r"campaign\.faults\[0\]\.seeds: invalid value \[3\]"):
        load_campaign(_with("faults.0.seeds", [3]))


def test_a_fault_may_run_on_a_subset_of_the_seeds():
    runs = [r.name for r in build_campaign(load_campaign(_with("faults.0.seeds", [2]))).runs]
    assert runs == ["healthy-dense-s1", "healthy-dense-s2", "attn-s2"]


def test_a_campaign_cannot_carry_detector_tuning_or_a_model_seed():
    with pytest.raises(ValueError, match=r"campaign\.detectors: unknown key"):
        load_campaign({**_SMALL, "detectors": {"warmup_samples": 5}})
    with pytest.raises(ValueError, match=r"campaign\.models\.dense\.seed"):
        load_campaign(_with("models.dense.seed", 3))


def test_runs_use_the_shipped_defaults_with_only_the_harness_keys_changed(tmp_path):
    campaign = build_campaign(load_campaign(_with("monitor", {"interval": 10})))
    shipped = load_config().to_dict()
    mech = campaign.runs[0].config["mechmon"]
    assert mech["detectors"] == shipped["detectors"]
    assert mech["qk"]["interval"] == mech["router"]["interval"] == mech["optim"]["interval"] == 10
    assert mech["optim"]["sharpness"]["interval"] == 500
    assert mech["actions"]["on_alarm"] == "log"
    assert [r.name for r in campaign.runs] == ["healthy-dense-s1", "healthy-dense-s2",
                                               "attn-s1", "attn-s2"]
    assert campaign.runs[2].fault_start == 50 and campaign.runs[2].expected_families == ("attn",)
    user = tmp_path / "m.yaml"
    user.write_text("detectors: {false_alarms_per_10k_steps: 0.5}\n")
    mine = build_campaign(load_campaign(_SMALL), user)
    assert mine.runs[0].config["mechmon"]["detectors"]["false_alarms_per_10k_steps"] == 0.5
    # detectors are replayed offline: a detector setting re-scores, it does not retrain
    assert mine.runs[0].key() == build_campaign(load_campaign(_SMALL)).runs[0].key()
    user.write_text("qk: {alpha: 1.5}\n")
    assert build_campaign(load_campaign(_SMALL), user).runs[0].key() != mine.runs[0].key()


def test_compound_faults_expect_every_mechanism_they_combine():
    data = _with("faults.0", {"name": "both", "class": "compound", "model": "dense",
                              "onset": 40, "compound": ["attention", "lr"]})
    run = build_campaign(load_campaign(data)).runs[-1]
    assert run.expected_families == ("attn", "optim")
    assert run.config["fault"]["compound"] == ["attention", "lr"]
    assert set(run.config["fault"]) == {"kind", "start_step", "compound", "attention", "lr"}


def test_shipped_campaign_files_are_package_data():
    for name in SHIPPED:
        assert campaign_path(name).is_file()


@pytest.mark.parametrize("path, value, field", [
    ("faults.0.name", "../../victim", r"faults\[0\]\.name"),
    ("faults.0.name", "..", r"faults\[0\]\.name"),
    ("faults.0.name", "a/b", r"faults\[0\]\.name"),
    ("faults.0.name", "", r"faults\[0\]\.name")])
def test_fault_names_are_identifiers_refused_otherwise_naming_the_field(path, value, field):
    with pytest.raises(ValueError, match=rf"campaign\.{field}: invalid value .*identifier"):
        load_campaign(_with(path, value))


def test_model_names_are_identifiers_refused_otherwise_naming_the_field():
    data = _with("faults.0.model", "../m")
    data["models"] = {"../m": data["models"]["dense"]}
    with pytest.raises(ValueError, match=r"campaign\.models\.\.\./m: invalid value .*identifier"):
        load_campaign(data)


def test_nothing_outside_the_output_directory_is_ever_removed(tmp_path):
    """A run named ``../../victim`` (past the loader) makes the runner refuse, not rmtree."""
    import dataclasses

    from mechmon_megatron.drill.runner import run_campaign

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    campaign = build_campaign(load_campaign(_SMALL))
    bad = dataclasses.replace(campaign.runs[-1], name="../../victim")
    campaign = dataclasses.replace(campaign, runs=[bad])
    with pytest.raises(ValueError, match="not a directory name under"):
        run_campaign(campaign, tmp_path / "out", progress=False, log=lambda _: None)
    assert (victim / "precious").read_text() == "keep"


def test_mla_dims_shape_the_key_of_mla_models_only():
    from mechmon_megatron.train.model import MLA_DIMS

    dense = build_campaign(load_campaign(_SMALL)).runs[0]
    # the keys of the runs trained before MLA shapes existed
    assert not {"multi_latent_attention", *MLA_DIMS} & set(dense.config["model"])
    mla = load_campaign(_with("models.dense.multi_latent_attention", True))
    assert set(MLA_DIMS) <= set(build_campaign(mla).runs[0].config["model"])
    other = load_campaign(_with("models.dense.multi_latent_attention", True))
    other.models["dense"].kv_lora_rank = 16
    assert build_campaign(other).runs[0].key() != build_campaign(mla).runs[0].key()


def test_a_fault_before_the_baselines_form_is_named_in_a_warning_and_the_report():
    from mechmon_megatron.drill.markdown import _blind

    early = dict(_with("steps", 4000), optim={"warmup_steps": 200}, monitor={"interval": 100})
    campaign = build_campaign(load_campaign(early))  # onset 2000 < 200 + 20 x 100
    assert campaign.judged_from == 2200
    assert [r.name for r in campaign.blind_runs()] == ["attn-s1", "attn-s2"]
    later = build_campaign(load_campaign(dict(early, steps=5000)))  # onset 2500
    assert later.blind_runs() == []
    report = {"campaign": campaign.describe(),
              "runs": [{"name": r.name, "scored_healthy": r.scored_healthy,
                        "fault_start": r.fault_start} for r in campaign.runs]}
    assert "step 2200" in _blind(report)[0] and "attn-s1, attn-s2" in _blind(report)[0]
    report["campaign"]["judged_from"] = 1000
    assert _blind(report) == []
