"""Config schema: strict loading, messages that name the dotted path, presets, round trips."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mechmon_megatron.cli import main
from mechmon_megatron.commands import config_cmd
from mechmon_megatron.config import (
    PRESETS,
    ActionsConfig,
    MechMonConfig,
    QKConfig,
    load_config,
    load_preset,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


def test_defaults_round_trip_through_dict_yaml_and_json(tmp_path):
    config = MechMonConfig.defaults()
    assert load_config(config.to_dict()) == config
    (tmp_path / "c.yaml").write_text(config.to_yaml())
    (tmp_path / "c.json").write_text(json.dumps(config.to_dict()))
    assert load_config(tmp_path / "c.yaml") == config
    assert load_config(str(tmp_path / "c.json")) == config


def test_hash_is_stable_and_changes_with_any_field():
    a, b = MechMonConfig.defaults(), load_config({})
    assert a.config_hash() == b.config_hash() and len(a.config_hash()) == 16
    changed = load_config({"detectors": {"attn": {"cusum": {"drift": 2.0}}}})
    assert changed.config_hash() != a.config_hash()


def test_partial_mapping_keeps_other_defaults_including_per_family_ones():
    config = load_config({"detectors": {"router": {"robust_z": {"threshold": 7}}}})
    assert config.detectors.router.robust_z.threshold == 7.0
    assert config.detectors.router.signals == MechMonConfig().detectors.router.signals
    assert config.detectors.router.directions == {"router/entropy_mean/*": "down"}
    assert config.detectors.attn.direction == "down"


def test_unknown_key_names_the_dotted_path_and_the_closest_key():
    with pytest.raises(ValueError) as err:
        load_config({"qk": {"intervl": 5}})
    assert str(err.value) == "mechmon.qk.intervl: unknown key; did you mean 'interval'?"
    with pytest.raises(
        ValueError,
        match=r"^mechmon\.detectors\.global\.cusum\.treshold: unknown "
        r"key; did you mean 'threshold'\?$",
    ):
        load_config({"detectors": {"global": {"cusum": {"treshold": 3}}}})


def test_python_name_of_a_renamed_key_is_rejected_with_the_yaml_name():
    with pytest.raises(ValueError, match=r"mechmon\.global_: unknown key; did you mean 'global'"):
        load_config({"global_": {"loss": False}})


def test_unknown_key_without_close_match_lists_the_known_keys():
    with pytest.raises(ValueError, match=r"mechmon\.sinks\.zzz: unknown key; known keys: jsonl"):
        load_config({"sinks": {"zzz": 1}})


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"qk": {"interval": 0}}, r"mechmon\.qk\.interval: invalid value 0; allowed: an integ"),
        ({"qk": {"interval": True}}, r"mechmon\.qk\.interval: invalid value True; allowed: an int"),
        ({"qk": {"terms": ["delta9"]}}, r"mechmon\.qk\.terms\[0\]: invalid value 'delta9'"),
        ({"qk": {"layers": [0]}}, r"mechmon\.qk\.layers: invalid value \[0\]; allowed: 'all' or"),
        ({"router": {"enabled": "yes"}}, r"mechmon\.router\.enabled: invalid value 'yes'"),
        ({"actions": {"exit_code": 16}}, r"exit_code: invalid value 16.*EXIT_CODE_RESUME"),
        ({"actions": {"exit_code": 17}}, r"exit_code: invalid value 17.*FAILED_ON_RESULT"),
        ({"actions": {"exit_code": 0}}, r"exit_code: invalid value 0.*success"),
        ({"actions": {"on_alarm": "exit"}}, r"on_alarm: invalid value 'exit'; allowed: one of"),
        ({"detectors": {"attn": {"robust_z": {"k": 5}}}}, r"robust_z\.k: invalid value 5.*n = 4"),
        ({"detectors": {"optim": {"robust_z": {"single_threshold": -1}}}},
         r"optim\.robust_z\.single_threshold: invalid value -1\.0; allowed: null or a number in"),
        (
            {"detectors": {"attn": {"signals": ["global/loss"]}}},
            r"mechmon\.detectors\.attn\.signals\[0\]: invalid value 'global/loss'; allowed: a pat",
        ),
        (
            {"detectors": {"router": {"directions": {"router/x": "sideways"}}}},
            r"mechmon\.detectors\.router\.directions\.router/x: invalid value 'sideways'",
        ),
        ({"detectors": {"baseline": {"track_rate": 1.5}}}, r"baseline\.track_rate: invalid value"),
        ({"sinks": {"wandb": {"mode": "cloud"}}}, r"mechmon\.sinks\.wandb\.mode: invalid value"),
        ({"qk": 3}, r"mechmon\.qk: invalid value 3; allowed: a mapping"),
        # Values that would switch a rule off without a word: refused with the allowed range.
        ({"qk": {"interval": 10**9}}, r"mechmon\.qk\.interval: invalid value 1000000000; "
         r"allowed: an integer in 1\.\.100000"),
        ({"optim": {"sharpness": {"interval": 10**9}}}, r"sharpness\.interval: .*1\.\.100000"),
        ({"detectors": {"warmup_samples": 10**9}},
         r"mechmon\.detectors\.warmup_samples: invalid value 1000000000; allowed: an integer "
         r"in 3\.\.10000"),
        ({"detectors": {"attn": {"robust_z": {"threshold": float("inf")}}}},
         r"mechmon\.detectors\.attn\.robust_z\.threshold: invalid value inf; allowed: a finite"),
        ({"detectors": {"attn": {"robust_z": {"threshold": ".inf"}}}},
         r"robust_z\.threshold: invalid value '\.inf'; allowed: a finite number or null"),
        ({"detectors": {"attn": {"robust_z": {"threshold": 1e9}}}},
         r"robust_z\.threshold: invalid value 1000000000\.0; allowed: null or a number in "
         r"\(0, 100\]"),
        ({"detectors": {"attn": {"cusum": {"threshold": "nan"}}}},
         r"cusum\.threshold: invalid value 'nan'; allowed: a finite number or null"),
        ({"detectors": {"false_alarms_per_10k_steps": float("inf")}},
         r"mechmon\.detectors\.false_alarms_per_10k_steps: invalid value inf; allowed: a fin"),
        ({"detectors": {"false_alarms_per_10k_steps": 1e9}},
         r"false_alarms_per_10k_steps: invalid value 1000000000\.0; allowed: a number in "
         r"\[1e-06, 10000\]"),
        ({"detectors": {"attn": {"bounds": {"max": float("nan")}}}},
         r"attn\.bounds\.max: invalid value nan; allowed: a finite number or null"),
    ],
)
def test_invalid_values_name_path_value_and_what_is_allowed(block, message):
    with pytest.raises(ValueError, match=message):
        load_config(block)


def test_direct_construction_validates_with_the_field_name():
    with pytest.raises(ValueError, match=r"^interval: invalid value -1"):
        QKConfig(interval=-1)
    with pytest.raises(ValueError, match=r"^exit_code: invalid value 16"):
        ActionsConfig(exit_code=16)


def test_yaml_float_without_dot_is_accepted_as_a_number():
    config = load_config({"detectors": {"baseline": {"min_abs_scale": "1e-9"}}})
    assert config.detectors.baseline.min_abs_scale == 1e-9


def test_deepspeed_block_and_optional_family_baseline():
    config = load_config({"detectors": {"attn": {"baseline": {"mode": "tracked"}}}})
    assert config.detectors.attn.baseline.mode == "tracked"
    assert config.detectors.attn.baseline.method == "median_mad"
    assert (
        load_config({"detectors": {"global": {"baseline": None}}}).detectors.global_.baseline
        is None
    )


@pytest.mark.parametrize("name", PRESETS)
def test_presets_validate_and_configs_dir_holds_the_same_files(name):
    config = load_config(preset=name)
    assert config != MechMonConfig.defaults()
    assert load_config(CONFIGS / f"{name}.yaml") == config
    assert load_config({"preset": name}) == config


def test_preset_key_in_a_file_is_overlaid_by_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: low_overhead\nqk:\n  interval: 250\n")
    config = load_config(path)
    assert config.qk.interval == 250 and config.qk.per_head is False
    assert load_preset("dense")["router"] == {"enabled": False}


def test_unknown_preset_is_rejected_with_suggestion():
    with pytest.raises(ValueError, match=r"mechmon\.preset: unknown preset 'mo'; did you mean"):
        load_config({"preset": "mo"})


def test_full_example_equals_defaults_and_the_generated_text():
    text = (CONFIGS / "full.yaml").read_text()
    assert text == config_cmd.render_yaml(MechMonConfig.defaults())
    assert load_config(CONFIGS / "full.yaml") == MechMonConfig.defaults()


def test_cli_validate_prints_ok_and_hash_or_the_error(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("qk:\n  interval: 50\n")
    bad.write_text("qk:\n  intervl: 50\n")
    assert config_cmd.run(_cli("config", "validate", str(good))) == 0
    assert load_config(good).config_hash() in capsys.readouterr().out
    # Bad input raises from run(); the CLI (run_command) prints it on one line and exits 2.
    assert main(["config", "validate", str(bad)]) == 2
    assert "mechmon.qk.intervl: unknown key; did you mean 'interval'?" in capsys.readouterr().err
    assert main(["config", "validate", str(tmp_path / "missing.yaml")]) == 2
    with pytest.raises(ValueError, match=r"bad\.yaml: mechmon\.qk\.intervl: unknown key"):
        config_cmd.run(_cli("config", "validate", str(bad)))


def test_cli_defaults_prints_loadable_commented_yaml(tmp_path, capsys):
    assert config_cmd.run(_cli("config", "defaults", "--preset", "moe")) == 0
    out = capsys.readouterr().out
    assert "# Monitor every this many steps" in out
    (tmp_path / "moe.yaml").write_text(out)
    assert load_config(tmp_path / "moe.yaml") == load_config(preset="moe")


def test_a_key_a_release_moved_names_its_new_place():
    with pytest.raises(ValueError, match=r"^mechmon\.fp8\.attn_logits: unknown key; it moved to "
                                         r"mechmon\.qk\.max_logit"):
        load_config({"fp8": {"attn_logits": True}})
