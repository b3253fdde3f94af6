"""Tokenization off the event loop: prompts, chat templates, token strings.

The server owns its own tokenizer instance (the engine's is used by the engine thread for
detokenization) and runs encode and template rendering in a one-thread executor, so a
multi-megabyte prompt never blocks the event loop and the Rust tokenizer is never entered
from two threads at once.

Text that is certainly longer than ``max_model_len`` tokens is refused before it is tokenized
(tokenizing 1 MB costs over a second). The bound is sound, not a guess: without a normalizer
(byte-level BPE as in Llama 3, Qwen, SmolLM; SentencePiece byte fallback), each token stands
for a piece of the text no longer than its own vocabulary string (``convert_ids_to_tokens``:
one character per byte for byte-level tokens, and special tokens match their literal text), so
a text of C characters has at least C / L tokens, where L is the longest vocabulary string.
Text longer than ``max_model_len * L`` characters therefore cannot fit. A tokenizer with a
normalizer (which may delete characters) gets no such bound; the body size limit still holds.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from server.errors import BadRequestError
from server.protocol import ChatMessage

T = TypeVar("T")
# apply_chat_template arguments a request may not set through chat_template_kwargs
RESERVED_KWARGS = frozenset({
    "conversation", "tokenize", "add_generation_prompt", "continue_final_message",
    "return_dict", "chat_template", "tools", "documents", "padding", "truncation", "max_length",
    "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class TokenizerService:
    def __init__(self, tokenizer: Any | None, vocab_size: int,
                 max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_text_chars: int | None = None  # longer text cannot fit in max_model_len
        if tokenizer is not None and max_model_len is not None:
            longest = longest_token_chars(tokenizer)
            if longest is not None:
                self.max_text_chars = max_model_len * longest
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-tok")
        self.token_str: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            self._token_str)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # -- prompts ----------------------------------------------------------------------------
    def _require(self, param: str) -> Any:
        if self.tokenizer is None:
            raise BadRequestError("This model has no tokenizer; send token ids", param)
        return self.tokenizer

    def check_text_length(self, text: str, param: str) -> None:
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"the {param} is {len(text)} characters long, which is more than "
                f"{self.max_model_len} tokens for this tokenizer (at most "
                f"{self.max_text_chars // self.max_model_len} characters per token). Please "
                "reduce the length of the prompt.", param)

    async def encode(self, text: str, add_special_tokens: bool = True,
                     param: str = "prompt") -> list[int]:
        self._require(param)
        self.check_text_length(text, param)
        return await self._run(
            lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.check_ids(ids, "tokens")
        self._require("tokens")
        return await self._run(
            lambda: self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequestError(
                f"Token id {bad} is out of vocabulary (valid ids: 0..{self.vocab_size - 1})",
                param)

    # -- chat -------------------------------------------------------------------------------
    async def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        if continue_final_message and add_generation_prompt:
            raise BadRequestError("continue_final_message and add_generation_prompt cannot both "
                                  "be true; set add_generation_prompt to false",
                                  "continue_final_message")
        if continue_final_message and messages[-1].role != "assistant":
            raise BadRequestError("continue_final_message needs a final assistant message",
                                  "continue_final_message")
        if getattr(self._require("messages"), "chat_template", None) is None:
            raise BadRequestError("This model has no chat template; use /v1/completions",
                                  "messages")
        plain = [_plain_message(m, i) for i, m in enumerate(messages)]
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_KWARGS}

        def render() -> str:
            out = self.tokenizer.apply_chat_template(
                plain, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
            return out if isinstance(out, str) else str(out)

        try:
            return await self._run(render)
        except BadRequestError:
            raise
        except Exception as exc:  # jinja errors raised by the template itself
            raise BadRequestError(f"Cannot apply the chat template: {exc}", "messages") from exc

    async def chat_ids(self, messages: Sequence[ChatMessage], **kwargs: Any) -> tuple[str, list[int]]:
        text = await self.render_chat(messages, **kwargs)
        # the template already holds any BOS, so no special tokens are added (like vLLM)
        return text, await self.encode(text, add_special_tokens=False, param="messages")

    # -- token strings ----------------------------------------------------------------------
    def _token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The longest vocabulary string (added tokens included), or None when the tokenizer
    normalizes its input (the text-length bound would not be sound) or cannot say."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    except Exception:  # noqa: BLE001 - no bound rather than no server
        return None
    return max((len(p) for p in pieces if isinstance(p, str)), default=0) or None


def _plain_message(message: ChatMessage, index: int) -> dict[str, str]:
    content = message.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for j, part in enumerate(content):
            if part.type not in ("text", "input_text") or part.text is None:
                raise BadRequestError(
                    f"Only text content parts are supported, got type {part.type!r}",
                    f"messages.{index}.content.{j}")
            parts.append(part.text)
        text = "\n".join(parts)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": text}
