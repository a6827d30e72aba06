"""Every ``mechmon`` command against a table of bad inputs: one line on stderr, the right code.

A mistake of the user (an argument, a config or campaign file, a directory) must never read as
a result: exit code 2 (``commands/exit_codes.py``; 1 is "alarmed" / "targets missed"), one line
on stderr that names what is wrong, and no traceback. The commands run in this process
(``main(argv)``); none of these inputs gets as far as training.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from mechmon_megatron.cli import main
from mechmon_megatron.commands.exit_codes import (
    EXIT_CODES,
    EXIT_CRASH,
    EXIT_NOT_JUDGED,
    EXIT_USAGE,
)
from mechmon_megatron.launch import megatron as launcher

BAD_YAML = "qk:\n  interval: [1\n"
YAML_AT = r"bad\.yaml, line 3, column 1: invalid YAML"


def _files(root: Path) -> None:
    """The bad inputs of the table, under ``root``."""
    (root / "bad.yaml").write_text(BAD_YAML)
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "models_list.yaml").write_text("name: x\nsteps: 10\nseeds: [1]\nmodels: [a, b]\n")
    (root / "inf.yaml").write_text("detectors: {attn: {robust_z: {threshold: .inf}}}\n")
    (root / "train_layers0.yaml").write_text("model: {num_layers: 0}\n")
    (root / "train_nan.yaml").write_text("optim: {lr: .nan}\n")
    (root / "tp2.yaml").write_text("parallel: {tp: 2}\n")
    (root / "train_sgd.yaml").write_text("optim: {name: sgd}\n")
    (root / "train_clip.yaml").write_text("steps: 2\nmodel: {num_layers: 1, hidden_size: 32, "
                                          "extra: {qk_clip: true}}\n")
    (root / "plain.txt").write_text("hello\n")
    (root / "ckpts").mkdir()
    run = root / "trunc_alarm"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "signals": {}}) + "\n")
    (run / "alarm.json").write_text('{"alarm_id": "ab12", "fault_cl')
    run = root / "no_signals"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "findings": []}) + "\n")
    (root / "empty_run").mkdir()
    (root / "used").mkdir()
    (root / "used" / "x").write_text("")
    # A checkpoint whose rank file was cut short (a copy interrupted, a full disk).
    ckpt = root / "trunc_ckpt" / "iter_0000002"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "rank_00000.pt").write_bytes(b"PK\x03\x04" + bytes(60))
    (root / "trunc_ckpt" / "latest_checkpointed_iteration.txt").write_text("2\n")
    (root / "interval_1e9.yaml").write_text("qk: {interval: 1e9}\n")
    (root / "qk_layers.yaml").write_text("qk: {layers: [2, 9]}\n")
    # 9 levels of 9 aliases: 9**9 values if expanded (a 52 MB message before the reader's cap).
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in itertools.pairwise("abcdefghi")]
    (root / "bomb.yaml").write_text("\n".join(levels) + "\n")
    (root / "tiny.yaml").write_text(
        "steps: 2\nlog_interval: 0\nmodel: {num_layers: 1, hidden_size: 32, "
        "num_attention_heads: 2, seq_length: 16}\ndata: {global_batch_size: 2, max_bytes: 8192}\n")


CASES = [
    # (argv, stderr pattern): every one exits 2 with one line on stderr
    (["nosuchcommand"], r"mechmon: error: argument COMMAND: invalid choice"),
    (["config", "validate", "bad.yaml"], rf"mechmon config: mechmon: {YAML_AT}"),
    (["config", "validate", "missing.yaml"], r"mechmon config: mechmon: missing\.yaml: no such"),
    (["config", "validate", "inf.yaml"], r"inf\.yaml: mechmon\.detectors\.attn\.robust_z\."
                                         r"threshold: invalid value inf; allowed: a finite"),
    (["config", "validate", "interval_1e9.yaml"],
     r"interval_1e9\.yaml: mechmon\.qk\.interval: invalid value '1e9'; allowed: an integer"),
    (["config", "validate", "bomb.yaml"], r"bomb\.yaml: invalid YAML: its aliases expand to more "
                                          r"than 100,000 values"),
    (["config", "defaults", "--preset", "nope"], r"argument --preset: invalid choice: 'nope'"),
    (["config", "thresholds", "bad.yaml", "--layers", "2", "--heads", "4"],
     rf"mechmon config: mechmon: {YAML_AT}"),
    (["config", "thresholds", "inf.yaml", "--layers", "0", "--heads", "4"],
     r"argument --layers: invalid value '0'; allowed: an integer in 1\.\.100000"),
    (["config", "thresholds", "inf.yaml", "--layers", "2", "--heads", "4"],
     r"robust_z\.threshold: invalid value inf"),
    (["config", "thresholds", "list.yaml", "--layers", "2", "--heads", "4", "--kv-groups", "3"],
     r"list\.yaml: .*a mapping"),
    (["config", "thresholds", "tiny.yaml", "--layers", "2", "--heads", "4", "--kv-groups", "3"],
     r"tiny\.yaml: .*unknown key"),
    (["config", "thresholds", "qk_layers.yaml", "--layers", "2", "--heads", "4", "--kv-groups",
      "3"], r"mechmon config: --kv-groups 3 must divide --heads 4"),
    (["config", "thresholds", "qk_layers.yaml", "--layers", "2", "--heads", "4", "--beta2", "1"],
     r"mechmon config: --beta2 1\.0 must be in \[0, 1\)"),
    (["config", "thresholds", "qk_layers.yaml", "--layers", "2", "--heads", "4"],
     r"mechmon config: mechmon\.qk\.layers: invalid value \[2, 9\]; allowed: attention layers "
     r"of this model \(2 layers: 1\.\.2\); layer\(s\) 9 do not exist"),
    (["drill", "--out", "o", "--campaign", "bad.yaml"], rf"mechmon drill: campaign: {YAML_AT}"),
    (["drill", "--out", "o", "--quick", "--config", "bad.yaml"],
     rf"mechmon drill: mechmon: {YAML_AT}"),
    (["drill", "--out", "o", "--campaign", "models_list.yaml"],
     r"campaign\.models: invalid value \['a', 'b'\]; allowed: a mapping"),
    (["drill", "--out", "o", "--quick", "--config", "inf.yaml"],
     r"inf\.yaml: mechmon\.detectors\.attn\.robust_z\.threshold"),
    (["drill", "--out", "o", "--jobs", "0"], r"argument --jobs: invalid value '0'"),
    (["drill", "--out", "o", "--quick", "--campaign", "full"], r"--quick contradicts"),
    (["scan", "ckpts", "--config", "bad.yaml"], rf"mechmon scan: mechmon: {YAML_AT}"),
    (["scan", "plain.txt"], r"mechmon scan: plain\.txt: not a directory"),
    (["scan", "missing_dir"], r"mechmon scan: missing_dir: no such directory"),
    (["scan", "ckpts"], r"mechmon scan: ckpts: no checkpoints found"),
    (["scan", "ckpts", "--threads", "-1"], r"argument --threads: invalid value '-1'; allowed: "
                                           r"an integer >= 0"),
    (["scan", "ckpts", "--warmup-samples", "1"], r"argument --warmup-samples: invalid value"),
    (["report", "trunc_alarm"], r"mechmon report: trunc_alarm/alarm\.json: unreadable"),
    (["report", "no_signals"], r"no_signals/metrics\.jsonl: record 1 has no 'signals'"),
    (["report", "empty_run"], r"mechmon report: empty_run: no metrics\.jsonl or train\.jsonl"),
    (["report", "missing_dir"], r"mechmon report: missing_dir: no such directory"),
    (["train", "--config", "bad.yaml"], rf"mechmon train: train: {YAML_AT}"),
    (["train", "--config", "missing.yaml"], r"mechmon train: train: missing\.yaml: no such file"),
    (["train", "--config", "list.yaml"], r"list\.yaml: train: invalid value \[1, 2\]; allowed: "
                                         r"a mapping"),
    (["train", "--config", "train_layers0.yaml"], r"train\.model\.num_layers: invalid value 0"),
    (["train", "--config", "train_nan.yaml"], r"train\.optim\.lr: invalid value nan; allowed: "
                                              r"a finite number"),
    (["train", "--config", "tiny.yaml", "--steps", "0"], r"argument --steps: invalid value"),
    (["train", "--config", "train_sgd.yaml"], r"train\.optim\.name: invalid value 'sgd'; "
                                              r"allowed: one of 'adamw', 'muon'"),
    (["train", "--config", "train_clip.yaml"], r"train\.model\.extra\.qk_clip: invalid value "
                                               r"True; allowed: with attention bf16_flash"),
    (["train", "--config", "tp2.yaml"], r"train\.parallel: invalid value tp=2, pp=1, ep=1 for 1 "
                                        r"process\(es\)"),
    (["demo", "--steps", "0"], r"mechmon demo: error: argument --steps: invalid value '0'"),
    (["demo", "--fault-step", "x"], r"argument --fault-step: invalid value 'x'"),
    (["demo", "--out", "used"], r"mechmon demo: --out used: not empty"),
    (["bench", "--intervals", "10", "0"], r"argument --intervals: invalid value '0'; allowed: "
                                          r"an integer in 1\.\.100000"),
    (["bench", "--layers", "0"], r"argument --layers: invalid value '0'"),
    (["bench", "--hidden", "10", "--heads", "3"],
     r"mechmon bench: train\.model\.hidden_size: invalid value 10; allowed: a multiple of "
     r"num_attention_heads \(3\)"),
]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    _files(root)
    return root


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("argv", "pattern"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_input_is_one_line_on_stderr_and_exit_code_2(bad_inputs, monkeypatch, capsys,
                                                          argv, pattern):
    monkeypatch.chdir(bad_inputs)
    code = _run(argv)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    line = _one_line(err)
    assert re.search(pattern, line), err
    assert len(line) <= 1100, len(line)  # a message quoting its input is cut


def test_resuming_from_a_truncated_rank_file_is_one_line_and_exit_code_2(bad_inputs,
                                                                          monkeypatch, capsys):
    monkeypatch.chdir(bad_inputs)
    code = _run(["train", "--config", "tiny.yaml", "--out", "resumed", "--load", "trunc_ckpt"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert re.search(r"mechmon train: .*trunc_ckpt/iter_0000002/rank_00000\.pt", _one_line(err))


@pytest.mark.parametrize("how", ["--mechmon-config", "--mechmon-config="])
def test_the_megatron_launcher_reports_a_yaml_syntax_error_on_one_line(bad_inputs, capsys, how):
    script = bad_inputs / "pretrain_gpt.py"
    script.write_text(f"open({str(bad_inputs / 'ran')!r}, 'w').close()\n")
    cfg = str(bad_inputs / "bad.yaml")
    flags = [how + cfg] if how.endswith("=") else [how, cfg]
    assert launcher.main([str(script), *flags]) == EXIT_USAGE
    line = _one_line(capsys.readouterr().err)
    assert re.search(rf"mechmon: error: --mechmon-config .*: mechmon: .*{YAML_AT}", line), line
    assert not (bad_inputs / "ran").exists()


def test_every_command_and_config_subcommand_is_in_the_table_of_bad_inputs():
    from mechmon_megatron.cli import COMMANDS

    tried = {tuple(argv[:2]) if argv[0] == "config" else (argv[0],) for argv, _ in CASES}
    wanted = {(c,) for c in COMMANDS if c != "config"} | {
        ("config", sub) for sub in ("validate", "defaults", "thresholds")}
    assert wanted <= tried, sorted(wanted - tried)


def test_a_bug_is_its_traceback_and_exit_code_70_never_a_result(monkeypatch, capsys):
    from mechmon_megatron.commands import scan_cmd

    def crash(args):
        raise KeyError("a bug")

    monkeypatch.setattr(scan_cmd, "run", crash)
    assert main(["scan", "anywhere"]) == EXIT_CRASH != 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'a bug'" in err
    assert err.strip().splitlines()[-1] == ("mechmon scan: internal error (KeyError); this is a "
                                            "bug, not a result (exit code 70)")

    def alarm(args):
        raise SystemExit(86)

    monkeypatch.setattr(scan_cmd, "run", alarm)
    with pytest.raises(SystemExit, match="86"):
        main(["scan", "anywhere"])


@pytest.mark.parametrize("warmup", [4, 10])
def test_a_scan_whose_pairs_all_form_the_baseline_says_nothing_was_judged(tmp_path, capsys,
                                                                          warmup):
    from tests.unit.test_scan import _save_plain, _weights

    _save_plain(tmp_path / "run", _weights([50, 100, 150, 200, 250]))
    code = main(["scan", str(tmp_path / "run"), "--warmup-samples", str(warmup),
                 "--no-progress", "--no-plots", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == EXIT_NOT_JUDGED, out
    assert "4 checkpoint pairs, nothing judged" in out and "silent" not in out


def test_the_readme_documents_every_exit_code_in_one_table():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    assert sorted(int(line.split("|")[1]) for line in rows) == sorted(EXIT_CODES)
    for command in ("demo", "train", "drill", "scan", "report", "bench", "config"):
        assert f"`{command}`" in section, command
