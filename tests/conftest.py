"""Shared fixtures: synthetic checkpoints in the release format, generated once per test session."""

from __future__ import annotations

import os

import pytest
import worker_memory

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests are dominated by small ops; one intra-op thread avoids OpenMP spin-waiting on a busy
# 2-core machine (measured: the model suite 410 s → 140 s under load, identical results).
os.environ.setdefault("OMP_NUM_THREADS", "1")
worker_memory.keep_large_blocks_in_heap()


def _make(tmp_path_factory, name: str, **kw):
    from dsv4.checkpoint.synthetic import write_checkpoint

    out = tmp_path_factory.mktemp(name)
    return write_checkpoint(out, progress=False, **kw)


@pytest.fixture(scope="session")
def tiny_ckpt_release_vocab(tmp_path_factory):
    """The default tiny preset: SWA, CSA (indexer top-32 of real selections), HCA, hash + scored MoE, MTP,
    with the release's 129,280-token vocabulary (what the tokenizer, chats and grammars need)."""
    return _make(tmp_path_factory, "tiny", preset="tiny")


@pytest.fixture(scope="session")
def tiny_ckpt_small_vocab(tmp_path_factory):
    """The tiny preset with the release tokenizer's first SMALL_VOCAB tokens (``tiny_vocab``)."""
    from tiny_vocab import SMALL_VOCAB

    return _make(tmp_path_factory, "tiny_small_vocab", preset="tiny", overrides={"vocab_size": SMALL_VOCAB})


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_ckpt_release_vocab):
    """The tiny checkpoint of the tests (tests/engine and tests/parallel: ``tiny_ckpt_small_vocab``)."""
    return tiny_ckpt_release_vocab


@pytest.fixture(scope="session")
def tiny_ckpt_select_all(tmp_path_factory):
    """tiny with index_topk=512 ≥ every entry count used in tests: the indexer keeps all visible entries."""
    return _make(tmp_path_factory, "tiny_all", preset="tiny", overrides={"index_topk": 512})


@pytest.fixture(scope="session")
def tiny_ckpt_fp8_experts(tmp_path_factory):
    """tiny in the Base release format: FP8 experts, float32 block scales, no expert_dtype."""
    return _make(tmp_path_factory, "tiny_fp8", preset="tiny", expert_dtype="fp8")


@pytest.fixture(scope="session")
def tiny_dspark_ckpt(tmp_path_factory):
    """tiny-dspark (the 0731 layout: three DSpark stages drafting from layers 1-3, the confidence
    head) with an 8-token vocabulary: drafts and target picks overlap often enough for the
    distribution test, and it is written in about a second."""
    return _make(tmp_path_factory, "tiny_dspark", preset="tiny-dspark",
                 overrides={"vocab_size": 8, "dspark_noise_token_id": 7})


# The session's models are built on ``tiny_ckpt_release_vocab`` by name, never on ``tiny_ckpt``: a session
# fixture is made once, with whichever ``tiny_ckpt`` its first user sees (tests/engine and tests/parallel
# override it), and every later test would get that one.
@pytest.fixture(scope="session")
def tiny_model_auto(tiny_ckpt_release_vocab):
    import torch

    from dsv4.model.cache import CacheNumerics
    from dsv4.model.model import ReferenceModel

    return ReferenceModel(tiny_ckpt_release_vocab, dtype=torch.float32, numerics=CacheNumerics("auto"))


@pytest.fixture(scope="session")
def tiny_model_fp8(tiny_ckpt_release_vocab):
    import torch

    from dsv4.model.cache import CacheNumerics
    from dsv4.model.model import ReferenceModel

    return ReferenceModel(tiny_ckpt_release_vocab, dtype=torch.float32, numerics=CacheNumerics("fp8_ds_mla"))


# ---- memory guard -----------------------------------------------------------------------------
# The suite must pass on a 24 GiB, 2-core machine with two xdist workers and another 6 GiB process
# beside them, so each worker's peak RSS is held under DSV4_TEST_MAX_RSS_GIB (default 6). The test
# during which a worker first crosses the limit fails and names the peak; DSV4_TEST_RSS_LOG=FILE
# appends "worker test peak_MiB grew_MiB current_MiB" for every test (how a build-up is found).
_RSS_LIMIT_MIB = float(os.environ.get("DSV4_TEST_MAX_RSS_GIB", "6")) * 1024
_rss_crossed = False


def _peak_rss_mib() -> float:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 1024)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "teardown":
        return
    global _rss_crossed
    peak = _peak_rss_mib()
    log = os.environ.get("DSV4_TEST_RSS_LOG")
    if log:
        grew = peak - item.stash.get(_RSS_START, peak)
        with open(log, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {item.nodeid} {peak:.0f} {grew:.0f} "
                    f"{worker_memory.current_rss_mib():.0f}\n")
    if peak > _RSS_LIMIT_MIB and not _rss_crossed:
        _rss_crossed = True
        report = outcome.get_result()
        report.outcome = "failed"
        report.longrepr = (f"this pytest worker's peak RSS reached {peak / 1024:.2f} GiB during {item.nodeid}, "
                           f"over the {_RSS_LIMIT_MIB / 1024:.1f} GiB limit (DSV4_TEST_MAX_RSS_GIB)")


_RSS_START = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_RSS_START] = _peak_rss_mib()


@pytest.fixture(autouse=True)
def _return_freed_memory():
    """After a test that left the worker 512 MiB larger than the last clean-up (engines hold a 1 GiB
    CPU KV cache each), collect cycles and hand glibc's freed heap back to the OS: without it a
    worker's RSS grew ~90 MiB per engine built (heap fragmentation: freed, never returned) and
    ~1.5 GiB per engine that waited in a reference cycle for the next full collection (measured: 23
    GiB peak in one worker). A full collection costs ~0.1 s in a loaded worker, hence the threshold."""
    yield
    if worker_memory.current_rss_mib() > worker_memory.settled_mib + 512:
        worker_memory.return_freed_memory()
