"""Property tests of the strict loaders: any input loads or raises one short ``ValueError``.

The mechmon config (:func:`load_config`), the trainer config (:func:`load_train_config`) and
the drill campaign (:func:`load_campaign`) are fed random YAML-able data (nested mappings,
lists and scalars, with keys drawn mostly from the real schema so that deep fields are
reached), valid configs with one leaf replaced, and random text as a file. Whatever comes in,
the loader returns a config or raises a ``ValueError`` whose message is one line, starts with
the loader's root and a dotted path, and stays short: a "billion laughs" YAML alias bomb of
a few hundred bytes once produced a 52 MB message.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mechmon_megatron.config import MechMonConfig, load_config
from mechmon_megatron.drill import load_campaign
from mechmon_megatron.train.train_config import load_train_config

MAX_MESSAGE = 600
"""Longest message any bad input may produce (a dotted path, a cut value, the allowed set)."""

FAST = settings(max_examples=40, deadline=2000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _keys(data: Any, out: set[str]) -> set[str]:
    if isinstance(data, dict):
        for key, value in data.items():
            out.add(str(key))
            _keys(value, out)
    elif isinstance(data, list):
        for value in data:
            _keys(value, out)
    return out


MECHMON = MechMonConfig().to_dict()
CAMPAIGN = yaml.safe_load(
    "name: t\nsteps: 20\nseeds: [1]\nmodels: {m: {num_layers: 1}}\n"
    "faults: [{name: f, class: lr, model: m, onset: 10, lr: {lr_multiplier: 10}}]\n")
KNOWN = sorted(_keys(MECHMON, set()) | _keys(CAMPAIGN, set())
               | {"preset", "mechmon", "model", "optim", "data", "fault", "parallel", "attention",
                  "lr_multiplier", "compound", "control", "dense", "signals", "bounds"})

scalars = (st.none() | st.booleans() | st.integers(-10**12, 10**12)
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12) | st.sampled_from(["all", "dense", "moe", ".inf", "nan", "1e9",
                                                     "attn/**", "down", "lr", "log"]))
keys = st.sampled_from(KNOWN) | st.text(max_size=10) | st.integers(-3, 3)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(keys, inner, max_size=4), max_leaves=20)


@st.composite
def mutated(draw: Any, base: dict[str, Any]) -> Any:
    """``base`` (a valid config) with one leaf or subtree, found by a random walk, replaced."""
    data = yaml.safe_load(yaml.safe_dump(base))
    node = data
    for _ in range(draw(st.integers(0, 5))):
        children = (list(node.items()) if isinstance(node, dict)
                    else list(enumerate(node)) if isinstance(node, list) else [])
        inner = [(k, v) for k, v in children if isinstance(v, (dict, list)) and v]
        if not inner:
            break
        _, node = draw(st.sampled_from(inner))
    if isinstance(node, dict) and node:
        node[draw(st.sampled_from(sorted(node, key=str)) | keys)] = draw(values)
    elif isinstance(node, list) and node:
        node[draw(st.integers(0, len(node) - 1))] = draw(values)
    return data


def _floats(data: Any) -> list[float]:
    if dataclasses.is_dataclass(data):
        data = dataclasses.asdict(data)
    if isinstance(data, dict):
        return [f for v in data.values() for f in _floats(v)]
    if isinstance(data, (list, tuple)):
        return [f for v in data for f in _floats(v)]
    return [data] if isinstance(data, float) else []


def _check(load: Any, source: Any, root: str) -> None:
    try:
        loaded = load(source)
        # What loads holds no NaN or infinity (either would switch a rule off unsaid).
        assert all(math.isfinite(f) for f in _floats(loaded)), source
    except ValueError as exc:
        message = str(exc)
        assert len(message) <= MAX_MESSAGE, message[:2000]
        assert "\n" not in message, message
        assert re.match(rf"{root}([.\[(:]|\Z)", message), message
        assert type(exc).__name__ in ("ValueError", "_FieldError", "_Mismatch"), type(exc)


@FAST
@given(st.one_of(values, mutated(MECHMON)))
@example({"detectors": {"attn": {"robust_z": {"threshold": float("inf")}}}})
@example({"detectors": {"false_alarms_per_10k_steps": "nan"}})
def test_any_mechmon_config_loads_or_raises_one_short_error_naming_a_field(data):
    _check(load_config, data, "mechmon")


@FAST
@given(st.one_of(values, mutated({"steps": 10, "model": {"num_layers": 1}, "mechmon": MECHMON})))
def test_any_trainer_config_loads_or_raises_one_short_error_naming_a_field(data):
    _check(load_train_config, data, "(train|mechmon)")


@FAST
@given(st.one_of(values, mutated(CAMPAIGN)))
@example(dict(CAMPAIGN, models=["a", "b"]))
def test_any_campaign_loads_or_raises_one_short_error_naming_a_field(data):
    _check(load_campaign, data, "campaign")


@FAST
@given(text=st.text(max_size=200) | st.builds(
    lambda d: yaml.safe_dump(d, default_flow_style=None), values))
def test_any_file_text_loads_or_raises_one_short_error_naming_the_file(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text, encoding="utf-8")
    for load, root in ((load_config, "mechmon"), (load_campaign, "campaign"),
                       (load_train_config, "(train|mechmon)")):
        _check(load, str(path), root)


BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
qk: {layers: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]}
"""


@pytest.mark.parametrize("load", [load_config, load_campaign, load_train_config])
def test_a_yaml_alias_bomb_is_refused_at_once_with_a_short_message(tmp_path, load):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    tick = time.perf_counter()
    with pytest.raises(ValueError, match=r"bomb\.yaml: invalid YAML: its aliases expand to "
                       r"more than 100,000 values") as err:
        load(str(path))
    assert time.perf_counter() - tick < 1.0
    assert len(str(err.value)) < 300


def test_an_alias_bomb_given_as_data_gives_a_short_message():
    level: Any = ["lol"] * 9
    for _ in range(8):
        level = [level] * 9  # 9^9 leaves, shared: what safe_load builds from the bomb
    with pytest.raises(ValueError, match=r"mechmon\.qk\.layers: invalid value") as err:
        load_config({"qk": {"layers": level}})
    assert len(str(err.value)) < 300


def test_a_self_referencing_alias_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("qk:\n  layers: &a [1, *a]\n")
    with pytest.raises(ValueError, match=r"loop\.yaml, line 2, column 11: invalid YAML: an "
                       "alias refers to the node that contains it"):
        load_config(str(path))


@pytest.mark.parametrize(("text", "where"), [
    ("qk:\n  interval: [1\n", r"line 3, column 1: invalid YAML: while parsing a flow sequence"),
    ("qk: {interval: 1\n", r"line 2, column 1: invalid YAML: while parsing a flow mapping"),
    ("qk:\n\tinterval: 1\n", r"line 2, column 1: invalid YAML: .*found character"),
    ("a: b: c\n", r"line 1, column 5: invalid YAML: mapping values are not allowed here"),
])
def test_a_yaml_syntax_error_is_one_value_error_naming_file_line_and_column(tmp_path, text,
                                                                           where):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    for load, root in ((load_config, "mechmon"), (load_campaign, "campaign"),
                       (load_train_config, "train")):
        with pytest.raises(ValueError, match=rf"^{root}: .*cfg\.yaml, {where}") as err:
            load(str(path))
        assert "\n" not in str(err.value)
