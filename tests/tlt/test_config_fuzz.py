"""Property-based tests of the config loader: whatever it is given (YAML text, mappings, mutated
presets), load_config returns a TLTConfig or raises ConfigError naming the fields, never anything else."""

from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from workers.tlt.config import PRESETS, ConfigError, TLTConfig, load_config

SECTIONS = list(TLTConfig.model_fields)
FIELDS = {name: list(TLTConfig.model_fields[name].annotation.model_fields) for name in SECTIONS}
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["", "0", "-1", "1e9", "nan", "inf", "yes", "cuda", "jsonl", "hf", "/etc/passwd", "~", "*"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                      max_leaves=12)


def check(data) -> None:
    """The property: a TLTConfig, or a ConfigError whose every entry names a field with a message."""
    try:
        cfg = load_config(data)
    except ConfigError as exc:
        assert exc.errors, "a ConfigError with no field"
        for key, message in exc.errors.items():
            assert isinstance(key, str) and key, exc.errors
            assert isinstance(message, str) and message.strip(), exc.errors
        return
    assert isinstance(cfg, TLTConfig)
    assert load_config(cfg.model_dump(mode="json")) == cfg  # what it accepted round-trips


@FUZZ
@given(st.text(max_size=400))
def test_any_text_is_a_config_or_a_config_error(text):
    check(text)


@FUZZ
@given(st.dictionaries(st.sampled_from(SECTIONS + ["extra"]), values, max_size=4))
def test_any_mapping_of_sections_is_a_config_or_a_config_error(data):
    check(data)


@FUZZ
@given(st.sampled_from(sorted(PRESETS)), st.lists(st.tuples(st.sampled_from(SECTIONS), st.data()), min_size=1, max_size=4))
def test_a_preset_with_fields_set_to_anything_is_a_config_or_an_error_naming_them(name, edits):
    data = copy.deepcopy(PRESETS[name])
    touched = set()
    for section, draw in edits:
        field = draw.draw(st.one_of(st.sampled_from(FIELDS[section]), st.text(min_size=1, max_size=8)))
        data.setdefault(section, {})[field] = draw.draw(values)
        touched.add(section)
    try:
        load_config(data)
    except ConfigError as exc:
        # every error is about a section we changed (or the whole config)
        assert all(key.split(".")[0] in touched | {"config"} for key in exc.errors), (exc.errors, touched)
    check(data)


@FUZZ
@given(values)
def test_yaml_of_any_value_is_a_config_or_a_config_error(value):
    check(yaml.safe_dump(value))


@pytest.mark.parametrize("text", ["a: &a [*a]", "!!python/object:os.system {}", "run: {steps: 1e999}", "\x00",
                                  "run:\n  steps: !!binary AAAA", "run: {steps: 2, steps: 3}", "- run"])
def test_hostile_yaml_is_a_config_error(text):
    check(text)


@pytest.mark.parametrize("text", ["[" * 5000, "{" * 5000 + "}" * 5000, "{a: " * 3000])
def test_deeply_nested_yaml_is_a_config_error(text):
    with pytest.raises(ConfigError) as err:
        load_config(text)
    assert "yaml" in err.value.errors
