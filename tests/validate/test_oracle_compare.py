"""The reference-agreement judge: drift tolerances plus the rounding of the logits they read."""

import torch

from dsv4.validate.oracle import compare, logit_ulp


def _row(top: float = 17.0, tok: float = 16.75, rest: float = 16.5, v: int = 4096) -> torch.Tensor:
    """A flat random-weight distribution: token 7 is top-1 at a logprob near -7.8, as in the probe."""
    row = torch.full((v,), rest)
    row[7], row[3] = top, tok
    return row.to(torch.bfloat16).float()  # a bf16 LM head's output


def test_logit_ulp_matches_bf16_spacing():
    x = torch.tensor([1.0, 17.0, -20.0, 0.3, 100.0])
    ulp = logit_ulp(x, torch.bfloat16)
    # the spacing of bf16 values at |x|: the next bf16 above |x| minus |x|
    xb = x.abs().to(torch.bfloat16).float()
    spacing = (xb + ulp.float()).to(torch.bfloat16).float() - xb
    assert torch.equal(spacing, ulp.float())
    assert float(ulp[1]) == 0.125 and float(ulp[0]) == 2 ** -7 and float(ulp[4]) == 0.5
    assert bool((logit_ulp(x, torch.float32) == 0).all()) and bool((logit_ulp(x, None) == 0).all())


def test_one_ulp_of_a_bf16_logit_is_not_a_fault_but_drift_beyond_it_is():
    row = _row()
    lp = torch.log_softmax(row.double(), -1)
    moved = row.clone()
    moved[7] += 0.125  # the engine's logit rounded one bf16 ulp up: what the TP=2 probe saw
    e_lp = float(torch.log_softmax(moved.double(), -1)[7])
    assert abs(e_lp - float(lp[7])) > 0.1
    assert compare([7], row[None], [{7: e_lp}], logprob_tol=0.1, top_k=0, logit_dtype=torch.bfloat16).ok
    # without the rounding allowance (fp32 logits) the same Δ is drift above the tolerance
    bad = compare([7], row[None], [{7: e_lp}], logprob_tol=0.1, top_k=0, logit_dtype=torch.float32)
    assert not bad.ok and "|Δ| > 0.1)" in bad.problems[0]
    # three ulps off is beyond drift + rounding even in bf16
    far = float(lp[7]) + 0.1 + 0.375
    worse = compare([7], row[None], [{7: far}], logprob_tol=0.1, top_k=0, logit_dtype=torch.bfloat16)
    assert not worse.ok and "logit rounding" in worse.problems[0]


def test_top1_disagreement_within_a_rounding_step_is_a_near_tie():
    row = _row(top=20.0, tok=19.875)  # one bf16 ulp apart: the margin is a rounding step
    a = compare([3], row[None], None, tol=0.05, top_k=0, logit_dtype=torch.bfloat16)
    assert a.ok and "near-tie" in a.warnings[0]
    b = compare([3], row[None], None, tol=0.05, top_k=0, logit_dtype=torch.float32)
    assert not b.ok
    far = _row(top=20.0, tok=19.5)  # four ulps: a real disagreement
    assert not compare([3], far[None], None, tol=0.05, top_k=0, logit_dtype=torch.bfloat16).ok


def test_steps_record_the_logit_and_the_tolerance_applied():
    row = _row()
    s = compare([7], row[None], None, logprob_tol=0.1, top_k=0, logit_dtype=torch.bfloat16).steps[0]
    assert s.oracle_logit == 17.0 and s.logprob_tol > 0.1 + 0.0625  # one ulp at 17 is 0.125
    assert compare([7], row[None], None, top_k=0).steps[0].logprob_tol == 0.1


def _lrow(**logits) -> torch.Tensor:
    """A float32 row over 4096 tokens at logit 0 except the named ones (``t7=4.0`` sets token 7)."""
    row = torch.zeros(4096)
    for k, v in logits.items():
        row[int(k[1:])] = v
    return row


def _lp(row: torch.Tensor, t: int) -> float:
    return float(torch.log_softmax(row.double(), -1)[t])


def test_a_logprob_the_bf16_reference_itself_gets_wrong_is_judged_against_float32():
    """The probe's TP=1 bf16 failure on the H200: engine -7.28, bf16 reference -7.81, float32
    reference -7.56 — the engine is no farther from the exact function than the bf16 reference."""
    o16, o32 = _lrow(t7=4.0), _lrow(t7=4.25)
    assert _lp(o32, 7) - _lp(o16, 7) > 0.24
    e_lp = _lp(o32, 7) + 0.2  # 0.45 from the bf16 reference, 0.2 from the float32 one
    plain = compare([7], o16[None], [{7: e_lp}], logprob_tol=0.1, top_k=0)
    assert not plain.ok
    a = compare([7], o16[None], [{7: e_lp}], logprob_tol=0.1, top_k=0, exact_logits=o32[None])
    assert a.ok and "precision-conditioned" in a.warnings[0] and "float32 reference gives" in a.warnings[0]


def test_an_engine_far_from_both_references_still_fails():
    o16 = _lrow(t7=4.0)
    well_conditioned = compare([7], o16[None], [{7: _lp(o16, 7) + 0.45}], logprob_tol=0.1, top_k=0,
                               exact_logits=o16[None])  # the references agree: nothing to forgive
    assert not well_conditioned.ok
    o32 = _lrow(t7=4.25)  # the bf16 reference is 0.25 low; the engine errs 0.3 the other way
    other_side = compare([7], o16[None], [{7: _lp(o16, 7) - 0.3}], logprob_tol=0.1, top_k=0, exact_logits=o32[None])
    assert not other_side.ok and "|Δ| > 0.1" in other_side.problems[0]


def test_a_top1_the_bf16_reference_picks_worse_than_the_engine_is_a_warning():
    o16 = _lrow(t7=5.0, t3=4.7)  # the bf16 reference prefers 7 by 0.3 nats; the engine picked 3
    assert not compare([3], o16[None], None, tol=0.05, top_k=0).ok
    o32 = _lrow(t3=5.0, t7=4.8)  # the float32 reference prefers 3: the engine's pick is the better one
    a = compare([3], o16[None], None, tol=0.05, top_k=0, exact_logits=o32[None])
    assert a.ok and "precision-conditioned" in a.warnings[0]
    # the float32 reference agrees with the bf16 one, or the engine's pick is worse in it: a fault
    assert not compare([3], o16[None], None, tol=0.05, top_k=0, exact_logits=o16[None]).ok
    o32b = _lrow(t7=5.0, t9=4.9, t3=4.6)
    assert not compare([3], o16[None], None, tol=0.05, top_k=0, exact_logits=o32b[None]).ok
