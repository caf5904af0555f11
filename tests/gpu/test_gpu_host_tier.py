"""The prefix cache's host tier on a CUDA device: the copy engine's fences against the compute
stream, and the round trip through pinned host memory, bitwise, on the engine's GPU path (batched
paged attention, decode CUDA graphs, async scheduling).

Each fence has a negative control: the same race without it must show, so the test can see it."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SLEEP = 200_000_000  # GPU cycles (~0.1 s at 2 GHz): a step still running when the copy is issued
ROWS = list(range(64))


@pytest.fixture()
def pages():
    dev = torch.device("cuda")
    return torch.zeros(64, 1 << 14, device=dev), torch.ones(64, 1 << 14, pin_memory=True)


def _unfenced():
    from dsv4.cache.copies import CudaCopyEngine, copy_runs, runs

    class Unfenced(CudaCopyEngine):
        """The copies without waiting for the compute stream first (what the fence prevents)."""

        def issue(self, moves):
            with torch.cuda.stream(self.stream):
                for src, src_rows, dst, dst_rows in moves:
                    copy_runs(src, dst, runs(src_rows, dst_rows), non_blocking=True)
                self._done = torch.cuda.Event()
                self._done.record(self.stream)

    return Unfenced(torch.device("cuda"))


def test_a_restore_waits_for_the_kernels_still_reading_its_pages(pages):
    from dsv4.cache.copies import CudaCopyEngine

    dev, host = pages

    def step_reading_while_restored(copies) -> float:
        dev.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP)  # a long step on the compute stream, which reads the pages at its end
        seen = dev.sum()
        copies.issue([(host, ROWS, dev, ROWS)])  # a restore into the same pages, issued meanwhile
        copies.wait()
        out = seen.item()
        torch.cuda.synchronize()
        return out

    assert step_reading_while_restored(CudaCopyEngine(torch.device("cuda"))) == 0.0
    assert step_reading_while_restored(_unfenced()) == float(dev.numel()), \
        "without the fence the restore did not overtake the running step: the test cannot see the race"


def test_the_next_step_waits_for_the_restore(pages):
    from dsv4.cache.copies import CudaCopyEngine

    dev, host = pages

    def step_after_restore(wait: bool) -> float:
        copies = CudaCopyEngine(torch.device("cuda"))
        dev.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(copies.stream):
            torch.cuda._sleep(SLEEP)  # the copy engine is still busy with earlier copies
        copies.issue([(host, ROWS, dev, ROWS)])
        if wait:
            copies.wait()
        out = dev.sum().item()  # the step that reads the restored pages
        torch.cuda.synchronize()
        return out

    assert step_after_restore(wait=True) == float(dev.numel())
    assert step_after_restore(wait=False) == 0.0, "the step did not overtake the unfenced copy: the race is unseen"


def _sig(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids))


def test_blocks_come_back_from_pinned_host_memory_bitwise(tiny_ckpt):
    from dsv4 import LLM, SamplingParams
    from dsv4.cache.paged import unit_bytes
    from dsv4.config import load_config
    from dsv4.model.cache import CacheNumerics
    from dsv4.model.step import BLOCK

    blk, swa, slot = unit_bytes(load_config(tiny_ckpt), CacheNumerics("fp8_ds_mla"), torch.bfloat16)
    seqs, budget = 2, 512
    pool = seqs * slot + (seqs * 3 + budget // 64 + 2) * swa + 3 * (blk + 2 * swa)  # three blocks
    llm = LLM(str(tiny_ckpt), kv_cache_dtype="fp8_ds_mla", max_model_len=3 * BLOCK, max_num_seqs=seqs,
              max_num_batched_tokens=budget, kv_cache_memory=pool, kv_offloading_size=8 * (blk + 2 * swa) / 2**30)
    engine, kv = llm.engine, llm.engine.kv
    assert kv.kvc.budget.num_blocks == 3 and engine.runner.graphs is not None and engine.config.async_scheduling
    assert kv.host.store.pin_memory and all(h.is_pinned() for _, h in kv.host.store.block_pairs)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 120000, (520,), generator=g).tolist()
    hashes = kv.chain_hashes(prompt, 2)
    cold = _sig(llm.generate([prompt], sp)[0])
    device_hit = _sig(llm.generate([prompt], sp)[0])
    assert kv.hits >= 2 * BLOCK
    n = 0
    while any(h in kv.cached for h in hashes):  # push both blocks out of the device pool
        assert n < 6
        llm.generate([torch.randint(3, 120000, (300,), generator=g).tolist()], SamplingParams(max_tokens=1))
        n += 1
    host_hits = kv.host_hits
    host_hit = _sig(llm.generate([prompt], sp)[0])
    assert kv.host_hits == host_hits + 2 * BLOCK
    assert host_hit == device_hit, "a host-tier hit differs from a device-tier hit on the GPU"
    assert host_hit == cold, "a host-tier hit differs from the uncached run on the GPU"
