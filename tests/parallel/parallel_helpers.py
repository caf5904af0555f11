"""Shared pieces of tests/parallel: the prompts, the engine settings, and a `dsv4 serve` subprocess.

Every comparison runs the tiny checkpoint in float32 with ``kv_cache_dtype="auto"``: TP sums
partial results in a different order than TP=1, so logits differ in the last bits and only the
greedy tokens are compared (the tiny model's top-1/top-2 margins on these prompts are far larger).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import torch
from tiny_vocab import SMALL_VOCAB

ENGINE = dict(dtype="float32", kv_cache_dtype="auto", max_model_len=1024, max_num_seqs=8,
              kv_cache_memory=256 << 20)
MAX_TOKENS = 6
# data-parallel runs: a KV cache of 3 blocks (768 tokens) per rank with max_model_len 512: the batch of
# greedy_llm fits (7 + 300 tokens on rank 0), two 254-token prompts decoding past 256 tokens on one rank do not
SMALL = {**ENGINE, "max_model_len": 512, "kv_cache_memory": int(46.5 * 2**20)}
GPU_PATHS = {"attention": "batched", "backend": "torch"}  # the batched paged attention with its torch ops


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped counts as gone
        return f.read().split()[2] == "Z"


def preempting_prompts() -> list[list[int]]:
    """Four 254-token prompts: two per data-parallel rank preempt each other within SMALL's cache."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, SMALL_VOCAB, (254,), generator=g).tolist() for _ in range(4)]


def check_spread_over_two_ranks(stats: list[dict]) -> None:
    """The data-parallel ranks' state after ``greedy_llm`` with decode graphs: the prefix prompt went to
    rank 0, which had cached the 300-token prompt's first block; rank 1 computed only its own prompt;
    decode steps replayed graphs on both ranks, rank 1 (idle while the prefix prompt decoded) with
    spare lanes."""
    assert stats[0]["prefix_cache_hits"] >= 256 and stats[1]["prefix_cache_hits"] == 0
    assert stats[1]["prefix_cache_queries"] == 150
    assert stats[0]["graph_replays"] > 0 and stats[0]["spare_replays"] == 0
    assert stats[1]["spare_replays"] > 0 and stats[1]["graph_replays"] > stats[1]["spare_replays"]


def prompts() -> list[list[int]]:
    """Three prompts (one window, past the 128 window and the first CSA blocks, past a 256-token
    block with an HCA entry), batched together; then one sharing the last one's first block."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, SMALL_VOCAB, (n,), generator=g).tolist() for n in (7, 150, 300)]


def prefix_prompt() -> list[int]:
    """The 300-token prompt's first 256 tokens + a new tail: a prefix-cache hit at the block end."""
    p = prompts()
    return p[2][:256] + p[0] * 5


def greedy_llm(llm) -> list[list[int]]:
    """Greedy tokens of the batch, then of the prefix-hit prompt (after the batch registered its blocks)."""
    from dsv4 import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts(), sp)]
    return first + [llm.generate([prefix_prompt()], sp)[0].outputs[0].token_ids]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``dsv4 serve`` in a subprocess (its own process group), with its log in a file."""

    def __init__(self, model_dir, log_path, *extra: str):
        self.port = free_port()
        self.log_path = log_path
        args = [sys.executable, "-m", "dsv4.cli", "serve", str(model_dir), "--port", str(self.port),
                "--served-model-name", "tiny", "--dtype", ENGINE["dtype"], "--kv-cache-dtype", ENGINE["kv_cache_dtype"],
                "--max-model-len", str(ENGINE["max_model_len"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
                "--kv-cache-memory", str(ENGINE["kv_cache_memory"] >> 20), "--uvicorn-log-level", "warning", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout: float = 150.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dsv4 serve exited with {self.proc.returncode} while starting:\n{self.log()[-4000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"dsv4 serve did not become ready in {timeout} s:\n{self.log()[-4000:]}")

    def worker_pids(self) -> dict[int, int]:
        started = r"started (?:tensor-parallel worker rank|data-parallel rank|data-parallel process) (\d+), pid (\d+)"
        return {int(r): int(p) for r, p in re.findall(started, self.log())}

    def complete(self, ids: list[int], timeout: float = 120.0):
        import httpx

        body = {
            "model": "tiny",
            "prompt": ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        }
        return httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)

    def close(self) -> int:
        """SIGTERM to the server alone (it stops its workers); the whole process group if it hangs."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers (there should be none)
        except ProcessLookupError:
            pass
        code = self.proc.wait(10)
        self._log.close()
        return code


def served_tokens(resp) -> list[str]:
    """The per-token texts of a completion (its ``logprobs.tokens``): compared with the reference's
    ``tokenizer.decode([id])`` of each greedy token id (the completions API returns no ids)."""
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]
