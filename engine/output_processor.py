"""Everything between the scheduler's token lists and a caller's ``RequestOutput``.

The scheduler owns what was computed (``Request.output_token_ids``, lengths, blocks); this
module owns what the caller sees: incremental detokenization, stop strings (which hide the
tokens after the stop), output assembly and the output counters. It never changes a
``Request``'s token lists or queues: a stop string found here is reported back to the engine,
which finishes the request in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0  # every token appended by a step, counted in that step
    finished: dict[str, int] = field(default_factory=dict)


@dataclass
class StopHit:
    stop: str


@dataclass
class _OutputState:
    detok: IncrementalDetokenizer | None
    visible: int | None = None  # output tokens the caller sees (None: all of them)
    finish_reason: str | None = None  # set when a stop string ended the request
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.counters = EngineCounters()
        self._states: dict[str, _OutputState] = {}

    def __len__(self) -> int:
        """Requests whose output state is held (detokenizer included)."""
        return len(self._states)

    def add(self, req: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer,
                                           skip_special_tokens=req.params.skip_special_tokens)
        self._states[req.request_id] = _OutputState(detok)

    # -- per step ---------------------------------------------------------------------------
    def on_tokens(self, req: Request, new: list[int], now: float) -> StopHit | None:
        """Account for the tokens one step appended to ``req``; detokenize them and look for
        a stop string. On a hit the tokens after the stop are hidden from the output and the
        hit is returned (the caller finishes the request if the scheduler has not)."""
        if req.first_token_time is None:
            req.first_token_time = now
            self.counters.prompt_tokens += req.num_prompt_tokens
        req.last_token_time = now
        self.counters.generation_tokens += len(new)
        state = self._states.get(req.request_id)
        if state is None or state.detok is None or state.visible is not None:
            return None
        detok = state.detok
        base = req.num_output_tokens - len(new)
        stops = req.params.stop
        for j, tok in enumerate(new):
            delta = detok.append(tok)
            if not stops or not delta:
                continue
            window = max(len(s) for s in stops) + len(delta)
            hit = _find_stop(detok.text, stops, max(0, len(detok.text) - window))
            if hit is None:
                continue
            pos, stop = hit
            detok.text = detok.text[: pos + len(stop) if req.params.include_stop_str_in_output
                                    else pos]
            state.visible = base + j + 1
            state.finish_reason, state.stop_reason = "stop", stop
            return StopHit(stop)
        return None

    def finish(self, req: Request) -> None:
        """``req`` finished (or was aborted): count it and drop its state."""
        state = self._states.pop(req.request_id, None)
        reason = (state.finish_reason if state is not None and state.finish_reason
                  else req.finish_reason) or "abort"
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1

    # -- assembly ---------------------------------------------------------------------------
    def make_output(self, req: Request, num_new: int = 0,
                    state: _OutputState | None = None) -> RequestOutput:
        if state is None:
            state = self._states.get(req.request_id)
        text = ""
        finish_reason, stop_reason = req.finish_reason, req.stop_reason
        tokens, logprobs_all = req.output_token_ids, req.output_logprobs
        if state is not None:
            if state.detok is not None:
                text = state.detok.text
                if not req.is_finished and req.params.stop:
                    hold = max(len(s) for s in req.params.stop) - 1
                    text = text[: max(0, len(text) - hold)]
            if state.visible is not None:
                tokens, logprobs_all = tokens[: state.visible], logprobs_all[: state.visible]
            if state.finish_reason is not None and req.is_finished:
                finish_reason, stop_reason = state.finish_reason, state.stop_reason
        logprobs = list(logprobs_all) if req.params.logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=sum(lp.logprob for lp in logprobs) if logprobs else None,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.is_finished,
            num_new_tokens=num_new,
            metrics={
                "arrival_time": req.arrival_time,
                "first_scheduled_time": req.first_scheduled_time,
                "first_token_time": req.first_token_time,
                "last_token_time": req.last_token_time,
                "num_preemptions": req.num_preemptions,
            },
        )

    def finished_output(self, req: Request, num_new: int = 0) -> RequestOutput:
        """The final output of a finished ``req``; its state is dropped and counted."""
        state = self._states.get(req.request_id)
        out = self.make_output(req, num_new, state)
        self.finish(req)
        return out


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best
