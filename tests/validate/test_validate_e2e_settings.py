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


def test_set_changes_a_dict_entry_and_the_ab_arm_restores_it():
    pytest.importorskip("triton")
    from dsv4.ops.triton import mhc

    before = dict(mhc.CONFIG)
    with e2e.settings_applied(["dsv4.ops.triton.mhc.CONFIG[POST_MIX_FUSED_MAX_T]=0",
                               "dsv4.ops.triton.mhc.CONFIG[MIX_WARPS]=2"]):
        assert mhc.CONFIG["POST_MIX_FUSED_MAX_T"] == 0 and mhc.CONFIG["MIX_WARPS"] == 2
    assert mhc.CONFIG == before
    with pytest.raises(RuntimeError, match="inside"):  # restored when the arm fails too
        with e2e.settings_applied(["dsv4.ops.triton.mhc.CONFIG[MIX_WARPS]=8"]):
            raise RuntimeError("inside")
    assert mhc.CONFIG == before
    label, value, restore = e2e.set_constant("dsv4.ops.triton.mhc.CONFIG[SPLIT]=128")
    assert (label, value, mhc.CONFIG["SPLIT"]) == ("dsv4.ops.triton.mhc.CONFIG[SPLIT]", 128, 128)
    restore()
    assert mhc.CONFIG == before


def test_arms_are_parsed_in_order_checked_early_and_left_unset():
    """``--arm A+B --arm C``: arms _B1 (two settings) and _B2, each item tried and restored at parse time, so a
    misspelt name stops the run before the checkpoint loads, and no arm's value leaks into the defaults."""
    pytest.importorskip("triton")
    from dsv4.ops.triton import mhc

    before = dict(mhc.CONFIG)
    arms = e2e.parse_arms(["dsv4.ops.triton.mhc.CONFIG[MIX_WARPS]=2+dsv4.ops.triton.mhc.CONFIG[SPLIT]=128",
                           "dsv4.ops.triton.mhc.CONFIG[MIX_WARPS]=8"])
    assert arms == {"_B1": ["dsv4.ops.triton.mhc.CONFIG[MIX_WARPS]=2", "dsv4.ops.triton.mhc.CONFIG[SPLIT]=128"],
                    "_B2": ["dsv4.ops.triton.mhc.CONFIG[MIX_WARPS]=8"]}
    assert mhc.CONFIG == before
    with pytest.raises(SystemExit, match="is not a dict with the key 'NOPE'"):
        e2e.parse_arms(["dsv4.ops.triton.mhc.CONFIG[MIX_WARPS]=2+dsv4.ops.triton.mhc.CONFIG[NOPE]=1"])
    assert mhc.CONFIG == before
    with pytest.raises(SystemExit, match="no MODULE.NAME=JSON"):
        e2e.parse_arms(["+"])


@pytest.mark.parametrize("item,message", [
    ("dsv4.ops.triton.mhc.CONFIG[NO_SUCH_KEY]=1", "is not a dict with the key 'NO_SUCH_KEY'"),
    ("dsv4.ops.invariance.DECODE_MAX_ROWS[X]=1", "is not a dict with the key 'X'"),
    ("dsv4.ops.triton.mhc.CONFIG[]=1", "expected MODULE.NAME=JSON"),
])
def test_set_refuses_unknown_keys(item, message):
    pytest.importorskip("triton")
    with pytest.raises(SystemExit, match=message):
        e2e.apply_settings([item])


def test_verify_bench_smoke_on_cpu(tiny_ckpt):
    """``--verify-k --device cpu``: every step time measured, the speedup is tokens per step over the ratio."""
    res = e2e.bench_verify(str(tiny_ckpt), [1, 2], [1, 2], "cpu", "auto", steps=1)
    table = e2e.format_verify(res, [1, 2], [1, 2])
    for B in (1, 2):
        for k in (1, 2):
            ratio = res[f"step_ms_b{B}_k{k}"] / res[f"step_ms_b{B}_k0"]
            assert res[f"speedup_b{B}_k{k}"] == pytest.approx(sum(0.8 ** i for i in range(k + 1)) / ratio)
    assert len(table.splitlines()) == 2 + 4 and table.splitlines()[-1].split()[:2] == ["2", "2"]


def test_greedy_outputs_are_each_prompts_tokens(tiny_ckpt):
    """The arms' token check: every fixed prompt's greedy tokens, in the order added, whole (the final output of
    each request), the same on a second engine."""
    from dsv4.engine.engine import EngineConfig, LLMEngine

    def engine():
        return LLMEngine(EngineConfig(model=str(tiny_ckpt), kv_cache_memory=64 << 20, max_model_len=128,
                                      max_num_seqs=4))

    got = e2e.greedy_outputs(engine(), batch=3, tokens=4, prompt=8)
    assert [len(t) for t in got] == [4, 4, 4] and len({tuple(t) for t in got}) > 1
    assert e2e.greedy_outputs(engine(), batch=3, tokens=4, prompt=8) == got
