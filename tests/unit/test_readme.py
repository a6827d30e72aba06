"""The READMEs name only what exists.

Read from their code (fenced blocks and inline spans) and links: every repository path (a glob
matches something), every ``mechmon`` subcommand with each flag written after it (``mechmon <cmd>
--help`` lists it), the flags a section about one command names alone (``--warmup-samples`` under
"mechmon scan"), the launcher's own flags, ``-m`` modules and the names Python blocks import from
mechmon. Each kind is also counted, so that a parser gone blind cannot pass vacuously.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

from mechmon_megatron import cli
from mechmon_megatron.integrations.megatron import lm
from mechmon_megatron.launch import megatron as launcher

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "launch" / "README.md"]
TOP = ("configs", "slurm", "launch", "patches", "scripts", "benchmarks", "docs", "tests",
       "mechmon_megatron")
"""Top-level directories: a path in the READMEs starting with one is the repository's."""
SECTION_COMMANDS = {"mechmon scan: would it have warned?": "scan", "Fault drills": "drill"}
"""README sections about one command: flags named alone there are that command's."""

_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
_PATH = re.compile(r"(?<![\w$/.~-])((?:" + "|".join(TOP) + r")/[\w./*-]*)")
_MECHMON = re.compile(r"(?:^|[\s;&(])(?:mechmon|-m mechmon_megatron)\s+([a-z]+)(.*)")
_FLAG = re.compile(r"(?<!\S)(--[a-z][a-z0-9-]*)")
_END = re.compile(r"\s#|\s\|\s|;|&&|>")


class Doc:
    """One Markdown file's code, split by ``## `` section."""

    def __init__(self, path: Path) -> None:
        self.path = path
        text = path.read_text()
        self.links = [m for m in re.findall(r"\]\(([^)#\s]+)\)", text) if "://" not in m]
        self.sections: list[tuple[str, list[str], list[str]]] = []
        for chunk in re.split(r"\n## ", "\n" + text):
            title = chunk.split("\n", 1)[0].strip()
            blocks = [b.replace("\\\n", " ") for b in _FENCE.findall(chunk)]
            prose = _FENCE.sub("", chunk)
            spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]
            self.sections.append((title, blocks, spans))

    def code(self) -> list[str]:
        """Every line of every block, and every inline span."""
        return [line for _, blocks, spans in self.sections
                for text in blocks + spans for line in text.splitlines()]


def _docs() -> list[Doc]:
    return [Doc(path) for path in DOCS]


@contextlib.contextmanager
def _no_exit():
    try:
        yield
    except SystemExit:
        pass


_HELP: dict[tuple[str, ...], str] = {}


def _help(*command: str) -> str:
    """``mechmon <command> --help``, in process."""
    if command not in _HELP:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), _no_exit():
            cli.main([*command, "--help"])
        _HELP[command] = out.getvalue()
    return _HELP[command]


def _mechmon_commands() -> list[tuple[Path, str, list[str], list[str]]]:
    """(file, code line, command words, flags) of every mechmon invocation in the READMEs."""
    found = []
    for doc in _docs():
        for line in doc.code():
            for m in _MECHMON.finditer(line):
                rest = _END.split(m.group(2), maxsplit=1)[0]
                words = [m.group(1)]
                nxt = rest.split()[:1]
                if words == ["config"] and nxt and not nxt[0].startswith("-"):
                    words.append(nxt[0])
                found.append((doc.path, line, words, _FLAG.findall(rest)))
    return found


def test_every_repository_path_the_readmes_name_exists():
    checked = []
    for doc in _docs():
        candidates = [p for line in doc.code() for p in _PATH.findall(line)]
        candidates += [str((doc.path.parent / link).resolve().relative_to(REPO))
                       for link in doc.links]
        for raw in candidates:
            path = raw.rstrip(".,:;)")
            if "*" in path:
                assert list(REPO.glob(path)), f"{doc.path.name}: {path} matches nothing"
            else:
                assert (REPO / path).exists(), f"{doc.path.name}: {path} does not exist"
            checked.append(path)
    assert {"configs/dry_run.yaml", "configs/dry_run_alarm.yaml", "slurm/megatron_lm.sbatch",
            "tests/integration/test_megatron_lm_real.py"} <= set(checked), sorted(set(checked))


def test_every_mechmon_command_and_flag_the_readmes_write_exists():
    commands = _mechmon_commands()
    for path, line, words, flags in commands:
        assert words[0] in cli.COMMANDS, f"{path.name}: no command 'mechmon {words[0]}': {line}"
        text = _help(*words)
        for flag in flags:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), \
                f"{path.name}: 'mechmon {' '.join(words)} --help' lists no {flag}: {line}"
    seen = {words[0] for _, _, words, _ in commands}
    assert {"demo", "train", "drill", "report", "bench", "config", "scan"} <= seen, seen
    assert sum(len(flags) for *_, flags in commands) >= 15


def test_flags_named_alone_in_a_commands_section_are_that_commands():
    checked = 0
    for doc in _docs():
        for title, _, spans in doc.sections:
            command = SECTION_COMMANDS.get(title)
            if command is None:
                continue
            for span in spans:
                if span.startswith("--"):
                    flag = span.split()[0]
                    assert flag in _help(command), f"{title}: mechmon {command} has no {flag}"
                    checked += 1
    assert checked >= 4


def test_the_launchers_flags_and_the_modules_run_with_m_exist():
    modules, launcher_flags = set(), set()
    for doc in _docs():
        for line in doc.code():
            modules.update(re.findall(r"-m (mechmon_megatron[\w.]*)", line))
            if "mechmon_megatron.launch.megatron" in line:
                before_script = line.split("pretrain_gpt.py")[0]
                launcher_flags.update(_FLAG.findall(before_script))
                if "pretrain_gpt.py" in line:
                    launcher_flags.update(f for f in _FLAG.findall(line) if "mechmon" in f)
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
    assert {"mechmon_megatron", "mechmon_megatron.launch.megatron"} <= modules
    # torchrun's own flags come before the module; the launcher's are --cpu and --mechmon-config.
    ours = {f for f in launcher_flags if f in (launcher.CPU, lm.FLAG)
            or "mechmon" in f}
    assert ours == {launcher.CPU, lm.FLAG}, launcher_flags


def test_the_names_python_blocks_import_from_mechmon_exist():
    imported = 0
    for doc in _docs():
        for line in doc.code():
            m = re.match(r"\s*from (mechmon_megatron[\w.]*) import ([\w, ]+)$", line)
            if m:
                module = importlib.import_module(m.group(1))
                for name in (n.strip() for n in m.group(2).split(",")):
                    assert hasattr(module, name), f"{m.group(1)} has no {name}"
                    imported += 1
            m = re.match(r"\s*import (mechmon_megatron[\w.]*)$", line)
            if m:
                importlib.import_module(m.group(1))
                imported += 1
    assert imported >= 4


@pytest.mark.parametrize("name", ["dry_run", "dry_run_alarm"])
def test_the_dry_run_configs_judge_every_family_within_its_20_iterations(name):
    from mechmon_megatron.config import load_config

    config = load_config(REPO / "configs" / f"{name}.yaml")
    det = config.detectors
    intervals = [config.qk.interval, config.router.interval, config.optim.interval,
                 config.optim.sharpness.interval, config.fp8.interval]
    assert max(intervals) <= 2, intervals
    # Baselines of warmup_samples samples from start_step; the QK update needs one interval more.
    for family in ("attn", "router", "optim", "fp8", "global"):
        first = det.family_start(family) + (det.warmup_samples + 1) * 2
        assert first <= 20, (family, first)
    on_alarm = "checkpoint_and_exit" if name == "dry_run_alarm" else "log"
    assert config.actions.on_alarm == on_alarm


def test_the_megatron_extra_brings_what_megatron_lms_training_loop_imports():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower() for req in extras["megatron"]}
    assert {"megatron-core", "six", "regex"} <= names, names
    readme = " ".join((REPO / "README.md").read_text().split())
    assert 'pip install -e ".[megatron]"' in readme
    # Where mechmon's records go, and that a rerun appends to them (tests/unit/test_sinks.py).
    assert "`mechmon_out/metrics.jsonl` in the working directory" in readme
    assert "**appended** across runs" in readme
