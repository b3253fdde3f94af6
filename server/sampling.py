"""Map request fields to engine ``SamplingParams`` with vLLM's default precedence.

Precedence: the request's value, else the model's ``generation_config.json`` default, else the
OpenAI default. Server-side caps (``n``, ``logprobs``, ``top_k``, seeds, token ids) are checked
here so the engine never sees a value that could fail a whole step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams, SamplingParamsError
from server.errors import BadRequestError
from server.protocol import SamplingFields

# Temperatures below this are treated as greedy (like vLLM): dividing logits by a tiny
# temperature overflows float32 and would turn a whole batch's probabilities into NaN.
GREEDY_EPS = 1e-5
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
PENALTY_RANGE = (1e-2, 1e2)  # repetition_penalty bounds that keep logits finite


@dataclass(frozen=True)
class Limits:
    max_n: int
    max_logprobs: int
    vocab_size: int
    max_model_len: int


def build_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    logprobs_param: str,
    defaults: Mapping[str, Any],
    limits: Limits,
) -> SamplingParams:
    """Validate and build the params for one request (``n`` included, split later)."""
    n = 1 if req.n is None else req.n
    if n < 1 or n > limits.max_n:
        raise BadRequestError(f"n must be between 1 and {limits.max_n}, got {n}", "n")
    if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise BadRequestError(
            f"{logprobs_param} must be between 0 and {limits.max_logprobs} (--max-logprobs), "
            f"got {logprobs}", logprobs_param)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequestError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens is not None and max_tokens > limits.max_model_len:
        raise BadRequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {max_tokens} tokens in the completion. Please reduce max_tokens.",
            "max_tokens")
    if req.seed is not None and not INT64_MIN <= req.seed <= INT64_MAX - limits.max_n:
        raise BadRequestError("seed must fit in a signed 64-bit integer", "seed")
    top_k = _pick(req.top_k, defaults, "top_k", 0)
    if top_k is not None and top_k > limits.vocab_size:
        raise BadRequestError(
            f"top_k must be at most the vocabulary size ({limits.vocab_size}), got {top_k}",
            "top_k")
    stop_ids = list(req.stop_token_ids or [])
    bad = [t for t in stop_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise BadRequestError(f"stop_token_ids contains {bad[0]}, outside the vocabulary "
                              f"(0..{limits.vocab_size - 1})", "stop_token_ids")
    rep = req.repetition_penalty
    if rep is not None and rep > 0 and not PENALTY_RANGE[0] <= rep <= PENALTY_RANGE[1]:
        raise BadRequestError(f"repetition_penalty must be in [{PENALTY_RANGE[0]}, "
                              f"{PENALTY_RANGE[1]}], got {rep}", "repetition_penalty")
    if req.logit_bias:
        raise BadRequestError("logit_bias is not supported by this server", "logit_bias")
    temperature = float(_pick(req.temperature, defaults, "temperature", 1.0))
    if 0 <= temperature < GREEDY_EPS:
        temperature = 0.0
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=float(_pick(req.top_p, defaults, "top_p", 1.0)),
            top_k=int(top_k) if top_k is not None else 0,
            min_p=float(_pick(req.min_p, {}, "min_p", 0.0)),
            presence_penalty=float(req.presence_penalty or 0.0),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            repetition_penalty=float(1.0 if rep is None else rep),
            seed=req.seed,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=bool(req.ignore_eos),
            min_tokens=int(req.min_tokens or 0),
            logprobs=logprobs,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False,
            spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
        )
    except SamplingParamsError as exc:
        raise BadRequestError(str(exc), exc.param) from exc


def _pick(value: Any, defaults: Mapping[str, Any], key: str, fallback: Any) -> Any:
    if value is not None:
        return value
    default = defaults.get(key)
    return fallback if default is None else default
