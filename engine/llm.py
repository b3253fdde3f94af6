"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.args import EngineArgs
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec.stats import SpecDecodingStats

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        self.engine_config = EngineArgs.from_kwargs(**kwargs).create_engine_config()
        self.engine = LLMEngine(self.engine_config)

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an already resolved config (e.g. one changed by ``dataclasses.replace``)."""
        llm = cls.__new__(cls)
        llm.engine_config = config
        llm.engine = LLMEngine(config)
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or
        ``{"prompt_token_ids": [...]}``); returns one output per prompt, in order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            list(sampling_params) if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(
                f"Got {len(params_list)} sampling params for {len(prompts)} prompts"
            )
        engine = self.engine
        tokenized = [self._tokenize(prompt) for prompt in prompts]
        batch: list[tuple[str, list[int], SamplingParams, str | None]] = []
        order: list[tuple[str, list[str]]] = []
        for (text, ids), params in zip(tokenized, params_list):
            sub_ids = []
            for sub in params.split():
                rid = engine.new_request_id()
                batch.append((rid, ids, sub, text))
                sub_ids.append(rid)
            order.append((sub_ids[0], sub_ids))
        engine.add_requests(batch)  # all or nothing: an invalid prompt queues none
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        results = []
        for first, subs in order:
            head = finished[first]
            completions = []
            for i, rid in enumerate(subs):
                c = finished[rid].outputs[0]
                c.index = i
                completions.append(c)
            head.outputs = completions
            results.append(head)
        return results

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            tok = self.engine.tokenizer
            if tok is None:
                raise ValueError("This model has no tokenizer; pass token ids")
            return prompt, tok.encode(prompt)
        return None, list(prompt)

    def get_spec_decoding_stats(self) -> SpecDecodingStats:
        return self.engine.spec_stats

