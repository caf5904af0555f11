"""Manifold-constrained hyper-connections: 4 residual streams mixed by doubly-stochastic maps.

pre  = sigmoid(mix·s0 + b) + eps          collapses the streams into the sub-layer input
post = 2·sigmoid(mix·s1 + b)              spreads the sub-layer output back over the streams
comb = Sinkhorn(softmax(mix·s2 + b) + eps) mixes the residual streams (20 iterations)
Mixes come from a float32 GEMM; the gates and Sinkhorn run in float64 and are rounded to float32,
so vectorised and scalar code paths (which differ by an ulp) cannot make a token's result depend on
the batch it is in. Streams keep the model dtype.

``mhc_post_pre`` (an op of ``dsv4.model.opset``) is a sub-layer's post followed by the next
sub-layer's pre: the oracle runs the two functions (``hc_post_then_pre``); on the fast path one kernel
writes the new streams and the next pre's mixes partials in one pass, with bitwise the results of the
two fast kernels. In a decode graph the fast pre's post and comb (read only by the next post) can be made on a
side stream beside the collapse (``dsv4.ops.triton.mhc.SINKHORN_BESIDE``) and handed over pending
(``dsv4.model.branches``): every post resolves them.
The functions that need a GEMM or a norm take the op set ``ops`` first.
"""

from __future__ import annotations

import torch

from .branches import resolve


def sinkhorn(comb0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Column-normalise, then (iters-1)× (row, column). The softmax was the first row pass."""
    comb = comb0 / (comb0.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre(ops, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           iters: int, hc_eps: float, rms_eps: float, norm: torch.Tensor | None = None):
    """streams [T, n, H] → (collapsed [T, H] in stream dtype, post [T, n], comb [T, n, n]) (fp32 mixes).
    ``norm``: the sub-layer's RMSNorm weight; the collapsed input then comes back normalised (eps ``rms_eps``),
    which is all the sub-layer reads of it (one launch fewer on the fast path)."""
    T, n, _ = streams.shape
    flat = ops.unit_rms_norm(streams.reshape(T, -1).float(), rms_eps)
    mixes = ops.linear(flat, fn.float()).double()
    pre_m, post_m, comb_m = mixes.split([n, n, n * n], dim=-1)
    base, scale = base.double(), scale.double()
    pre = (torch.sigmoid(pre_m * scale[0] + base[:n]) + hc_eps).float()
    post = (2.0 * torch.sigmoid(post_m * scale[1] + base[n: 2 * n])).float()
    comb0 = torch.softmax(comb_m.view(T, n, n) * scale[2] + base[2 * n:].view(n, n), dim=-1) + hc_eps
    comb = sinkhorn(comb0, iters, hc_eps).float()
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    if norm is not None:
        collapsed = ops.rms_norm(collapsed, norm, rms_eps)
    return collapsed, post, comb


def hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """R'[j] = Σ_i comb[i, j]·R[i] + post[j]·out (sum over the first index of comb). post and comb may be
    pending (``branches.Pending``: a fast pre's Sinkhorn on a side stream, when another backend runs this post)."""
    post, comb = resolve(post), resolve(comb)
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


def hc_post_then_pre(ops, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
                     rms_eps: float, norm: torch.Tensor | None = None):
    """(new streams [T, n, H], collapsed [T, H], post' [T, n], comb' [T, n, n]): ``ops``' mhc_post of
    (streams, out, post, comb), then its mhc_pre of the new streams with (fn, base, scale, norm)."""
    new = ops.mhc_post(streams, out, post, comb)
    return (new, *ops.mhc_pre(new, fn, base, scale, iters, hc_eps, rms_eps, norm))


def hc_head(ops, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, rms_eps: float) -> torch.Tensor:
    """Final collapse: sigmoid weights, no Sinkhorn."""
    T = streams.shape[0]
    flat = ops.unit_rms_norm(streams.reshape(T, -1).float(), rms_eps)
    mixes = ops.linear(flat, fn.float()).double()
    pre = (torch.sigmoid(mixes * scale.double()[0] + base.double()) + hc_eps).float()
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
