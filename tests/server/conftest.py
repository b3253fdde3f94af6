"""Fixtures shared by the server tests (helpers live in ``srvutil.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread_for_servers() -> Iterator[None]:
    """The 2-core CI machine is shared: one intra-op thread avoids OpenMP hand-off stalls."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
