import pytest


@pytest.fixture(autouse=True)
def _single_thread(one_torch_thread):
    """Every test in this folder runs with one torch thread (see ``one_torch_thread``)."""
    yield
