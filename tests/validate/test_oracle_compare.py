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
