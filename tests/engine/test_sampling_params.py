"""SamplingParams validation: typed errors that name the offending field."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_invalid_values_raise_with_param(kwargs, param) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    err = info.value
    assert err.param == param
    assert isinstance(err, ValueError)
    assert param in str(err)  # the message names the field


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"max_tokens": None},
        {"temperature": 0.0},
        {"temperature": 5.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 0.5},
        {"min_tokens": 4, "max_tokens": 4},
        {"logprobs": 0},
        {"seed": 0},
    ],
)
def test_valid_boundaries_accepted(kwargs) -> None:
    SamplingParams(**kwargs)


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_string_normalised_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.1).needs_penalties
    assert SamplingParams(frequency_penalty=-0.1).needs_penalties
