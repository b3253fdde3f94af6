"""The pure parts of ``scripts/attack_check.py``: what counts as a failure."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "attack_check.py"


@pytest.fixture(scope="module")
def ac() -> ModuleType:
    spec = importlib.util.spec_from_file_location("attack_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["attack_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def err(status: int) -> bytes:
    return json.dumps({"error": {"message": "m", "type": "T", "param": None,
                                 "code": status}}).encode()


def test_error_shape(ac: ModuleType) -> None:
    assert ac.error_problem(400, "application/json", err(400)) is None
    assert ac.error_problem(503, "text/plain; charset=utf-8", b"Service Unavailable")
    assert ac.error_problem(400, "application/json", b"{not json")
    assert ac.error_problem(400, "application/json", b'{"detail": "x"}')
    assert ac.error_problem(404, "application/json", err(400))  # code must be the status


def test_only_json_503s_with_retry_after_are_intended(ac: ModuleType) -> None:
    t = ac.Tally()
    t.record("p", "ok", 503, {"content-type": "application/json", "retry-after": "1"}, err(503))
    assert t.failures() == {} and t.counts["p"]["intended_503"] == 1
    t.record("p", "no retry", 503, {"content-type": "application/json"}, err(503))
    t.record("p", "text", 503, {"content-type": "text/plain"}, b"Service Unavailable")
    t.record("p", "500", 500, {"content-type": "application/json"}, err(500))
    t.record("p", "wrong", 200, {}, b"{}", {400})
    t.record("p", "head", 401, {}, None, {401})  # no body to check
    assert t.failures() == {"unexpected_5xx": 3, "non_json_error": 1, "wrong_status": 1}


def test_string_paths_and_replaced(ac: ModuleType) -> None:
    body = {"model": "m", "n": 1, "messages": [{"role": "user", "content": ["a", {"text": "b"}]}]}
    paths = list(ac.string_paths(body))
    assert paths == [("model",), ("messages", 0, "role"), ("messages", 0, "content", 0),
                     ("messages", 0, "content", 1, "text")]
    new = ac.replaced(body, ("messages", 0, "content", 1, "text"), "\ud800")
    assert new["messages"][0]["content"][1]["text"] == "\ud800"
    assert body["messages"][0]["content"][1]["text"] == "b"  # a copy


def test_parsers(ac: ModuleType) -> None:
    text = ('# HELP x\nvllm:kv_cache_usage_perc{model_name="m"} 0.0\n'
            'vllm:num_requests_running{model_name="m"} 2.0\n'
            'vllm:num_requests_running{model_name="n"} 1.0\n')
    assert ac.parse_metrics(text) == {"vllm:kv_cache_usage_perc": 0.0,
                                      "vllm:num_requests_running": 3.0}
    events, done = ac.parse_sse('data: {"a": 1}\n\ndata: [DONE]\n\n')
    assert events == [{"a": 1}, "[DONE]"] and done
    assert ac.parse_sse('data: {"a": 1}\n\n') == ([{"a": 1}], False)


def test_a_5xx_a_case_expects_must_still_be_json(ac: ModuleType) -> None:
    t = ac.Tally()
    t.record("timeout", "504", 504, {"content-type": "application/json"}, err(504), {504})
    assert t.failures() == {}
    t.record("timeout", "504 text", 504, {"content-type": "text/plain"}, b"Gateway Timeout",
             {504})
    t.record("timeout", "504 unasked", 504, {"content-type": "application/json"}, err(504),
             {200})
    assert t.failures() == {"non_json_error": 1, "unexpected_5xx": 2, "wrong_status": 1}


def test_sse_outcome(ac: ModuleType) -> None:
    finished = ('data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
                'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\n'
                'data: [DONE]\n\n')
    assert ac.sse_outcome(ac.parse_sse(finished)[0]) == (["length"], [])
    aborted = ('data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
               'data: {"error": {"message": "m", "type": "T", "param": null, "code": 503}}\n\n'
               'data: [DONE]\n\n')
    assert ac.sse_outcome(ac.parse_sse(aborted)[0]) == ([], [503])


def test_sigterm_must_be_the_last_phase(ac: ModuleType) -> None:
    with pytest.raises(SystemExit, match="last phase"):
        ac.main(["--port", "1", "--phases", "sigterm,soak"])
    with pytest.raises(SystemExit, match="unknown phases"):
        ac.main(["--port", "1", "--phases", "soak,nap"])
