"""``bench/e2e.py --set``: a tuning constant changed for one run (an A/B in one device call), recorded, and a
misspelt name refused instead of set silently."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_e2e", Path(__file__).resolve().parents[2] / "bench" / "e2e.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_set_changes_a_module_constant_and_reports_it(monkeypatch):
    pytest.importorskip("triton")
    from dsv4.ops.triton import sparse_attention as tsa

    monkeypatch.setattr(tsa, "PREDECODE_MIN_T", tsa.PREDECODE_MIN_T)  # restored after the test
    done = e2e.apply_settings(["dsv4.ops.triton.sparse_attention.PREDECODE_MIN_T=2048"])
    assert tsa.PREDECODE_MIN_T == 2048
    assert done == {"dsv4.ops.triton.sparse_attention.PREDECODE_MIN_T": 2048}


@pytest.mark.parametrize("item,message", [
    ("dsv4.ops.invariance.NO_SUCH_CONSTANT=1", "has no attribute NO_SUCH_CONSTANT"),
    ("dsv4.ops.invariance.DECODE_MAX_ROWS", "expected MODULE.NAME=JSON"),
    ("PREDECODE_MIN_T=1", "expected MODULE.NAME=JSON"),
])
def test_set_refuses_unknown_names_and_bad_items(item, message):
    with pytest.raises(SystemExit, match=message):
        e2e.apply_settings([item])
