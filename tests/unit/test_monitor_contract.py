"""The monitor contract (monitors/base.py): every monitor subclasses :class:`Monitor`, and the
orchestrator calls its hooks directly instead of probing for them."""

from __future__ import annotations

import ast
import importlib
import pathlib

from mechmon_megatron.monitors.base import Monitor

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mechmon_megatron"
ORCHESTRATOR = ("monitor.py", "monitor_state.py", "monitor_coverage.py")
""":class:`~mechmon_megatron.monitor.MechMon` and its mixins."""


def _monitor_classes() -> list[tuple[str, str]]:
    """``(module, class)`` of every package class that defines ``signal_names`` and
    ``end_step``: what the orchestrator runs as a monitor."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defs = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                if {"signal_names", "end_step"} <= defs and node.name != "Monitor":
                    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
                    found.append((module, node.name))
    return found


def test_every_monitor_the_package_builds_subclasses_the_base():
    classes = _monitor_classes()
    names = {name for _, name in classes}
    assert {"QKUpdateMonitor", "RouterMonitor", "OptimMonitor", "MaxLogitMonitor",
            "FP8Monitor"} <= names
    outside = [f"{m}.{c}" for m, c in classes
               if not issubclass(getattr(importlib.import_module(m), c), Monitor)]
    assert outside == []


def test_a_monitor_without_optional_hooks_gets_the_plain_defaults():
    class Plain(Monitor):
        family = "attn"
        interval = 3

        def signal_names(self) -> list[str]:
            return []

        def begin_step(self, step: int) -> None:
            pass

        def end_step(self, step: int) -> dict[str, float | None]:
            return {}

        def coverage(self) -> dict[str, int]:
            return {}

        def state_dict(self) -> dict:
            return {"kept": 1}

        def load_state_dict(self, sd: dict) -> None:
            pass

    plain = Plain()
    assert [plain.due(s) for s in range(4)] == [True, False, False, True]
    assert not (plain.looks or plain.stateless or plain.row_shards)
    assert plain.coverage_key is None and plain.estimator is None
    assert plain.derive({"x": 1.0}) == {} and plain.sharded_template({}) == {}
    assert plain.full_state_dict(5) == {"kept": 1} and plain.sharded_state() == ({}, {})


def test_the_orchestrator_probes_no_monitor_with_getattr_or_hasattr():
    offenders = []
    for rel in ORCHESTRATOR:
        tree = ast.parse((PACKAGE / rel).read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")):
                target = ast.unparse(node.args[0])
                if not (target.startswith("self.config") or target == "diagnosis"):
                    offenders.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []
