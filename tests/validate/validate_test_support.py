"""Helpers for tests/validate (imported by its test files; distinct name so it never shadows another dir's)."""

from __future__ import annotations

import threading
import time

import torch

from dsv4.engine.engine import EngineConfig, LLMEngine
from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM
from dsv4.model.cache import CacheNumerics
from dsv4.validate.oracle import compare, teacher_forced_logits
from dsv4.validate.verdict import VerdictConfig, judge_tokens

TOKEN_LO, TOKEN_HI = 3, 129000  # clear of BOS/EOS (0/1) and the added tokens at the top of the vocabulary


def llm_over(model, ckpt, **kw) -> LLM:
    """An ``LLM`` whose engine runs the already loaded ``model`` (test budget: 128 MiB cache, 512 tokens)."""
    cfg = dict(model=str(ckpt), kv_cache_memory=128 << 20, max_model_len=512, max_num_seqs=16,
               max_num_batched_tokens=2048)
    cfg.update(kw)
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(EngineConfig(**cfg), model=model)
    return llm


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, ``ignore_eos`` (every run decodes ``max_tokens`` tokens), the sampled token's logprob reported."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def rand_prompt(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(TOKEN_LO, TOKEN_HI, (n,), generator=gen).tolist()


def signature(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids))


def assert_healthy(llm: LLM, outs, max_tokens: int, ref_steps: int | None = None) -> None:
    """Every output passes the token verdict and agrees with the dense-cache reference (teacher-forced,
    ``ref_steps`` tokens; all by default). On CPU the engine is bitwise the reference, so the
    tolerances are tight."""
    eng = llm.engine
    vcfg = VerdictConfig(bos_token_id=eng.model_config.bos_token_id, eos_token_id=eng.model_config.eos_token_id)
    numerics = CacheNumerics(eng.config.kv_cache_dtype, eng.config.fp8_format)
    for k, out in enumerate(outs):
        c = out.outputs[0]
        v = judge_tokens(c.token_ids, finish_reason=c.finish_reason, max_tokens=max_tokens, ignore_eos=True,
                         config=vcfg)
        assert v.ok, f"output {k}: {v.summary()}\nTOKEN_IDS: {c.token_ids}\nOUTPUT_REPR: {c.text!r}"
        n = len(c.token_ids) if ref_steps is None else ref_steps
        logits = teacher_forced_logits(eng.model, numerics, list(out.prompt_token_ids), c.token_ids, n)
        a = compare(c.token_ids, logits, c.logprobs, tol=1e-6, logprob_tol=1e-4, top_k=0)
        assert a.ok, f"output {k} ({len(out.prompt_token_ids)} prompt tokens) vs reference: {a.problems[:3]}"
        assert len(a.steps) == n


class ServerThread:
    """The OpenAI server (``build_app``) under uvicorn on 127.0.0.1, a free port, in a thread."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-validate", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
