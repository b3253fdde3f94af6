"""Request schemas (pydantic) for the OpenAI-compatible and vLLM-extra endpoints.

Unknown fields are ignored (like vLLM); NaN and infinities are rejected everywhere, because a
single non-finite sampling value could poison an engine step shared by every request. Types
are strict, as in the OpenAI API: ``"stream": "yes"``, ``"max_tokens": "10"`` or
``"seed": "42"`` are 400s, not coerced (an integer is still a valid float).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

TokenIds = list[StrictInt]
Prompt = str | list[str] | TokenIds | list[TokenIds]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=(),
                              strict=True)


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(_Base):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM sampling extensions (OpenAI SDK users pass them via extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    return_token_ids: bool | None = False  # adds prompt_token_ids / token_ids to choices


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Base):
    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Base):
    """Either ``prompt`` (completion style) or ``messages`` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: TokenIds
