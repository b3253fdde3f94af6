import os
import signal

import pytest

# per-test wall-clock limit in seconds (the slowest test here takes ~2 s)
TEST_TIME_LIMIT_S = int(os.environ.get("SPECSERVE_TEST_TIME_LIMIT", "120"))


@pytest.fixture(autouse=True)
def _single_thread(one_torch_thread):
    """Every test in this folder runs with one torch thread (see ``one_torch_thread``)."""
    yield


@pytest.fixture(autouse=True)
def _time_limit():
    """Turn a hang (e.g. ``LLM.generate`` looping on a scheduler that makes no progress) into
    a failure instead of a stuck test run."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded {TEST_TIME_LIMIT_S} s (engine made no progress?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TEST_TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
