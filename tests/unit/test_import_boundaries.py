"""The package's layering, checked on the source: framework imports stay at the edge."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mechmon_megatron"
FRAMEWORKS = ("megatron", "deepspeed", "transformer_engine", "apex")
# Only these may import a training framework (lazily, inside functions, or at module level
# for modules that are themselves only imported by an integration).
EDGE = ("integrations/", "layouts/", "faults/", "train/", "commands/", "launch/", "deepspeed.py",
        "sinks/deepspeed_monitor.py")


def _imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(module, at_module_level) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, id(node) in top))
    return found


def _sources() -> list[tuple[str, pathlib.Path]]:
    return [(str(p.relative_to(PACKAGE)), p) for p in sorted(PACKAGE.rglob("*.py"))]


def _uses_torch_distributed_attribute(path: pathlib.Path) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "distributed"
               and isinstance(node.value, ast.Name) and node.value.id == "torch"
               for node in ast.walk(ast.parse(path.read_text())))


def test_only_the_comm_module_uses_torch_distributed():
    offenders = [rel for rel, path in _sources() if rel != "comm.py"
                 and (any(m == "torch.distributed" or m.startswith("torch.distributed.")
                          for m, _ in _imports(path))
                      or _uses_torch_distributed_attribute(path))]
    assert offenders == []


def test_core_modules_never_import_a_training_framework():
    offenders = [(rel, m) for rel, path in _sources() if not rel.startswith(EDGE)
                 for m, _ in _imports(path) if m.split(".")[0] in FRAMEWORKS]
    assert offenders == []


def test_math_and_detectors_are_pure():
    for rel, path in _sources():
        if rel.startswith(("math/", "detect/")):
            modules = {m.split(".")[0] for m, _ in _imports(path)}
            assert not modules & {"mechmon_megatron.comm", *FRAMEWORKS}, rel
            assert "mechmon_megatron.comm" not in {m for m, _ in _imports(path)}, rel


def test_integrations_import_frameworks_lazily():
    for rel, path in _sources():
        if rel.startswith(("integrations/", "layouts/", "launch/")) or rel == "deepspeed.py":
            eager = [m for m, top in _imports(path) if top and m.split(".")[0] in FRAMEWORKS]
            assert eager == [], (rel, eager)


def test_every_import_is_absolute_so_integrations_deepspeed_never_shadows_deepspeed():
    relative = [rel for rel, path in _sources() for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert relative == []
