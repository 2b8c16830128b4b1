"""SpeculativeConfig: vLLM's names and n-gram defaults, and a ValueError naming the bad field and
the allowed values for every bad input, from a dict, a JSON string or the constructor."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from sluice.spec_decode.config import SpeculativeConfig


def test_none_and_json_null_mean_no_speculation() -> None:
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict("null") is None


def test_ngram_from_dict_and_from_json_are_equal() -> None:
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    config = SpeculativeConfig.from_dict(spec)
    assert config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4
    )
    assert SpeculativeConfig.from_dict(json.dumps(spec)) == config
    assert config is not None and config.model is None


def test_an_existing_config_passes_through() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert SpeculativeConfig.from_dict(config) is config


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, (5, 5)),
        ({"prompt_lookup_max": 3}, (3, 3)),
        ({"prompt_lookup_min": 2}, (2, 2)),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": 7}, (1, 7)),
    ],
)
def test_ngram_lookup_defaults_follow_vllm(
    given: dict[str, int], expected: tuple[int, int]
) -> None:
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, **given})
    assert config is not None
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_model_methods_keep_the_model_path(method: str, tmp_path: Path) -> None:
    config = SpeculativeConfig.from_dict(
        {"method": method, "num_speculative_tokens": 2, "model": "/models/draft"}
    )
    assert config is not None
    assert (config.method, config.num_speculative_tokens, config.model) == (
        method,
        2,
        "/models/draft",
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (None, None)
    from_path = SpeculativeConfig(method=method, num_speculative_tokens=1, model=tmp_path)  # type: ignore[arg-type]
    assert from_path.model == str(tmp_path)


def test_drafting_policy_defaults_and_explicit_values() -> None:
    """Unset: off from batch 2, off below 1.25 accepted tokens per step, a probe every 2 steps
    (n-gram) or 16 (a model proposer, whose probe drafts); None and 0 turn either rule off; a
    threshold is a float."""
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert config is not None
    assert (config.disable_by_batch_size, config.min_accepted_tokens_per_step,
            config.probe_interval) == (2, 1.25, 2)
    config = SpeculativeConfig.from_dict(
        '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": null, '
        '"min_accepted_tokens_per_step": 0, "probe_interval": 16}')
    assert config is not None
    assert (config.disable_by_batch_size, config.min_accepted_tokens_per_step,
            config.probe_interval) == (None, 0.0, 16)
    assert isinstance(config.min_accepted_tokens_per_step, float)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=64,
                               min_accepted_tokens_per_step=4)
    assert (config.disable_by_batch_size, config.min_accepted_tokens_per_step) == (64, 4.0)
    draft = SpeculativeConfig(method="eagle", num_speculative_tokens=2, model="/models/eagle")
    assert draft.probe_interval == 16
    # k = 1 cannot accept 1.25 tokens a step: the default threshold is then every draft.
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=1)
    assert config.min_accepted_tokens_per_step == 1.0


def test_config_is_frozen() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_speculative_tokens = 3  # type: ignore[misc]


NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"method": "medusa", "num_speculative_tokens": 2},
            "speculative_config.method must be one of 'ngram', 'draft_model', 'eagle', "
            "got 'medusa'",
        ),
        (
            {"num_speculative_tokens": 2},
            "speculative_config.method is required: one of 'ngram', 'draft_model', 'eagle'",
        ),
        (
            {"method": "ngram"},
            "speculative_config.num_speculative_tokens is required: an integer >= 1",
        ),
        (
            {**NGRAM, "num_speculative_token": 3, "lookup": 1},
            "speculative_config has unknown key(s) 'num_speculative_token', 'lookup'; "
            "allowed keys: 'method', 'num_speculative_tokens', 'model', 'prompt_lookup_min', "
            "'prompt_lookup_max', 'disable_by_batch_size', 'min_accepted_tokens_per_step', "
            "'probe_interval'",
        ),
        (
            {**NGRAM, "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens must be an integer >= 1, got 0",
        ),
        (
            {**NGRAM, "num_speculative_tokens": -2},
            "speculative_config.num_speculative_tokens must be an integer >= 1, got -2",
        ),
        (
            {**NGRAM, "num_speculative_tokens": 2.0},
            "speculative_config.num_speculative_tokens must be an integer >= 1, got 2.0",
        ),
        (
            {**NGRAM, "num_speculative_tokens": "3"},
            "speculative_config.num_speculative_tokens must be an integer >= 1, got '3'",
        ),
        (
            {**NGRAM, "num_speculative_tokens": True},
            "speculative_config.num_speculative_tokens must be an integer >= 1, got True",
        ),
        (
            {**NGRAM, "prompt_lookup_min": 0, "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_min must be an integer >= 1, got 0",
        ),
        (
            {**NGRAM, "prompt_lookup_max": 0},
            "speculative_config.prompt_lookup_max must be an integer >= 1, got 0",
        ),
        (
            {**NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": -1},
            "speculative_config.prompt_lookup_max must be an integer >= 1, got -1",
        ),
        (
            {**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min must be <= prompt_lookup_max, "
            "got prompt_lookup_min=4, prompt_lookup_max=2",
        ),
        (
            {**NGRAM, "model": "/models/draft"},
            "speculative_config.model is not allowed for method 'ngram' "
            "(it drafts from the sequence itself), got '/models/draft'",
        ),
        (
            {"method": "draft_model", "num_speculative_tokens": 2},
            "speculative_config.model is required for method 'draft_model': "
            "the path of a model folder, got None",
        ),
        (
            {"method": "eagle", "num_speculative_tokens": 2, "model": ""},
            "speculative_config.model is required for method 'eagle': "
            "the path of a model folder, got ''",
        ),
        (
            {"method": "eagle", "num_speculative_tokens": 2, "model": 3},
            "speculative_config.model is required for method 'eagle': "
            "the path of a model folder, got 3",
        ),
        (
            {"method": "eagle", "num_speculative_tokens": 2, "model": "/h", "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_max applies only to method 'ngram', "
            "got 3 with method 'eagle'",
        ),
        (
            {**NGRAM, "disable_by_batch_size": 1},
            "speculative_config.disable_by_batch_size must be an integer >= 2 (drafting stops "
            "while that many requests run) or None (never), got 1",
        ),
        (
            {**NGRAM, "disable_by_batch_size": 8.0},
            "speculative_config.disable_by_batch_size must be an integer >= 2 (drafting stops "
            "while that many requests run) or None (never), got 8.0",
        ),
        (
            {**NGRAM, "disable_by_batch_size": True},
            "speculative_config.disable_by_batch_size must be an integer >= 2 (drafting stops "
            "while that many requests run) or None (never), got True",
        ),
        (
            {**NGRAM, "min_accepted_tokens_per_step": -0.5},
            "speculative_config.min_accepted_tokens_per_step must be a number in "
            "[0, num_speculative_tokens=2], got -0.5",
        ),
        (
            {**NGRAM, "min_accepted_tokens_per_step": 2.5},
            "speculative_config.min_accepted_tokens_per_step must be a number in "
            "[0, num_speculative_tokens=2], got 2.5",
        ),
        (
            {**NGRAM, "min_accepted_tokens_per_step": "1"},
            "speculative_config.min_accepted_tokens_per_step must be a number in "
            "[0, num_speculative_tokens=2], got '1'",
        ),
        (
            {**NGRAM, "min_accepted_tokens_per_step": float("nan")},
            "speculative_config.min_accepted_tokens_per_step must be a number in "
            "[0, num_speculative_tokens=2], got nan",
        ),
        (
            {**NGRAM, "probe_interval": 0},
            "speculative_config.probe_interval must be an integer >= 1, got 0",
        ),
    ],
)
def test_bad_fields_are_value_errors_naming_field_and_allowed_values(
    spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as from_dict_error:
        SpeculativeConfig.from_dict(spec)
    assert str(from_dict_error.value) == message
    # The same message through the CLI's JSON.
    with pytest.raises(ValueError) as from_json_error:
        SpeculativeConfig.from_dict(json.dumps(spec))
    assert str(from_json_error.value) == message


def test_constructor_validates_like_from_dict() -> None:
    with pytest.raises(ValueError, match="must be an integer >= 1, got 0"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="must be one of 'ngram', 'draft_model', 'eagle'"):
        SpeculativeConfig(method="Ngram", num_speculative_tokens=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{method: ngram}", r"speculative_config is not valid JSON \(Expecting property name"),
        ('["ngram", 3]', r"must be a dict, a JSON object string or None, got list: \['ngram', 3\]"),
        ("3", "must be a dict, a JSON object string or None, got int: 3"),
        (["ngram"], r"must be a dict, a JSON object string or None, got list: \['ngram'\]"),
    ],
)
def test_spec_that_is_not_an_object_is_a_value_error(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(spec)
