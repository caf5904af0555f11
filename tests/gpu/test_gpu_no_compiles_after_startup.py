"""No kernel is built in a request's path: after the engine's start-up (decode graphs + warm-up),
a randomized workload within its limits — prompt lengths 1..max_model_len, up to max_num_seqs
sequences, chunked prefills beside decodes, prefix-cache hits — builds 0 Triton specializations
(counted through Triton's post-compile hook, ``dsv4.ops.compiles``). A failure names each new
specialization by the arguments in which it differs from the nearest one the start-up launched."""

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_LEN, SEQS, BUDGET = 2048, 16, 512


def test_a_random_workload_after_start_up_builds_no_kernel(tiny_ckpt):
    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.llm import LLM
    from dsv4.ops import compiles

    with compiles.recording() as start:
        llm = LLM(str(tiny_ckpt), kv_cache_dtype="fp8_ds_mla", max_model_len=MAX_LEN, kv_cache_memory=2 << 30,
                  max_num_seqs=SEQS, max_num_batched_tokens=BUDGET, warm_up=True)
    eng = llm.engine
    assert eng.runner.graphs is not None and eng.startup["warm_up"] > 0
    built = compiles.count()
    rng = random.Random(11)
    shared = [rng.randrange(3, 120000) for _ in range(600)]  # a prefix some prompts reuse
    with compiles.recording() as rec:
        for wave in range(4):
            for i in range(rng.randint(1, SEQS)):
                n = rng.choice([1, 2, rng.randint(3, 64), rng.randint(65, 700), rng.randint(700, MAX_LEN - 40)])
                ids = [rng.randrange(3, 120000) for _ in range(n)]
                if rng.random() < 0.3:
                    ids = (shared + ids)[: MAX_LEN - 40]
                params = SamplingParams(temperature=rng.choice([0.0, 1.0]), top_p=0.9, seed=wave * 100 + i,
                                        max_tokens=rng.randint(1, 32), ignore_eos=True)
                eng.add_request(prompt_token_ids=ids, request_id=f"w{wave}-{i}", params=params)
            for _ in range(rng.randint(2, 20)):  # the next wave arrives while this one decodes
                if eng.has_unfinished_requests():
                    eng.step()
        while eng.has_unfinished_requests():
            eng.step()
    torch.cuda.synchronize()
    new = [compiles.Launches.diff(k, start.keys) for k in rec.new_since(start)]
    assert compiles.count() == built, (f"built after start-up: {compiles.recent()[-(compiles.count() - built):]}; "
                                       "new launch keys:\n" + "\n".join(new))
