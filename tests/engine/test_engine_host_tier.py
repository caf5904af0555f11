"""The prefix cache's host tier end to end on CPU: a device pool of a few blocks, a host tier beside
it. A prompt's blocks pushed out of the device pool by other prompts come back from the host tier,
and the request continues bitwise as if they had never left: the greedy tokens and the logprob of
each are == to the prompt's uncached run and to a device-tier hit (the model is bitwise
batch/chunk-invariant on CPU). The copies' ordering against compute is checked with a copy engine
whose copies land late unless a fence waits for them."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import assert_no_leaks, greedy, make_llm, rand_prompts, signature

from dsv4.cache.copies import CopyEngine, rows_view
from dsv4.cache.paged import unit_bytes
from dsv4.config import load_config
from dsv4.model.cache import CacheNumerics
from dsv4.model.step import BLOCK

SEQS, BUDGET = 2, 512
NEW = 3


def pool_memory(ckpt, kv_dtype: str, num_blocks: int, seqs: int = SEQS, budget: int = BUDGET,
                lookahead: int = 0) -> int:
    """kv_cache_memory giving a device pool of exactly ``num_blocks`` blocks (``plan_budget``'s split;
    ``lookahead``: the speculative tokens the state rings make room for)."""
    blk, swa, slot = unit_bytes(load_config(ckpt), CacheNumerics(kv_dtype), torch.float32, lookahead)
    extra_swa = seqs * 3 + -(-budget // 64) + 2
    return seqs * slot + extra_swa * swa + num_blocks * (blk + 2 * swa)


def host_gib(ckpt, kv_dtype: str, num_blocks: int) -> float:
    """kv_offloading_size (GiB) of a host tier of ``num_blocks`` slots."""
    blk, swa, _ = unit_bytes(load_config(ckpt), CacheNumerics(kv_dtype), torch.float32)
    return num_blocks * (blk + 2 * swa) * 1.001 / 2**30  # (the slots' row padding is within 0.1 %)


def tier_llm(ckpt, kv_dtype="fp8_ds_mla", blocks=3, host_blocks=8, **kw):
    """A device pool of ``blocks`` blocks (as long as ``max_model_len``) and a host tier of ``host_blocks``;
    a prefill chunk takes at most 256 tokens while another request runs or waits."""
    k = (kw.get("speculative_config") or {}).get("num_speculative_tokens", 0)
    return make_llm(ckpt, kv_dtype, max_num_seqs=SEQS, max_num_batched_tokens=BUDGET, max_model_len=blocks * BLOCK,
                    kv_cache_memory=pool_memory(ckpt, kv_dtype, blocks, lookahead=k),
                    long_prefill_token_threshold=BLOCK,
                    kv_offloading_size=host_gib(ckpt, kv_dtype, host_blocks) if host_blocks else None, **kw)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return tier_llm(tiny_ckpt)


def block_hashes(kv, prompt: list[int]) -> list[int]:
    return kv.chain_hashes(prompt, (len(prompt) - 1) // BLOCK)


def device_payload(kv, h: int) -> list[torch.Tensor]:
    """The device bytes a hit at cached block ``h`` reads (its pages of every tensor, its window)."""
    e = kv.cached[h]
    kvc = kv.kvc
    rows = [rows_view(t)[e.block].clone() for t in (*kvc.comp.values(), *kvc.boundary.values())]
    return rows + [rows_view(t)[p].clone() for t in kvc.swa for p in e.swa]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
                                    for x, y in zip(a, b))


def push_out(llm, kv, hashes: list[int], seed: int, at_least: int = 1) -> int:
    """Run other 260-token prompts (at least ``at_least``) until none of ``hashes`` is cached on the
    device; how many ran."""
    n = 0
    while n < at_least or any(h in kv.cached for h in hashes):
        assert n < 6, "the other prompts did not push the blocks out of the device pool"
        llm.generate([rand_prompts(seed + n, [260])[0]], greedy(1))
        n += 1
    return n


def test_blocks_pushed_out_of_the_device_pool_come_back_bitwise(llm):
    kv = llm.engine.kv
    kv.reset_prefix_cache()
    kv.reset_stats()
    assert kv.kvc.budget.num_blocks == 3 and kv.host.num_slots == 8
    prompt = rand_prompts(40, [520])[0]  # two full blocks: the window pages, the 128 window and HCA entries
    h0, h1 = block_hashes(kv, prompt)
    cold = signature(llm.generate([prompt], greedy(NEW))[0])  # uncached: nothing to hit yet
    assert kv.hits == 0 and kv.host_hits == 0
    assert signature(llm.generate([prompt], greedy(NEW))[0]) == cold  # a device-tier hit
    assert kv.hits == 2 * BLOCK and kv.host_hits == 0
    first = device_payload(kv, h0)

    # one other prompt evicts block 0 (the least recently used): a hit takes block 1 from the device
    # tier and restores block 0 from the host tier into other pages
    push_out(llm, kv, [h0], seed=41)
    assert h1 in kv.cached and h0 in kv.host and kv.host.offloaded_blocks >= 1
    assert same_bytes(kv.host.store.slot_payload(kv.host.entries[h0]), first)  # the host copy, byte for byte
    hits = kv.hits
    assert signature(llm.generate([prompt], greedy(NEW))[0]) == cold
    assert kv.host_hits == BLOCK and kv.hits == hits + BLOCK and kv.host.restored_blocks == 1
    assert same_bytes(device_payload(kv, h0), first)  # restored, byte for byte, and cached on the device again

    # both blocks pushed out: the whole hit comes from the host tier
    push_out(llm, kv, [h0, h1], seed=50)
    hits = kv.hits
    assert signature(llm.generate([prompt], greedy(NEW))[0]) == cold
    assert kv.host_hits == 3 * BLOCK and kv.hits == hits and kv.host.restored_blocks == 3
    assert same_bytes(device_payload(kv, h0), first)
    s = kv.stats()
    assert s["host_prefix_cache_hits"] == 3 * BLOCK and s["host_prefix_cache_queries"] == s["prefix_cache_queries"]
    assert s["host_restored_bytes"] == 3 * kv.host.store.slot_bytes
    assert s["host_offloaded_bytes"] == kv.host.offloaded_blocks * kv.host.store.slot_bytes
    assert 0 < s["host_usage_blocks"] <= 8 and s["host_capacity_tokens"] == 8 * BLOCK
    assert_no_leaks(llm)
    kv.reset_prefix_cache()  # forgets both tiers
    assert len(kv.host) == 0 and kv.match_prefix(prompt, len(prompt) - 1) == []


def test_a_preempted_requests_block_comes_back_from_the_host_tier(llm):
    """A request preempted at a block boundary leaves its blocks cached; the running request's next
    block evicts one of them to the host tier; the preempted request waits for room rather than
    recompute it, then continues from both tiers, bitwise as when it runs alone."""
    engine, kv = llm.engine, llm.engine.kv
    kv.reset_prefix_cache()
    kv.reset_stats()
    short, long = rand_prompts(71, [254, 520])
    rs = engine.add_request(short, greedy(4))  # its 257th token needs a second block
    rl = engine.add_request(long, greedy(NEW))  # chunks of 256: 512 computed, then no third block
    done, trace = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        trace.append((engine.scheduler.num_preemptions, kv.host.offloaded_blocks, kv.host_hits))
    assert engine.scheduler.num_preemptions == 1 and kv.host.offloaded_blocks >= 1, trace
    assert kv.host_hits == BLOCK, trace  # block 0 from the host tier (block 1 stayed on the device)
    assert all(done[r].error is None for r in (rs, rl))
    assert_no_leaks(llm)
    kv.reset_prefix_cache()
    alone = signature(llm.generate([long], greedy(NEW))[0])
    assert signature(done[rl]) == alone


def test_tier_off_unused_and_bad_settings_name_the_setting(tiny_ckpt, caplog):
    from dsv4.engine.settings import EngineConfig

    caplog.set_level(logging.INFO, logger="dsv4.engine")
    on = tier_llm(tiny_ckpt, blocks=2, host_blocks=4)
    assert on.engine.kv.host.num_slots == 4 and on.engine.kv.host.store.pin_memory is False  # (no CUDA device)
    off = tier_llm(tiny_ckpt, blocks=2, host_blocks=0)
    assert off.engine.kv.host is None and "host_prefix_cache_hits" not in off.engine.kv.stats()
    unused = tier_llm(tiny_ckpt, blocks=2, host_blocks=4, enable_prefix_caching=False)
    assert unused.engine.kv.host is None
    lines = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "on: device tier 512 tokens, host tier 1024 tokens (4 blocks of 0.52 MiB" in lines[0], lines[0]
    assert "no host tier (kv_offloading_size unset)" in lines[1], lines[1]
    assert "off (device tier 512 tokens; host tier off: kv_offloading_size=" in lines[2] and \
           "unused with prefix caching off" in lines[2], lines[2]
    with pytest.raises(ValueError, match=r"kv_offloading_size=1e-06 GiB holds no 256-token block: one takes 0\.52 MiB"):
        make_llm(tiny_ckpt, "fp8_ds_mla", max_model_len=512, kv_offloading_size=1e-6)
    with pytest.raises(ValueError, match="kv_offloading_backend must be one of native; got 'lmcache'"):
        EngineConfig(model="m", kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match=r"kv_offloading_size must be ≥ 0 \(GiB"):
        EngineConfig(model="m", kv_offloading_size=-1)


class LazyCopies(CopyEngine):
    """Copies that have not happened yet: each stays pending, reading its source only when it lands —
    at a fence (``wait``) or when the test says the copy engine got to it (``land``). A step that
    runs before its copies landed reads what its pages held before, and an offload that lands after
    its pages were rewritten copies the new contents: the two races the fences exclude."""

    def __init__(self):
        self.pending: list = []
        self.landed_at_fence = 0

    def issue(self, moves) -> None:
        self.pending.extend(moves)

    def land(self) -> int:
        moves, self.pending = self.pending, []
        super().issue(moves)
        return len(moves)

    def wait(self) -> None:
        self.landed_at_fence += self.land()

    def synchronize(self) -> None:
        self.land()


def _hit_after_push(llm, prompt) -> tuple:
    """The prompt's signature after its block went to the host tier and came back."""
    kv = llm.engine.kv
    # two: the first reuses the evicted block's id for its unfinished second block, so the page the
    # restore then takes would still hold the prompt's own boundary rows; the second closes a block there
    push_out(llm, kv, block_hashes(kv, prompt), seed=61, at_least=2)
    host_hits = kv.host_hits
    again = signature(llm.generate([prompt], greedy(NEW))[0])
    assert kv.host_hits == host_hits + BLOCK
    return again


def test_the_copies_are_fenced_against_the_steps_and_without_the_fence_the_output_changes(tiny_ckpt, monkeypatch):
    """With copies that land late, the output is still bitwise the cold run's: the restore lands
    before the step that reads it (and before the boundary rows are read from it), the offload
    before the step that rewrites its pages. Take the fence away (the copies then land after the
    step) and the same request gives other tokens or logprobs."""
    llm = tier_llm(tiny_ckpt, blocks=2)
    engine = llm.engine
    lazy = engine.kv.host.store.copies = LazyCopies()
    execute = engine.runner.execute

    def step_then_land(batch):  # the copy engine catches up only after the step
        out = execute(batch)
        lazy.land()
        return out

    monkeypatch.setattr(engine.runner, "execute", step_then_land)
    prompt = rand_prompts(60, [260])[0]
    cold = signature(llm.generate([prompt], greedy(NEW))[0])
    assert _hit_after_push(llm, prompt) == cold
    assert lazy.landed_at_fence >= 2  # (the offload, then the restore, each waited for)

    # no fence: the copies land after the step (the block is still in the host tier: only its restore
    # is copied this time)
    monkeypatch.setattr(engine.kv, "wait_copies", lambda: None)
    lazy.landed_at_fence = 0
    unfenced = _hit_after_push(llm, prompt)
    assert lazy.landed_at_fence == 0
    assert unfenced != cold, "an unfenced host-tier round trip gave the fenced output: the test cannot see a race"
    assert_no_leaks(llm)


def test_with_speculative_decoding_a_host_tier_hit_is_bitwise_the_run_without_either(tiny_ckpt, llm):
    """MTP speculation gives back a hit's last block (recomputed: the proposer needs the target's
    streams there); the block before it comes back from the host tier byte for byte — its window
    pages of every layer, the MTP layer's included — and the tokens and logprobs are those of the
    engine without speculation and without a hit."""
    kv0 = llm.engine.kv
    kv0.reset_prefix_cache()
    prompt = rand_prompts(80, [520])[0]
    want = signature(llm.generate([prompt], greedy(NEW))[0])  # no speculation, uncached
    spec = tier_llm(tiny_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    kv = spec.engine.kv
    assert spec.engine.proposer is not None and spec.engine.scheduler.recompute_last_hit_block
    h0, h1 = block_hashes(kv, prompt)
    assert signature(spec.generate([prompt], greedy(NEW))[0]) == want  # cold
    first, second = device_payload(kv, h0), device_payload(kv, h1)
    assert signature(spec.generate([prompt], greedy(NEW))[0]) == want  # a device-tier hit of block 0
    assert kv.hits == BLOCK and kv.host_hits == 0
    assert same_bytes(device_payload(kv, h0), first)

    push_out(spec, kv, [h0, h1], seed=81)
    assert h0 in kv.host and h1 in kv.host
    assert same_bytes(kv.host.store.slot_payload(kv.host.entries[h0]), first)
    restored, hits = kv.host.restored_blocks, kv.hits
    assert signature(spec.generate([prompt], greedy(NEW))[0]) == want
    # block 0 from the host tier; block 1 (the hit's last) recomputed, not restored
    assert kv.host_hits == BLOCK and kv.host.restored_blocks == restored + 1 and kv.hits == hits
    assert same_bytes(device_payload(kv, h0), first)
    assert same_bytes(device_payload(kv, h1), second)  # (the recompute's bytes: what the host copy holds too)
    assert same_bytes(kv.host.store.slot_payload(kv.host.entries[h1]), second)
    assert_no_leaks(spec)
