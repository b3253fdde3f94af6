"""Value types shared by the async engine bridge and the HTTP layer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import APIError, InternalServerError

if TYPE_CHECKING:
    from engine.engine import LLMEngine


class EngineDeadError(InternalServerError):
    """The engine loop failed; the server cannot generate any more."""


@dataclass(frozen=True)
class SubRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass(frozen=True)
class OutputEvent:
    index: int
    output: RequestOutput


@dataclass(frozen=True)
class AbortedEvent:
    index: int


@dataclass(frozen=True)
class FailedEvent:
    error: APIError


Event = OutputEvent | AbortedEvent | FailedEvent


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges and cumulative counters, copied by the loop thread after each step."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    steps_by_k: tuple[int, ...] = ()  # sampling steps that verified k = 0..K drafts
    num_blocks: int = 0

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSnapshot:
        c, s = engine.counters, engine.spec_stats
        return cls(
            running=engine.num_running, waiting=engine.num_waiting, kv_usage=engine.kv_usage,
            num_preemptions=engine.num_preemptions, prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens, finished=dict(c.finished),
            num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
            num_accepted_tokens=s.num_accepted_tokens,
            accepted_per_pos=tuple(s.num_accepted_tokens_per_pos),
            steps_by_k=tuple(s.num_steps_by_k),
            num_blocks=int(engine.startup_info.get("num_blocks", 0)),
        )


class EngineObserver(Protocol):
    """Called on the loop thread (metrics, stats logging); exceptions are logged, not fatal."""

    def on_outputs(self, outputs: Sequence[RequestOutput], now: float) -> None: ...

    def on_aborted(self, request_ids: Sequence[str]) -> None: ...

    def on_tick(self, snapshot: EngineSnapshot, now: float) -> None: ...


class RequestStream:
    """Events for one HTTP request (all its engine requests); read on the event loop."""

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = tuple(request_ids)
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._done: set[int] = set()
        self.failed = False

    @property
    def finished(self) -> bool:
        return self.failed or len(self._done) == len(self.request_ids)

    def put(self, event: Event) -> None:
        if isinstance(event, OutputEvent) and event.output.finished or isinstance(
                event, AbortedEvent):
            self._done.add(event.index)
        elif isinstance(event, FailedEvent):
            self.failed = True
        self._queue.put_nowait(event)

    async def next_events(self) -> list[Event]:
        """Wait for events; cumulative outputs of one index are merged into the latest."""
        batch = [await self._queue.get()]
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        merged: list[Event] = []
        slot: dict[int, int] = {}
        for ev in batch:
            if isinstance(ev, OutputEvent) and ev.index in slot:
                merged[slot[ev.index]] = ev
                continue
            if isinstance(ev, OutputEvent):
                slot[ev.index] = len(merged)
            merged.append(ev)
        return merged
