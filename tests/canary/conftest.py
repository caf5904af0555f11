"""Fixtures for the canary tests: the embedded model, its recorded accuracy, held-out subsets."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dsv4.canary import default_model_dir
from dsv4.canary.tasks import heldout


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread: the engine's CPU steps are many small ops (see tests/engine/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("DSV4_ENGINE_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def canary_dir() -> str:
    return default_model_dir()


@pytest.fixture(scope="session")
def canary_info(canary_dir) -> dict:
    with open(os.path.join(canary_dir, "canary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def held(canary_info):
    """The held-out set exactly as canary.json recorded it."""
    h = canary_info["heldout"]
    return heldout(h["per_task"], recall_per_task=h["recall"])
