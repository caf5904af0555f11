"""The engine core: add requests, run steps (schedule → forward → sample), emit outputs."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache.manager import KVCacheManager
from ..cache.paged import PagedKVCache, plan_budget
from ..model.cache import CacheNumerics
from . import overlap
from .outputs import RequestOutput
from .request import Request, Status
from .runner import ModelRunner
from .sampler import Sampler, greedy_picks, plain_greedy
from .sampling_params import SamplingParams
from .scheduler import Scheduler

log = logging.getLogger("dsv4.engine")
OPS = ("fp8_linear", "moe_route", "moe_experts")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto → bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: str = "fp8_ds_mla"
    fp8_format: str = "auto"  # auto: the platform profile's encoding (FNUZ on gfx942, else OCP)
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; default: a CPU budget, or a GPU utilisation share
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    # tensor / expert parallelism (dsv4/dist, docs/distributed.md): one process per rank, rank 0 runs the engine
    enable_expert_parallel: bool = False  # routed experts split by expert instead of by intermediate dim
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node only)
    distributed_timeout: float = 300.0  # seconds a collective may wait before the engine is declared dead
    device: str | None = None  # None: the device of a model passed to LLMEngine, else the GPU if there is one
    seed: int = 0
    act_quant: bool = False
    backend: str = "auto"  # auto: fast kernels where the platform has them; torch: the reference path
    enforce_eager: bool = False  # no CUDA graphs for decode steps (vLLM's --enforce-eager)
    async_scheduling: bool | None = None  # schedule and launch the next step before this one's greedy picks
    #   reach the host (vLLM's --async-scheduling; engine/overlap.py). None: on for a single-process CUDA
    #   engine (the host's work then overlaps the GPU's), off elsewhere (resolve_async_scheduling)
    attention: str = "auto"  # batched: one step's attention over the pages at once; reference: per request;
    #                          auto: batched with the fast backend, reference with the torch one

    def fast_path(self, device: torch.device) -> bool:
        """Whether the model runs the fast (kernel) ops on ``device``: ``triton``, or ``auto`` off the CPU."""
        return self.backend == "triton" or (self.backend == "auto" and device.type != "cpu")

    def resolve_ops(self, device: torch.device) -> dict | None:
        """Op name → function for the fast path, or None for the pure torch reference."""
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be auto, torch or triton; got {self.backend!r}")
        if not self.fast_path(device):
            return None
        from ..ops.registry import describe, resolve

        from ..model.kernels import KERNEL_OPS

        force = None if self.backend == "auto" else {op: "triton" for op in OPS + KERNEL_OPS}
        ops = {op: resolve(op, force=force)[1] for op in OPS}
        for op in KERNEL_OPS:  # building blocks: only a real kernel replaces the oracle's torch code
            name, fn = resolve(op, force=force)
            if name != "torch":
                ops[op] = fn
        for row in describe(force=force):
            log.info("op %-12s → %-7s (%s)", row["op"], row["backend"], row["reason"])
        return ops

    def resolve_greedy_pick(self, device: torch.device):
        """The batched greedy pick's backend (``greedy_pick``): the fast one where the model runs the
        fast path, else None (the torch op)."""
        if not self.fast_path(device):
            return None
        from ..ops.registry import resolve

        return resolve("greedy_pick", force=None if self.backend == "auto" else {"greedy_pick": "triton"})[1]

    def resolve_attention_ops(self, device: torch.device) -> dict | None:
        """Ops of the batched paged attention, or None for the reference's per-request attention."""
        if self.attention not in ("auto", "batched", "reference"):
            raise ValueError(f"attention must be auto, batched or reference; got {self.attention!r}")
        if self.attention == "reference" or (self.attention == "auto" and not self.fast_path(device)):
            return None
        from ..ops.registry import resolve
        from .paged_attention import ATTENTION_OPS

        force = {op: "torch" for op in ATTENTION_OPS} if self.backend == "torch" else (
            {op: "triton" for op in ATTENTION_OPS} if self.backend == "triton" else None)
        return {op: resolve(op, force=force)[1] for op in ATTENTION_OPS}

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "half": torch.float16}
        if self.dtype not in table:
            raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {self.dtype!r}")
        return table[self.dtype]


def _graph_capturable(ops: dict) -> bool:
    """Whether a CUDA graph can capture the batched attention with these ops: the torch ones
    (``dsv4.ops.torch_*``, ``backend="torch"``) check page bounds on the host, a synchronization
    that stream capture forbids, so their decode steps run eagerly."""
    return not any(getattr(fn, "__module__", "").startswith("dsv4.ops.torch") for fn in ops.values())


def _shutdown_tp(runner: ModelRunner, dist) -> None:
    """Rank 0's tensor-parallel teardown: captured NCCL launches go before the group does (a live
    graph hangs ``destroy_process_group``, pytorch#115388), then the workers stop."""
    if runner.graphs is not None:
        runner.graphs.release()
        runner.graphs = None
    dist.shutdown()


def resolve_async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """``config.async_scheduling`` made definite. None (the default) turns it on where it pays: one
    process on a CUDA device, whose kernels run asynchronously to the host, so the next step's
    scheduling and the previous step's bookkeeping run under the current step (H200, 4-layer
    flash-width checkpoint: 10-20 % per decode step, docs/perf.md). On the CPU the model runs on the
    host thread and nothing overlaps; tensor parallelism does not support it (an explicit True there
    is an error)."""
    tp = config.tensor_parallel_size > 1 or config.nnodes > 1
    if config.async_scheduling is None:
        return device.type == "cuda" and not tp
    if config.async_scheduling and tp:
        raise ValueError("async_scheduling is not supported with tensor parallelism "
                         f"(tensor_parallel_size={config.tensor_parallel_size}, nnodes={config.nnodes})")
    return bool(config.async_scheduling)


class LLMEngine:
    def __init__(self, config: EngineConfig, backend=None, tokenizer=None):
        from ..chat.tokenizer import load_tokenizer
        from ..model.model import ReferenceModel

        if config.fp8_format == "auto":
            from ..ops.platform import detect_platform

            config.fp8_format = detect_platform().fp8_format or "ocp"
        self.config = config
        # a model passed in fixes the device (its weights are there); else the GPU when there is one
        device = torch.device(config.device or getattr(backend, "device", None)
                              or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = config.torch_dtype(device)
        self.dist = None  # TPDriver when tensor-parallel (dsv4/dist): this process is rank 0
        config.async_scheduling = resolve_async_scheduling(config, device)
        if config.tensor_parallel_size > 1 or config.nnodes > 1:
            if backend is not None:
                raise ValueError("a custom model backend cannot run at tensor_parallel_size > 1")
            from ..dist.driver import TPDriver

            self.dist = TPDriver(config, device)
            backend = self.dist.model
        self.model = backend or ReferenceModel(config.model, dtype=dtype, device=device,
                                              kv_cache_dtype=config.kv_cache_dtype, fp8_format=config.fp8_format,
                                              act_quant=config.act_quant, ops=config.resolve_ops(device))
        cfg = self.model.cfg
        self.model_config = cfg
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 8192)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        numerics = CacheNumerics(config.kv_cache_dtype, config.fp8_format)
        mem = config.kv_cache_memory
        if mem is None:
            if device.type == "cuda":
                free, total = torch.cuda.mem_get_info(device)
                mem = int(max(0, free - (1 - config.gpu_memory_utilization) * total))
            else:
                mem = 1 << 30
        budget = plan_budget(cfg, numerics, dtype, mem, config.max_num_seqs, config.max_num_batched_tokens,
                             self.max_model_len)
        self.kv_cache = PagedKVCache(cfg, numerics, budget, dtype, device)
        self.kv = KVCacheManager(self.kv_cache, config.enable_prefix_caching)
        if self.dist is not None:  # the workers allocate the same cache; prefix-cache restores are mirrored
            self.dist.start_caches(budget, self.kv)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv, config.resolve_attention_ops(device))
        if self.dist is not None:  # also when the engine is dropped or the interpreter exits without shutdown()
            self._tp_finalizer = weakref.finalize(self, _shutdown_tp, self.runner, self.dist)
        if (device.type == "cuda" and self.runner.attention_ops is not None and not config.enforce_eager
                and _graph_capturable(self.runner.attention_ops)):
            self.capture_decode_graphs()
        self.tokenizer = tokenizer or load_tokenizer(config.model if Path(config.model, "tokenizer.json").exists() else None)
        tok = self.tokenizer  # captured, not self: a dropped engine is freed at once, not at the next gc
        self.sampler = Sampler(cfg.eos_token_id, config.seed, decode=lambda t: tok.decode([t]))
        self.greedy_pick = config.resolve_greedy_pick(device)  # the plain greedy rows' batched pick (None: torch)
        self.requests: dict[str, list[Request]] = {}
        self._ids = itertools.count()
        self._inflight: overlap.InFlight | None = None  # async scheduling: the launched step not yet read
        self._carried: list[RequestOutput] = []  # async: a step() call's outputs so far (a failed call's: the next's)
        self.num_overlapped_steps = 0  # steps launched before the previous step's picks were read
        log.info("dsv4 engine: model %s, %s compute, kv cache %s: %d tokens (%d blocks, %d SWA pages, %.1f MiB)",
                 config.model, dtype, numerics.kv_cache_dtype, budget.capacity_tokens, budget.num_blocks,
                 budget.num_swa_pages, budget.total_bytes / 2**20)

    def capture_decode_graphs(self) -> None:
        """CUDA graphs of the decode forward (``engine.cuda_graphs``); at TP > 1 every rank captures
        its own and each replay is announced to the workers (``dist.driver.TPDecodeGraphs``). On the
        CPU the graphs are emulated (the same static inputs, run eagerly): how tests reach the path."""
        from .cuda_graphs import DecodeGraphs

        if self.runner.attention_ops is None:
            raise RuntimeError("decode graphs need the batched paged attention (attention='batched')")
        args = (self.kv_cache, self.runner.attention_ops, self.config.max_num_seqs, self.max_model_len)
        if self.dist is not None:
            self.runner.graphs = self.dist.capture_graphs(*args)
        else:
            self.runner.graphs = DecodeGraphs(self.model, *args)
            self.runner.graphs.capture()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (nothing to do at TP=1)."""
        if self.dist is not None:
            self._tp_finalizer()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None) -> str:
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif prompt is not None:
                prompt_token_ids, prompt = list(prompt), None
            else:
                raise ValueError("a request needs a prompt or prompt_token_ids")
        ids = list(map(int, prompt_token_ids))  # builtin passes: 8K ids in ~0.7 ms instead of ~1.0 (dev CPU)
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if t < 0 or t >= vocab)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        max_new = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max(max_new, 1) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens and max_tokens={max_new}: together more than "
                             f"max_model_len={self.max_model_len}")
        if params.max_tokens is None:
            params.max_tokens = max_new
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        group = []
        for i in range(params.n):
            p = params
            if params.n > 1 and params.seed is not None:
                p = SamplingParams(**{**_fields(params), "seed": params.seed + i})
            detok = self.tokenizer.incremental_detokenizer(skip_special_tokens=params.skip_special_tokens)
            r = Request(rid, ids, p, prompt=prompt, index=i, eos_token_id=self.model_config.eos_token_id,
                        detokenizer=detok)
            group.append(r)
            self.scheduler.add(r)
        self.requests[rid] = group
        return rid

    def abort_request(self, request_id: str) -> None:  # (an in-flight step skips it when read)
        for r in self.requests.pop(request_id, []):
            if not r.finished:
                r.finish("abort")
            self.scheduler.remove(r)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._inflight_live() or bool(self._carried)

    def _inflight_live(self) -> bool:
        """An in-flight step with a request still running (a step computed only for requests that
        have stopped since has nothing left to report)."""
        step = self._inflight
        return step is not None and any(not sc.req.finished for sc in step.schedule)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns outputs of requests that progressed. With
        ``async_scheduling`` a step of plain greedy samples is read one call later (``_step_async``)."""
        if self.config.async_scheduling:
            return self._step_async()
        schedule = self.scheduler.schedule()
        if not schedule:
            return []
        return self._run_step(schedule)

    def _step_async(self) -> list[RequestOutput]:
        """Launch the next step (token ids of requests still decoding taken from the in-flight step's
        picks on the device), then read the in-flight step: the host's work overlaps the GPU's. A
        step that cannot stay on the device runs synchronously once the in-flight one is read.
        Outputs are gathered in ``_carried`` first, so a step that fails after reading the in-flight
        one loses none of them (the next call returns them)."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            overlap.add_placeholders(prev)
        try:
            schedule = self.scheduler.schedule()
            nxt = None
            if schedule and overlap.deferrable(schedule, self.sampler):
                nxt = overlap.launch(self.runner, schedule, prev, self.greedy_pick)
        except Exception:
            if prev is not None:  # the placeholders get their tokens: the requests stay consistent
                self._carried += self._read_step(prev)
            raise
        if nxt is not None:
            self._inflight = nxt  # before reading prev: an error there must not lose the launched step
            if prev is not None:
                self.num_overlapped_steps += 1
        if prev is not None:
            self._carried += self._read_step(prev)
        if nxt is None:  # run it now (its requests that stopped at prev were removed: drop them)
            schedule = [sc for sc in schedule if not sc.req.finished]
            if schedule:
                self._carried += self._run_step(schedule)
        outs, self._carried = self._carried, []
        return outs

    def _read_step(self, step: overlap.InFlight) -> list[RequestOutput]:
        """Apply an in-flight step's greedy picks (each replacing its request's placeholder, if any)."""
        toks, fins = overlap.read_picks(step)
        touched: dict[str, None] = {}
        bad = None
        for row, si in step.batch.sample_rows:
            req = step.schedule[si].req
            overlap.drop_placeholder(req)
            if req.finished:  # aborted (or failed) while in flight
                continue
            if not fins[row]:
                bad = bad or req
                continue
            req.append_token(toks[row], None, None)
            touched[req.request_id] = None
        outs = self._finish_step(step.schedule, touched)
        if bad is not None:  # as the per-row sampler reports it; the others' outputs go out next call
            self._carried += outs
            raise FloatingPointError(f"request {bad.request_id}: non-finite logits at output token "
                                     f"{len(bad.output_token_ids)}")
        return outs

    def _run_step(self, schedule) -> list[RequestOutput]:
        batch, logits = self.runner.run(schedule)
        touched: dict[str, None] = {}
        for si in batch.prompt_logprob_seqs:  # (prompt rows are only made for these requests)
            req = schedule[si].req
            empty = torch.zeros(0, logits.shape[1])
            if si in batch.prompt_rows:
                prev = req.prompt_logits if req.prompt_logits is not None else empty
                req.prompt_logits = torch.cat([prev, logits[batch.prompt_rows[si]].float().cpu()])
            if req.prompt_logprobs is None and req.num_computed >= len(req.prompt_token_ids):
                # a 1-token prompt has no prompt rows at all: its prompt logprobs are just [None]
                rows = req.prompt_logits if req.prompt_logits is not None else empty
                req.prompt_logits = None
                req.prompt_logprobs = self.sampler.prompt_logprobs(req, rows)
        self._sample(schedule, batch, logits, touched)
        return self._finish_step(schedule, touched)

    def _finish_step(self, schedule, touched: dict) -> list[RequestOutput]:
        """After a step's tokens are appended: prefix-cache blocks, finished requests freed, outputs."""
        kv, remove = self.kv, self.scheduler.remove
        for sc in schedule:
            req = sc.req
            alloc = req.alloc
            if kv.has_new_full_blocks(alloc):  # the token list is only built when a block closed
                kv.register_full_blocks(alloc, req.all_token_ids)
            if req.finished:
                remove(req)
            else:
                kv.release_out_of_window(alloc)
            touched[req.request_id] = None
        requests, out = self.requests, []
        for rid in touched:
            group = requests.get(rid)
            if group is None:  # aborted
                continue
            finished = group[0].finished if len(group) == 1 else all(r.finished for r in group)
            # reported every step, or only at the end ("final_only")
            if finished or group[0].params.output_kind != "final_only":
                out.append(self._output(rid, group, finished))
        return out

    def _sample(self, schedule, batch, logits: torch.Tensor, touched: dict) -> None:
        """Append each sampled request's next token. Plain greedy rows are picked on the logits'
        device in one batched pick (the ``greedy_pick`` op); the other rows (and any non-finite one)
        are copied to the host at once and go through the sampler row by row."""
        rows = [(row, schedule[si].req) for row, si in batch.sample_rows]
        picked = {}
        if getattr(self.sampler, "batched_greedy", False):
            picked = greedy_picks(logits, [row for row, req in rows if plain_greedy(req)], self.greedy_pick)
        if len(picked) == len(rows):  # all picked on the device (a greedy decode step): no host rows
            for row, req in rows:
                req.append_token(picked[row], None, None)
                touched[req.request_id] = None
            return
        rest = [row for row, _ in rows if row not in picked]
        host = dict(zip(rest, logits[rest].float().cpu()))
        for row, req in rows:
            token, lp, tlp = (picked[row], None, None) if row in picked else self.sampler.sample(req, host[row])
            req.append_token(token, lp, tlp)
            touched[req.request_id] = None

    def _output(self, rid: str, group: list[Request], finished: bool) -> RequestOutput:
        first = group[0]
        out = RequestOutput(rid, first.prompt, first.prompt_token_ids, [r.completion() for r in group], finished,
                            prompt_logprobs=first.prompt_logprobs)
        if finished:
            del self.requests[rid]
        return out

    def run_to_completion(self, request_ids: list[str]) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        while pending and self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
        if self._inflight is not None and not self._inflight_live():  # read the step past the end now
            step, self._inflight = self._inflight, None
            self._carried += self._read_step(step)
        return done


def _fields(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in p.__dataclass_fields__ if k != "stop_strings"}
