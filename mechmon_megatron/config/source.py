"""Reading a config file: YAML or JSON text to plain data, every failure one ``ValueError``.

Every loader of the package (mechmon config, trainer config, drill campaign) reads its file
through :func:`read_source`, so a file that cannot be used fails the same way wherever it is
given: one ``ValueError`` whose single-line message names the loader's root, the file and, for a
syntax error, the line and column (1-based, as editors count)::

    mechmon: cfg.yaml, line 3, column 1: invalid YAML: expected ',' or ']', but got '<stream end>'

YAML anchors and aliases are allowed, but a document whose aliases expand to more than
:data:`MAX_NODES` nodes (a "billion laughs" bomb: 357 bytes can expand to 10^9 values) or refer
to themselves is refused while it is still a graph of a few dozen nodes, before any value is
built. The expanded size is counted over the composed node graph with one memo per node, so the
check costs O(nodes written), not O(nodes expanded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from mechmon_megatron.config.fields import show

__all__ = ["MAX_NODES", "MAX_BYTES", "read_source", "parse_text"]

MAX_NODES = 100_000
"""Most YAML nodes a config document may expand to (its aliases counted at every use)."""

MAX_BYTES = 16 * 2**20
"""Largest config file read (16 MiB); a config is a few KiB."""


def _where(path: str, mark: Any) -> str:
    if mark is None:
        return path
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}"


def _yaml_error(path: str, exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        problem = exc.problem or "syntax error"
        if exc.context:
            problem = f"{exc.context}: {problem}"
        mark = exc.problem_mark or exc.context_mark
        start = exc.context_mark
        if start is not None and mark is not None and start.line != mark.line:
            problem += f" (started at line {start.line + 1}, column {start.column + 1})"
        return f"{_where(path, mark)}: invalid YAML: {' '.join(problem.split())}"
    if isinstance(exc, yaml.reader.ReaderError):
        return (f"{path}, character {exc.position}: invalid YAML: unacceptable character "
                f"#x{exc.character if isinstance(exc.character, int) else 0:04x}")
    return f"{path}: invalid YAML: {' '.join(str(exc).split())}"


def _expanded_size(node: yaml.Node, memo: dict[int, int], open_: set[int]) -> int:
    """Nodes of ``node`` with every alias expanded; raises ``_Cycle`` on a self-reference."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in open_:
        raise _Cycle(node)
    open_.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            size += _expanded_size(item, memo, open_)
            if size > MAX_NODES:
                break
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            size += _expanded_size(k, memo, open_) + _expanded_size(v, memo, open_)
            if size > MAX_NODES:
                break
    open_.discard(key)
    memo[key] = size
    return size


class _Cycle(Exception):
    def __init__(self, node: yaml.Node) -> None:
        super().__init__()
        self.node = node


def _load_yaml(text: str, path: str) -> Any:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            size = _expanded_size(node, {}, set())
        except _Cycle as cycle:
            raise ValueError(f"{_where(path, cycle.node.start_mark)}: invalid YAML: an alias "
                             "refers to the node that contains it") from None
        if size > MAX_NODES:
            raise ValueError(f"{path}: invalid YAML: its aliases expand to more than "
                             f"{MAX_NODES:,} values (an alias bomb?); allowed: a config that "
                             "expands to fewer")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_text(text: str, path: str, json_: bool = False) -> Any:
    """Parse config ``text`` (YAML, or JSON when ``json_``); ``path`` names it in errors.

    Raises:
        ValueError: a syntax error (line and column), an alias bomb, nesting too deep, or a
            value Python cannot hold (an integer of more than 4300 digits); one line.
    """
    try:
        if json_:
            return json.loads(text)
        return _load_yaml(text, path)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}, line {exc.lineno}, column {exc.colno}: invalid JSON: "
                         f"{exc.msg}") from None
    except yaml.YAMLError as exc:
        raise ValueError(_yaml_error(path, exc)) from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply; allowed: a config of a few levels") from None
    except ValueError as exc:
        if str(exc).startswith(path):
            raise
        raise ValueError(f"{path}: {show(' '.join(str(exc).split()))}") from None


def read_source(source: str | os.PathLike[str], root: str) -> Any:
    """The data of config file ``source`` (``.json``: JSON, else YAML; empty: ``None``).

    Args:
        source: the file.
        root: the loader's root key (``mechmon``, ``train``, ``campaign``), which starts every
            message.

    Raises:
        ValueError: ``<root>: <file>...: <what is wrong>`` on one line: a missing or
            unreadable file, a directory, a file of more than :data:`MAX_BYTES`, text that is
            not UTF-8, or what :func:`parse_text` refuses.
    """
    path = Path(source)
    name = str(source)
    try:
        if path.is_dir():
            raise ValueError(f"{root}: {name}: is a directory; allowed: a YAML or JSON file")
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"{root}: {name}: larger than {MAX_BYTES // 2**20} MiB; allowed: "
                             "a config file")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{root}: {name}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{root}: {name}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{root}: {name}: cannot read: {exc.strerror or exc}") from None
    try:
        return parse_text(text, name, json_=name.endswith(".json"))
    except ValueError as exc:
        raise ValueError(f"{root}: {exc}") from None
