"""One atomic writer for every file a later process reads, and nothing loaded that can run code.

``atomic_write.py`` is the package's one way to leave a file (alarm file, rank and state files,
tracker, run.json, reports): temporary file, fsync, ``os.replace``. State comes back through
``torch.load(weights_only=True)`` only. The source checks keep new code on that path: a
``torch.save`` beside an ``atomic_write`` call, no other rename, no unrestricted load.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch

from mechmon_megatron.atomic_write import atomic_write

PACKAGE = Path(__file__).resolve().parents[2] / "mechmon_megatron"


@functools.cache
def _trees() -> list[tuple[str, ast.AST, dict[ast.AST, ast.AST]]]:
    """Each source file of the package: its name, syntax tree and child -> parent map."""
    trees = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        trees.append((str(path.relative_to(PACKAGE)), tree, parents))
    return trees


def _calls(owner: str, name: str) -> list[tuple[str, ast.Call, list[ast.AST]]]:
    """``(file:line, call, enclosing nodes)`` for each call of ``owner.name(...)`` in the
    package's source (docstrings and comments do not count)."""
    found = []
    for where, tree, parents in _trees():
        for node in ast.walk(tree):
            func = node.func if isinstance(node, ast.Call) else None
            if (isinstance(func, ast.Attribute) and func.attr == name
                    and isinstance(func.value, ast.Name) and func.value.id == owner):
                chain, up = [], node
                while up in parents:
                    up = parents[up]
                    chain.append(up)
                found.append((f"{where}:{node.lineno}", node, chain))
    return found


def _is_atomic_write(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "atomic_write"


def test_a_write_that_fails_midway_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "rank_00000.pt"
    atomic_write(target, lambda fh: torch.save({"step": torch.tensor(1)}, fh))

    def half(fh):
        fh.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, half)
    assert torch.load(target, weights_only=True)["step"].item() == 1
    assert [p.name for p in tmp_path.iterdir()] == ["rank_00000.pt"]


def test_every_torch_save_in_the_package_writes_through_the_atomic_writer():
    saves = _calls("torch", "save")
    assert saves, "the source scan found no torch.save at all"
    direct = [where for where, _, chain in saves if not any(map(_is_atomic_write, chain))]
    assert not direct, f"torch.save outside atomic_write: {direct}"


def test_only_the_atomic_writer_renames_files_into_place():
    # alarm.py moves a foreign alarm file aside (a rename of an existing file, not a write).
    renames = {where.split(":")[0] for name in ("replace", "rename")
               for where, _, _ in _calls("os", name)}
    assert renames <= {"atomic_write.py", "alarm.py"}, renames


def test_every_torch_load_in_the_package_is_weights_only():
    loads = _calls("torch", "load")
    assert loads, "the source scan found no torch.load at all"
    unsafe = [where for where, call, _ in loads
              if not any(k.arg == "weights_only" and getattr(k.value, "value", None) is True
                         for k in call.keywords)]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"
    assert not _calls("pickle", "load") + _calls("pickle", "loads"), "an unrestricted unpickle"
