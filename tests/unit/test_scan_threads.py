"""``mechmon scan``'s torch thread count: one by default, so a loaded machine is not
oversubscribed (torch's own choice, every core, spins: ~20x slower on 2 shared cores)."""

from __future__ import annotations

import argparse

import torch

from mechmon_megatron.commands import scan_cmd


def _args(*argv: str, run_dir: str = "run_dir") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scan_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["scan", run_dir, *argv])


def test_scan_runs_on_one_thread_unless_asked_for_more():
    assert _args().threads == 1
    assert _args("--threads", "4").threads == 4
    assert _args("--threads", "0").threads == 0  # torch's choice


def test_the_default_is_applied_before_the_scan(monkeypatch, tmp_path):
    seen = []

    def fake_scan(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise FileNotFoundError("stop here")

    before = torch.get_num_threads()
    monkeypatch.setattr("mechmon_megatron.scan.scan", fake_scan)
    try:
        try:
            scan_cmd.run(_args(run_dir=str(tmp_path)))
        except FileNotFoundError:
            pass
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
