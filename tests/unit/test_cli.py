"""The ``mechmon`` command line: every documented subcommand is reachable."""

from __future__ import annotations

import subprocess
import sys

from mechmon_megatron.cli import COMMANDS, main


def test_every_subcommand_has_help():
    for name in COMMANDS:
        out = subprocess.run([sys.executable, "-m", "mechmon_megatron", name, "--help"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (name, out.stderr)
        assert f"mechmon {name}" in out.stdout


def test_config_defaults_prints_yaml_that_validates(tmp_path, capsys):
    assert main(["config", "defaults"]) == 0
    path = tmp_path / "defaults.yaml"
    path.write_text(capsys.readouterr().out)
    assert main(["config", "validate", str(path)]) == 0
    assert capsys.readouterr().out.startswith("OK ")
    path.write_text("qk:\n  intervl: 10\n")
    assert main(["config", "validate", str(path)]) == 2
    captured = capsys.readouterr()
    message = "mechmon.qk.intervl: unknown key; did you mean 'interval'?"
    assert message in captured.out + captured.err
