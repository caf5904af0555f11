"""The token-level verdict on hand-written sequences: the seed's failures FAIL, ordinary output PASSes."""

from __future__ import annotations

import pytest

from dsv4.validate.verdict import VerdictConfig, find_loop, judge_tokens, longest_run

BOS, EOS = 0, 1
HEALTHY = [223, 30594, 9790, 303, 70037, 12203, 10706, 804, 1175, 10539, 637, 53897, 96240, 2996, 84998, 666,
           3118, 637, 58368, 621, 666, 77, 53091, 4374, 1465, 223, 1959, 17585, 42108, 303, 56463, 10162]


def test_the_seeds_coherent_32_token_answer_passes():
    v = judge_tokens(HEALTHY, finish_reason="length", max_tokens=32, ignore_eos=True)
    assert v.ok, v.summary()


def test_token_then_bos_forever_fails():
    """J08: TOKEN_IDS [32, 0, 0, …] — OUTPUT_REPR is just '>', which a text check passes."""
    ids = [32] + [BOS] * 31
    v = judge_tokens(ids, finish_reason="length", max_tokens=32, ignore_eos=True)
    assert not v.ok
    assert "BOS (id 0) after the first token" in v.problems[0]
    assert "[1, 2, 3, 4, 5, 6, 7, 8, …]" in v.problems[0]


def test_single_gt_sign_is_not_a_pass():
    """The lone '>' the weak check accepted: one token where 32 were asked for with ignore_eos."""
    v = judge_tokens([32], finish_reason="length", max_tokens=32, ignore_eos=True)
    assert not v.ok
    assert any("after 1 of max_tokens=32" in p for p in v.problems)


@pytest.mark.parametrize("first", [30594, 57297, 32])
def test_any_first_token_followed_by_bos_fails(first):
    """J11/J13: the first token varies between runs ('你好', ' Modified', '>'), the BOS tail does not."""
    assert not judge_tokens([first] + [BOS] * 7, max_tokens=8, ignore_eos=True).ok


def test_all_bos_fails():
    """J09: [0, 0, …, 0]."""
    v = judge_tokens([BOS] * 32, max_tokens=32, ignore_eos=True)
    assert not v.ok and "BOS" in v.summary()


def test_bos_as_first_token_fails():
    assert not judge_tokens([BOS, 5, 6, 7], max_tokens=4, ignore_eos=True).ok


def test_repeated_eos_fails_with_ignore_eos_and_one_eos_is_allowed():
    assert judge_tokens([5, 6, EOS, 7, 8], max_tokens=5, ignore_eos=True).ok
    v = judge_tokens([5, EOS, 7, EOS, 8], max_tokens=5, ignore_eos=True)
    assert not v.ok and "EOS (id 1) repeated 2 times" in v.summary()


def test_eos_must_end_the_output_without_ignore_eos():
    assert judge_tokens([5, 6, EOS], finish_reason="stop", max_tokens=8).ok
    assert not judge_tokens([5, EOS, 6], finish_reason="length", max_tokens=3).ok


def test_pad_distinct_from_eos_counts_too():
    cfg = VerdictConfig(pad_token_id=2)
    assert not judge_tokens([5, 2, 6, 2], max_tokens=4, ignore_eos=True, config=cfg).ok


def test_empty_output_fails():
    v = judge_tokens([], max_tokens=8)
    assert not v.ok and "empty" in v.problems[0]


def test_one_token_repeated_fails_above_the_threshold():
    assert judge_tokens([7, 9, 9, 9, 9, 9, 9, 9, 4], max_tokens=9, ignore_eos=True).ok  # run of 7 < 8
    v = judge_tokens([7] + [9] * 8, max_tokens=9, ignore_eos=True)
    assert not v.ok and "token 9 repeated 8 times in a row" in v.summary()
    assert longest_run([1, 2, 2, 3, 3, 3]) == (3, 3, 3)


def test_dominant_token_fails():
    ids = [5, 9, 6, 9, 7, 9, 8, 9, 10, 9, 11, 9, 12, 9, 13, 9, 9]
    v = judge_tokens(ids, max_tokens=len(ids), ignore_eos=True)
    assert not v.ok and "token 9 makes up" in v.summary()


def test_ngram_loop_fails():
    ids = [100, 101, 102] + [7, 8, 9] * 5
    v = judge_tokens(ids, max_tokens=len(ids), ignore_eos=True)
    assert not v.ok and "3-gram loop [7, 8, 9]" in v.summary()
    assert find_loop([1, 2] * 6) == (2, 0, 12)
    assert find_loop([1, 2] * 5) is None  # 10 tokens: below loop_min_tokens=12
    assert find_loop(HEALTHY) is None


def test_unfinished_or_truncated_runs_fail():
    assert not judge_tokens([5, 6], finish_reason=None, max_tokens=2).ok
    assert not judge_tokens([5, 6], finish_reason="abort", max_tokens=2).ok
    assert not judge_tokens([5, 6, 7], finish_reason="length", max_tokens=2).ok


def test_one_token_stop_warns_that_decode_never_ran():
    v = judge_tokens([5], finish_reason="stop", max_tokens=8)
    assert v.ok and "decode never ran" in v.warnings[0]
