"""The engine core: add requests, run steps (schedule → forward → sample), emit outputs.

A failure that belongs to requests never escapes ``step()``: the engine finishes those requests with
``finish_reason="error"`` (their output's ``error`` says what went wrong) and serves the others — a
sampling failure fails its own request, a failed forward the requests of its step. Only
``EngineDeadError`` (no step can run any more) is raised.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
import weakref

import torch

from ..model.opset import ATTENTION_OPS
from . import overlap
from .build import EngineParts, build_parts
from .errors import EngineDeadError, NonFiniteLogitsError, RequestError, context_budget
from .executor import Executor
from .outputs import RequestOutput
from .request import Drafts, Request, Status
from .runner import ModelRunner
from .sampler import greedy_picks, plain, plain_greedy
from .sampling_params import SamplingParams
from .settings import EngineConfig
from .spec_graphs import Sampling
from .speculative import DSparkProposer, SpecStats, StepRows, verify, verify_picks
from .stats import EngineStats
from .structured import GrammarCompiler, bitmask_rows

log = logging.getLogger("dsv4.engine")


def _graph_capturable(ops) -> bool:
    """Whether a CUDA graph can capture the batched attention with this op set: none of its ops is
    marked ``eager_only`` (``dsv4.model.opset.eager_only``: the torch ones, which read device values
    on the host), so with those the decode steps run eagerly."""
    return ops.paged_attention and not any(getattr(getattr(ops, op), "eager_only", False) for op in ATTENTION_OPS)


def _kernel_cache() -> str:
    from .. import env

    return str(env.kernel_cache_dir())


def _shutdown_executor(runner: ModelRunner, executor: Executor) -> None:
    """A multi-process engine's teardown: captured NCCL launches go before the process group does (a
    live graph hangs ``destroy_process_group``, pytorch#115388), then the workers stop."""
    if runner.graphs is not None:
        runner.graphs.release()
        runner.graphs = None
    executor.shutdown()


class LLMEngine:
    """Runs an engine's parts (``build.EngineParts``): add, abort, step. ``LLMEngine(config, model=...,
    tokenizer=..., executor=...)`` builds them (``build.build_parts`` says what each argument is);
    ``parts`` hands in parts already built. Its model runs through ``executor`` (``executor.Executor``:
    this process alone, or a multi-process one)."""

    def __init__(self, config: EngineConfig | None = None, model=None, tokenizer=None, executor=None, *,
                 parts: EngineParts | None = None):
        if parts is None:
            parts = build_parts(config, model=model, tokenizer=tokenizer, executor=executor)
        elif config is not None or model is not None or tokenizer is not None or executor is not None:
            raise TypeError("LLMEngine takes either its parts or what to build them from, not both")
        self.config, self.device, self.numerics = parts.config, parts.device, parts.numerics
        self.executor, self.model, self.ops = parts.executor, parts.model, parts.ops
        self.model_config = parts.model.cfg
        self.max_model_len = parts.max_model_len
        self.kv_cache, self.kv, self.scheduler, self.runner = parts.kv_cache, parts.kv, parts.scheduler, parts.runner
        self.tokenizer, self.sampler, self.proposer = parts.tokenizer, parts.sampler, parts.proposer
        if not self.executor.one_process:  # also when the engine is dropped or the interpreter exits without shutdown()
            self._finalizer = weakref.finalize(self, _shutdown_executor, self.runner, self.executor)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_id)
        self.spec_stats = SpecStats()
        self.spec_graphs = None  # SpecGraphs: the plain speculative steps as CUDA graphs
        self.requests: dict[str, list[Request]] = {}
        self._ids = itertools.count()
        self._inflight: overlap.InFlight | None = None  # async scheduling: the launched step not yet read
        self._carried: list[RequestOutput] = []  # async: a step() call's outputs so far
        self._stepping: list = []  # the schedule(s) of the step() call in progress (failed together)
        self.num_overlapped_steps = 0  # steps launched before the previous step's picks were read
        self._start(parts.phases, parts.started)

    def _start(self, phases: dict, t0: float) -> None:
        """Precompile, capture the CUDA graphs, warm up (each as the config asks); ``startup`` gets each
        phase's seconds (``dsv4 serve`` then freezes what start-up made out of the garbage collector)."""
        from ..ops import compiles

        config, device = self.config, self.device
        graphable = (device.type == "cuda" and not config.enforce_eager and self.runner.paged_attention
                     and _graph_capturable(self.ops))
        spec = self.proposer is not None
        capture = graphable and not spec  # (with speculation a step verifies drafts: the MTP step's graphs)
        capture_spec = graphable and spec and self.executor.one_process
        self.warm_up_report = self.precompile_report = None
        digest = None
        # (one process: data-parallel ranks and TP groups build in their warm-ups, each rank its own)
        if config.warm_up and device.type == "cuda" and not config.parallel and config.compile_workers != 0 \
                and compiles.install():
            from . import precompile

            t = time.perf_counter()
            digest = precompile.plan_digest(self)
            graphs = self._decode_graphs() if capture else self._spec_graphs() if capture_spec else None
            self.precompile_report = precompile.precompile(
                self, graphs, config.compile_workers or precompile.default_workers(), digest)
            phases["precompile"] = time.perf_counter() - t
        if capture:
            t = time.perf_counter()
            self.capture_decode_graphs()
            phases["decode_graphs"] = time.perf_counter() - t
        if capture_spec:
            t = time.perf_counter()
            self.capture_spec_graphs()
            phases["spec_graphs"] = time.perf_counter() - t
        if config.warm_up:
            from .warmup import run_warm_up

            t = time.perf_counter()
            self.warm_up_report = run_warm_up(self)
            phases["warm_up"] = time.perf_counter() - t
            if digest is not None:
                precompile.record_built(digest)
        self.startup = {**{k: round(v, 2) for k, v in phases.items()}, "total": round(time.perf_counter() - t0, 2),
                        "kernels_built": compiles.count()}
        log.info("dsv4 engine started in %.1f s (%s); %d kernel specializations built (kernel cache %s)",
                 self.startup["total"], ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()),
                 compiles.count(), _kernel_cache())

    def capture_decode_graphs(self) -> None:
        """CUDA graphs of the decode forward (``engine.cuda_graphs``), captured by the executor: with
        several processes every rank captures its own and each replay is announced to the workers. On
        the CPU the graphs are emulated (the same static inputs, run eagerly): how tests reach the path."""
        if not self.runner.paged_attention:
            raise RuntimeError("decode graphs need the batched paged attention (attention='batched')")
        self.runner.graphs = self.executor.capture_graphs(self.kv_cache, self.config.max_num_seqs, self.max_model_len)

    def capture_spec_graphs(self) -> None:
        """CUDA graphs of the speculative step (``engine.spec_graphs``); on the CPU emulated, as the
        decode graphs are."""
        if not self.runner.paged_attention or self.proposer is None:
            raise RuntimeError("speculative graphs need speculative decoding and the batched paged attention")
        self.spec_graphs = self._spec_graphs()
        self.spec_graphs.capture()

    def _spec_graphs(self):
        from .spec_graphs import SpecGraphs

        dspark = isinstance(self.proposer, DSparkProposer)
        return SpecGraphs(self.model, self.kv_cache, self.proposer.num_speculative_tokens, self.config.max_num_seqs,
                          self.max_model_len, self.ops.greedy_pick, method="dspark" if dspark else "mtp",
                          min_confidence=self.proposer.min_confidence if dspark else 0.0)

    def _decode_graphs(self):
        """A one-process engine's decode graphs, not captured (``precompile`` lists their launches)."""
        from .cuda_graphs import DecodeGraphs

        return DecodeGraphs(self.model, self.kv_cache, self.config.max_num_seqs, self.max_model_len)

    def shutdown(self) -> None:
        """Stop a multi-process engine's workers and leave the process group (nothing to do otherwise)."""
        if not self.executor.one_process:
            self._finalizer()

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
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
        max_new = context_budget(len(ids), params.max_tokens, self.max_model_len)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab})")
        guides = [None] * params.n
        if params.structured_outputs is not None:  # (an invalid grammar fails here, naming its field)
            guides = self.grammars.guides(params.structured_outputs, params.n)
        if params.max_tokens is None:
            params.max_tokens = max_new
        group = []
        for i in range(params.n):
            p = params
            if params.n > 1 and params.seed is not None:
                p = dataclasses.replace(params, seed=params.seed + i)
            detok = self.tokenizer.incremental_detokenizer(skip_special_tokens=params.skip_special_tokens)
            r = Request(rid, ids, p, prompt=prompt, index=i, eos_token_id=self.model_config.eos_token_id,
                        detokenizer=detok, guide=guides[i])
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

    @property
    def stats(self) -> EngineStats:
        """The queues and counters as of now (after a ``step()``: that step's), read from where they are
        kept, so a counter reset or changed between steps shows at once."""
        kv, sched, requests = self.kv, self.scheduler, self.requests
        host = kv.host
        queued = {r.request_id for r in sched.waiting}
        budget = kv.kvc.budget
        return EngineStats(
            running=len(sched.running), waiting=len(sched.waiting),
            waiting_ids=frozenset(rid for rid in queued
                                  if rid in requests and all(r.status is Status.WAITING for r in requests[rid])),
            kv_cache_usage=kv.usage(), kv_blocks=budget.num_blocks, kv_capacity_tokens=budget.capacity_tokens,
            prefix_cache_queries=kv.queries, prefix_cache_hits=kv.hits, preemptions=sched.num_preemptions,
            host_kv_cache_usage=len(host) / host.num_slots if host is not None else 0.0,
            host_prefix_cache_queries=kv.host_queries, host_prefix_cache_hits=kv.host_hits,
            host_offloaded_bytes=host.offloaded_bytes if host is not None else 0,
            host_restored_bytes=host.restored_bytes if host is not None else 0,
            spec_decode=copy.deepcopy(self.spec_stats) if self.proposer is not None else None)

    def _inflight_live(self) -> bool:
        """An in-flight step with a request still running (a step computed only for requests that
        have stopped since has nothing left to report)."""
        step = self._inflight
        return step is not None and any(not sc.req.finished for sc in step.schedule)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns outputs of requests that progressed (and of
        requests that failed: finished, ``error`` set). With ``async_scheduling`` a step of plain greedy
        samples is read one call later (``_step_async``)."""
        self._stepping = []
        try:
            if self.config.async_scheduling:
                return self._step_spec_async() if self.spec_graphs is not None else self._step_async()
            schedule = self._schedule()
            return self._run_step(schedule) if schedule else []
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - a failure of requests, not of the engine
            return self._fail_step(e)

    def _schedule(self):
        schedule = self.scheduler.schedule()
        self._stepping.append(schedule)
        return schedule

    def _fail_step(self, e: Exception) -> list[RequestOutput]:
        """Finish the requests a failed step belongs to with an error: those a ``RequestError`` carries,
        else every request of this call's schedules (for a failure inside ``schedule()``: the running
        requests and the first waiting one)."""
        names = [rid for rid in e.request_ids if rid in self.requests] if isinstance(e, RequestError) else []
        if not names:
            names = [sc.req.request_id for schedule in self._stepping for sc in schedule]
        if not names:
            sched = self.scheduler
            names = [r.request_id for r in sched.running] + [r.request_id for r in list(sched.waiting)[:1]]
        names = list(dict.fromkeys(n for n in names if n in self.requests))
        log.error(
            "engine step failed; failing %d request(s) %s: %s: %s",
            len(names),
            ", ".join(names),
            type(e).__name__,
            e,
            exc_info=e,
        )
        for rid in names:
            for r in self.requests[rid]:
                overlap.drop_placeholder(r)
                if not r.finished:
                    r.fail(e)
                self.scheduler.remove(r)
        if self._inflight is not None and all(sc.req.finished for sc in self._inflight.schedule):
            self._inflight = None
        outs, self._carried = self._carried, []
        return outs + self._outputs(dict.fromkeys(names))

    def _step_async(self) -> list[RequestOutput]:
        """Launch the next step (token ids of requests still decoding taken from the in-flight step's
        picks on the device), then read the in-flight step: the host's work overlaps the GPU's. A
        step that cannot stay on the device runs synchronously once the in-flight one is read.
        Outputs are gathered in ``_carried`` first, so a step that fails after reading the in-flight
        one loses none of them."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            overlap.add_placeholders(prev)
            self._stepping.append(prev.schedule)
        try:
            schedule = self._schedule()
            nxt = None
            if schedule and self.proposer is None and overlap.deferrable(schedule, self.sampler):
                nxt = overlap.launch(self.runner, schedule, prev, self.ops.greedy_pick)
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

    def _step_spec_async(self) -> list[RequestOutput]:
        """Async scheduling with the speculative graphs: while the batch stays the same the next graph
        step is launched from the graph's own next inputs before the in-flight one is read, so the
        host's reading overlaps the device's next step; otherwise the in-flight step is read, then
        the next one scheduled (a graph step stays in flight; any other runs now)."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._stepping.append(prev.schedule)
            nxt = self._continue_spec(prev)
            if nxt is not None:
                nxt.after = prev
                self._inflight = nxt  # before reading prev: an error there must not lose the launched step
                self.num_overlapped_steps += 1
            self._carried += self._read_spec(prev)
            if nxt is not None:
                outs, self._carried = self._carried, []
                return outs
        schedule = self._schedule()
        if schedule:  # the graph part stays in flight; the rest (prefills, sampled requests) runs now
            self._inflight, rest = self._run_spec_step(schedule)
            if rest:
                self._carried += self._run_step(rest, graphs=False)
        outs, self._carried = self._carried, []
        return outs

    def _read_inflight(self, step) -> list[RequestOutput]:
        return self._read_spec(step) if self.spec_graphs is not None else self._read_step(step)

    def _read_step(self, step: overlap.InFlight) -> list[RequestOutput]:
        """Apply an in-flight step's greedy picks (each replacing its request's placeholder, if any);
        a non-finite row fails its request."""
        toks, fins = overlap.read_picks(step)
        touched: dict[str, None] = {}
        for row, si in step.batch.sample_rows:
            req = step.schedule[si].req
            overlap.drop_placeholder(req)
            if req.finished:  # aborted (or failed) while in flight
                continue
            if not fins[row]:
                req.fail(NonFiniteLogitsError.at(req.request_id, len(req.output_token_ids)))
            else:
                req.append_token(toks[row], None, None)
            touched[req.request_id] = None
        return self._finish_step(step.schedule, touched)

    def _run_step(self, schedule, graphs: bool = True) -> list[RequestOutput]:
        if graphs and self.spec_graphs is not None:  # the graph part on the device while the rest runs eagerly
            launched, rest = self._run_spec_step(schedule)
            if launched is not None:
                outs = self._run_step(rest, graphs=False) if rest else []
                return outs + self._read_spec(launched)
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
                try:
                    req.prompt_logprobs = self.sampler.prompt_logprobs(req, rows)
                except Exception as e:  # noqa: BLE001 - this request's failure only
                    req.fail(e)
                    touched[req.request_id] = None
        self._sample(schedule, batch, logits, touched)
        if self.proposer is not None:
            self._propose(schedule, batch)
        return self._finish_step(schedule, touched)

    def _finish_step(self, schedule, touched: dict) -> list[RequestOutput]:
        """After a step's tokens are appended: prefix-cache blocks, finished requests freed, outputs."""
        kv, remove = self.kv, self.scheduler.remove
        for sc in schedule:
            req = sc.req
            alloc = req.alloc
            if req.finish_reason != "error" and kv.has_new_full_blocks(alloc):  # (built only when a block closed)
                kv.register_full_blocks(alloc, req.all_token_ids)
            if req.finished:
                remove(req)
            else:
                kv.release_out_of_window(alloc)
            touched[req.request_id] = None
        return self._outputs(touched)

    def _outputs(self, touched: dict) -> list[RequestOutput]:
        """The outputs of the requests that advanced (every step, or only finished ones for
        ``final_only``); a request one of whose sequences failed ends with the others aborted."""
        requests, out, remove = self.requests, [], self.scheduler.remove
        for rid in touched:
            group = requests.get(rid)
            if group is None:  # aborted
                continue
            if any(r.finish_reason == "error" for r in group):  # one sequence failed: the request failed
                for r in group:
                    if not r.finished:
                        r.finish("abort")
                        remove(r)
            finished = group[0].finished if len(group) == 1 else all(r.finished for r in group)
            if finished or group[0].params.output_kind != "final_only":
                out.append(self._output(rid, group, finished))
        return out

    def _sample(self, schedule, batch, logits: torch.Tensor, touched: dict) -> None:
        """Append each sampled request's next token(s). Plain greedy rows are picked on the logits'
        device in one batched pick (the ``greedy_pick`` op); the other rows (and any non-finite one)
        are copied to the host at once and go through the sampler row by row, with their grammar's
        bitmask (computed first: on a GPU, while the step is still running); a request with drafts
        has its verify rows checked in order (``speculative.verify``) and its chunk committed with the
        tokens that stay. A row whose sampling fails fails its request."""
        drafted = batch.draft_counts
        rows = [(row, schedule[si].req, si) for row, si in batch.sample_rows]
        span = {row: range(row, row + 1 + drafted.get(si, 0)) for row, _, si in rows}  # a verify chunk's rows
        picked = {}
        if getattr(self.sampler, "batched_greedy", False):
            picked = greedy_picks(logits, [r for row, req, si in rows if plain_greedy(req) for r in span[row]],
                                  self.ops.greedy_pick)
        on_device = {row for row, _, _ in rows if all(r in picked for r in span[row])}
        if len(on_device) == len(rows) and not drafted:  # a greedy decode step: no host rows
            for row, req, _ in rows:
                req.append_token(picked[row], None, None)
                touched[req.request_id] = None
            return
        guided = [(row, req) for row, req, si in rows
                  if req.guide is not None and not req.finished and si not in drafted]
        masks = dict(zip((row for row, _ in guided), bitmask_rows([req.guide for _, req in guided],
                                                                   self.model_config.vocab_size)))
        rest = [r for row, _, _ in rows if row not in on_device for r in span[row]]
        host = dict(zip(rest, logits[rest].float().cpu())) if rest else {}
        kept = {}  # verified chunks: schedule index → tokens its cache keeps
        for row, req, si in rows:
            touched[req.request_id] = None
            if req.finished:  # failed earlier this step (its prompt logprobs)
                continue
            try:
                if si in drafted:
                    drafts, req.drafts = req.drafts, Drafts()
                    drafts.truncate(drafted[si])
                    if row in on_device:
                        n_ok = verify_picks(req, [picked[r] for r in span[row]], drafts, self.spec_stats)
                    else:
                        n_ok = verify(self.sampler, req, torch.stack([host[r] for r in span[row]]), drafts,
                                      self.model_config.vocab_size, self.spec_stats)
                    kept[si] = n_ok
                elif row in on_device:
                    req.append_token(picked[row], None, None)
                else:
                    req.append_token(*self.sampler.sample(req, host[row], mask=masks.get(row)))
            except Exception as e:  # noqa: BLE001 - this request's failure only
                req.fail(e)
        if kept:
            self.runner.commit(batch, kept)

    def _graph_part(self, schedule) -> tuple[list, list]:
        """(the chunks a speculative graph step takes: plain decodes (greedy, or sampled when the sampled
        graphs exist) with drafts within the graphs' reach, their window pages taken for the drafter;
        the others, for the eager path)."""
        g, kv = self.spec_graphs, self.kv
        k = g.k
        part, rest = [], []
        for sc in schedule:
            req = sc.req
            s = req.alloc.num_computed
            ok = (s == req.num_tokens - 1 and 1 <= sc.num_tokens <= k + 1 and sc.num_tokens - 1 <= len(req.drafts)
                  and plain(req) and (g.sampled or req.params.greedy) and req.params.prompt_logprobs is None
                  and s + g.reach <= self.max_model_len
                  and (req.params.greedy or req.drafts.probs is not None or sc.num_tokens == 1))
            (part if ok else rest).append(sc)
        # the drafter writes its windows up to ``reach`` positions past the computed tokens
        if part and (g.bucket(len(part)) is None or not all(kv.try_allocate(sc.req.alloc, g.reach) for sc in part)):
            return [], schedule
        return part, rest

    def _launch_spec(self, part):
        """Replay ``spec_graphs`` for ``part`` (``_graph_part``'s first list): a ``spec_graphs.Launched``,
        or None if no graph takes it."""
        self.kv.wait_copies()
        reqs = [sc.req for sc in part]
        tokens = [req.token_slice(req.alloc.num_computed, req.num_tokens) + req.drafts.tokens[:sc.num_tokens - 1]
                  for req, sc in zip(reqs, part)]
        sampling = [None if r.params.greedy else
                    Sampling(self._sampling_settings(r), self._uniforms(r), (r.drafts.probs or [])[:sc.num_tokens - 1])
                    for r, sc in zip(reqs, part)]
        return self.spec_graphs.launch(part, [r.alloc.num_computed for r in reqs], tokens,
                                       [r.params.max_tokens - len(r.output_token_ids) for r in reqs], sampling)

    @staticmethod
    def _sampling_settings(req) -> tuple[float, float, float, float]:
        p = req.params
        return float(p.temperature), float(max(p.top_k, 0)), float(p.top_p), float(p.min_p)

    def _uniforms(self, req) -> list[float]:
        """A sampled request's uniforms for one graph step, from its generator."""
        gen = self.sampler.generator_of(req)
        return torch.rand(self.spec_graphs.uniforms, generator=gen, dtype=torch.float64).tolist()

    def _run_spec_step(self, schedule) -> tuple[object, list]:
        """A step's graph part launched (or None) and the chunks left to the eager path."""
        part, rest = self._graph_part(schedule)
        launched = self._launch_spec(part) if part else None
        return launched, (rest if launched is not None else schedule)

    def _continue_spec(self, prev):
        """The graph step after the in-flight ``prev`` (async scheduling), launched before ``prev`` is read:
        only while the batch stays as it is — nobody waiting, every request still decoding, its pages
        taken for both steps' chunks and drafts (≤ k + 1 + ``reach`` tokens past what the host has
        computed); else None."""
        g, k = self.spec_graphs, self.spec_graphs.k
        ahead = k + 1 + g.reach
        if self.scheduler.waiting or len(self.scheduler.running) != len(prev.schedule) \
                or any(sc.req.finished for sc in prev.schedule):
            return None
        if prev.after is not None and any(sc.req.request_id not in prev.after.consistent for sc in prev.schedule):
            return None  # prev computed a request from inputs its host state no longer matches
        for sc in prev.schedule:
            a = sc.req.alloc
            if a.num_computed + ahead > self.max_model_len or not self.kv.try_allocate(a, ahead):
                return None
        self.kv.wait_copies()
        uniforms = [self._uniforms(sc.req) if prev.sampled and not sc.req.params.greedy else None
                    for sc in prev.schedule]
        return g.continue_step(prev.schedule, uniforms, prev.sampled)

    def _read_spec(self, launched) -> list[RequestOutput]:
        """Apply a graph step's results: each request's verified tokens (``verify_picks``: the eager
        path's walk), its cache advanced by them, and the drafts the graph made for its next step."""
        g, kv = self.spec_graphs, self.kv
        k = g.k
        touched: dict[str, None] = {}
        for i, (sc, row) in enumerate(zip(launched.schedule, launched.rows())):
            req = sc.req
            if req.finished:  # aborted or failed while in flight, or stopped at the step before
                continue
            touched[req.request_id] = None
            if launched.after is not None and req.request_id not in launched.after.consistent:
                continue  # the step before left it elsewhere than the graph assumed: computed for nothing
            picks, fins, acc, new, conf = g.read_row(row)
            drafts, req.drafts = req.drafts, Drafts()  # (the ones this step verified: the scheduler's cut)
            d = len(drafts)
            if not all(fins[:d + 1]):
                req.fail(NonFiniteLogitsError.at(req.request_id, len(req.output_token_ids)))
                continue
            try:
                n_ok = verify_picks(req, picks[:d + 1], drafts, self.spec_stats)
            except Exception as e:  # noqa: BLE001 - this request's failure only
                req.fail(e)
                continue
            kv.view(req.alloc).advance(n_ok)
            if not req.finished and n_ok == acc + 1:  # (as the graph's next inputs have it)
                launched.consistent.add(req.request_id)
                want = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
                if conf is not None:  # the drafts end before the first below the confidence cut
                    want = min(want, next((i for i, c in enumerate(conf) if c < g.min_confidence), k))
                if want > 0:
                    probs = None if req.params.greedy else list(launched.probs[i, :want])
                    req.drafts = Drafts(new[:want], probs, None if conf is None else conf[:want])
        return self._finish_step(launched.schedule, touched)

    def _propose(self, schedule, batch) -> None:
        """The proposer's turn, after verification: every row that stays in the cache feeds it, and
        each request that goes on decoding gets up to ``num_speculative_tokens`` drafts (fewer near
        its max_tokens; none when its draft pages cannot be had without preempting)."""
        k = self.proposer.num_speculative_tokens
        sampled = {si for _, si in batch.sample_rows}
        rows = []
        for si, sc in enumerate(schedule):
            req, c = sc.req, batch.step.chunks[si]
            if req.finished:
                continue
            n_valid = req.alloc.num_computed - c.start
            want = 0
            if si in sampled:
                want = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
                if want > 0 and not self.kv.try_allocate(req.alloc, self.proposer.ahead(want)):
                    want = self.proposer.without_pages  # its drafts' window pages cannot be had
            rows.append(StepRows(req, c, n_valid, max(0, want)))
        if rows:
            self.proposer.propose(rows, batch.streams)

    def _output(self, rid: str, group: list[Request], finished: bool) -> RequestOutput:
        first = group[0]
        failed = next((r.exception for r in group if r.exception is not None), None)
        out = RequestOutput(
            rid,
            first.prompt,
            first.prompt_token_ids,
            [r.completion(delta=r.params.output_kind == "delta") for r in group],
            finished,
            prompt_logprobs=first.prompt_logprobs,
            exception=failed,
        )
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
            self._carried += self._read_inflight(step)
        return done


__all__ = ["LLMEngine", "EngineConfig", "RequestError", "EngineDeadError"]
