"""The output processor: detokenizer lifetime, stop strings, per-step token counters."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams


class LetterTokenizer:
    """Token id t renders as one letter; enough to exercise detokenization and stops."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", speculative_config=None,
              max_model_len=128, kv_cache_memory="8MiB")
    llm.engine.tokenizer = LetterTokenizer()
    llm.engine.output.tokenizer = llm.engine.tokenizer
    return llm


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_aborts_release_detokenizers(llm: LLM) -> None:
    engine = llm.engine
    before = dict(engine.counters.finished)
    for i in range(100):
        engine.add_request(f"abort-{i}", [5, 6, 7, 8], greedy(8))
        if i % 2:
            engine.step()  # half of them started generating
        assert engine.abort_request(f"abort-{i}")
    assert not engine.has_unfinished_requests()
    assert len(engine.output) == 0
    assert engine.counters.finished.get("abort", 0) - before.get("abort", 0) == 100


def test_finished_requests_release_detokenizers(llm: LLM) -> None:
    llm.generate([[5, 6, 7], [9, 10]], greedy(5))
    assert len(llm.engine.output) == 0


def test_generation_tokens_counted_every_step(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("count", [5, 6, 7, 8], greedy(6))
    start = engine.counters.generation_tokens
    seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen += out.num_new_tokens
            # counted in the step that produced them, not when the request finishes
            assert engine.counters.generation_tokens - start == seen
    assert seen == 6


def test_stop_string_hides_the_tail(llm: LLM) -> None:
    (ref,) = llm.generate([[5, 17, 33, 99]], greedy(12))
    text = ref.outputs[0].text
    assert len(text) == 12
    k = 4
    stop = text[k]
    first = text.index(stop)  # the stop may appear earlier than k
    (out,) = llm.generate([[5, 17, 33, 99]], greedy(12, stop=[stop]))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == text[:first]
    assert c.token_ids == ref.outputs[0].token_ids[:first + 1]
    (out,) = llm.generate([[5, 17, 33, 99]],
                          greedy(12, stop=[stop], include_stop_str_in_output=True))
    assert out.outputs[0].text == text[:first + 1]
    assert len(llm.engine.output) == 0
