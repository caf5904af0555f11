"""Fixtures for tests/serve: real uvicorn servers on 127.0.0.1 over the tiny checkpoint.

The tiny model's weights are loaded once per session (``serve_model``); each test module builds
its own LLMEngine on them and its own server (module scope), so every module starts from an empty
KV cache and a fresh engine. Server dependencies are optional (``pip install -e .[serve]``): each
test module skips itself when they are missing.
"""

from __future__ import annotations

import pytest
from serve_test_support import make_engine


@pytest.fixture(scope="session")
def serve_model(tiny_ckpt):
    import torch

    from dsv4.model.cache import CacheNumerics
    from dsv4.model.model import ReferenceModel

    return ReferenceModel(tiny_ckpt, dtype=torch.float32, numerics=CacheNumerics("fp8_ds_mla"))


@pytest.fixture(scope="module")
def real_server(tiny_ckpt, serve_model):
    """The tiny model behind the OpenAI API, served as "tiny"."""
    from serve_test_support import ServerThread

    from dsv4.serve import build_app

    app = build_app(make_engine(tiny_ckpt, serve_model), served_model_name="tiny")
    with ServerThread(app) as srv:
        yield srv
