"""The engine loop of the server: one thread owns the (synchronous, not thread-safe) LLMEngine.

HTTP handlers never touch the engine. They send commands (add, abort, call) through a
thread-safe queue; the engine thread applies them between steps, runs ``step()`` while there is
work, and hands each request's outputs back to the handler's event loop with
``loop.call_soon_threadsafe`` onto a per-request asyncio queue. Outputs are deltas (the text,
token ids and logprobs a step added: ``SamplingParams.output_kind="delta"``), so a step's output
costs what it adds; a slow consumer gets the deltas queued for it joined into one.

Failure isolation, because one bad request must not hurt the others:

* the engine finishes a request it could not run (its sampling failed, its step failed) with an
  error (``RequestOutput.error``): that request gets a 500, the others are served on;
* an exception that still escapes ``step()`` (an engine bug) fails every request in flight with a
  500, and the loop keeps serving;
* a request the engine rejects in ``add_request`` gets a 400 with the engine's message;
* a dead engine (:class:`~dsv4.engine.errors.EngineDeadError`: a tensor-parallel rank died or timed
  out) fails every in-flight request, refuses new ones with a 503 and calls ``on_dead`` (the
  server then exits) — no step can run any more.

Liveness: the loop beats after every step and every idle wait (a quarter second); ``stalled()`` says
when it has not beaten for ``stall_timeout`` seconds (a step stuck in a collective of a stopped
rank), and ``/health`` then answers 503. Shutdown: ``drain()`` refuses new requests and
``fail_open_streams()`` ends the ones still open with an error, from the event loop, so it works
even when the engine thread is stuck.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine.errors import EngineDeadError
from ..engine.outputs import RequestOutput, merge_delta
from ..engine.sampling_params import SamplingParams
from ..engine.stats import EngineStats

log = logging.getLogger("dsv4.serve")


class EngineRequestError(Exception):
    """A request failed in (or was refused by) the engine; ``status`` is the HTTP status to send.
    ``public``: the message is for the client as it is (a shutdown), not only for the log."""

    def __init__(self, status: int, message: str, public: bool = False):
        super().__init__(message)
        self.status, self.message, self.public = status, message, public


_ABORTED = object()  # wakes a consumer whose stream was aborted


class RequestStream:
    """The handler's end of one request: ``async for out in stream`` yields delta RequestOutputs (what
    was added since the one before; ``outputs.DeltaAccumulator`` rebuilds the whole).

    Iteration stops after the finished output; an engine-side failure is raised as
    :class:`EngineRequestError`. ``abort()`` (idempotent) tells the engine to drop the request and
    free its pages; call it whenever the consumer stops early (client gone, error).
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner: "AsyncEngine"):
        self.request_id = request_id
        self.arrival = time.monotonic()
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._owner = owner

    def _put(self, item) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed (server shutting down)
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and not isinstance(item, EngineRequestError) and item is not _ABORTED:
            more = self._queue.get_nowait()  # deltas queued meanwhile: joined into one
            item = more if isinstance(more, EngineRequestError) or more is _ABORTED else merge_delta(item, more)
        if item is _ABORTED:
            raise StopAsyncIteration
        if isinstance(item, EngineRequestError):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Drop the request (idempotent; call on the handler's loop). A pending ``__anext__`` stops."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)
            self._queue.put_nowait(_ABORTED)

    def fail(self, status: int, message: str, public: bool = False) -> None:
        """End the stream with an error (on the handler's loop, without the engine thread) and drop the request."""
        if not self.finished:
            self._queue.put_nowait(EngineRequestError(status, message, public))
            self._owner.abort(self.request_id)


@dataclass
class _Track:
    """Engine-thread bookkeeping of one request for metrics (monotonic times)."""

    arrival: float
    prompt_len: int
    scheduled: float | None = None  # the start of the step that first scheduled it
    first: float | None = None
    last: float | None = None  # the latest output with new tokens
    generated: int = 0


@dataclass
class LoopStats:
    """What the engine thread counts of its own (read by tests), and the engine's last snapshot."""

    engine: EngineStats = field(default_factory=EngineStats)  # published after every loop pass
    steps: int = 0
    aborted: int = 0
    failed: int = 0


def _counters(s: EngineStats) -> tuple[int, ...]:
    """Prefix-cache queries and hits, preemptions; the host tier's queries, hits, bytes out and in."""
    return (s.prefix_cache_queries, s.prefix_cache_hits, s.preemptions, s.host_prefix_cache_queries,
            s.host_prefix_cache_hits, s.host_offloaded_bytes, s.host_restored_bytes)


def _increments(now: tuple[int, ...], before: tuple[int, ...]) -> list[int]:
    """Counter increments; a counter that went down was reset (a warm-up): counted from zero."""
    return [c - p if c >= p else c for c, p in zip(now, before)]


class AsyncEngine:
    """Runs an LLMEngine in one background thread and multiplexes many concurrent requests onto it."""

    def __init__(self, engine, metrics=None, *, max_model_len: int | None = None, stats_log=None,
                 stall_timeout: float = 0.0, log_prompts: bool = False, max_log_len: int | None = None):
        """``stats_log``: a :class:`~dsv4.serve.metrics.StatsLog` (the periodic stats line), or None.
        ``stall_timeout``: seconds without loop progress after which ``stalled()`` reports (0: never).
        ``log_prompts``: log every request's prompt and parameters as it is added (vLLM's
        ``--enable-log-requests``), the prompt cut to ``max_log_len`` characters or token ids."""
        self.engine = engine
        self.metrics = metrics
        self.stats_log = stats_log
        self.stall_timeout = stall_timeout
        self.log_prompts, self.max_log_len = log_prompts, max_log_len
        self.max_model_len = max_model_len or engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.stats = LoopStats()
        self.dead: str | None = None  # set if the loop itself died, or the engine did (EngineDeadError)
        self.on_dead: Callable[[], None] | None = None  # called once the engine is dead (serve: exit)
        self.draining = False  # shutting down: new requests are refused
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._open: weakref.WeakSet[RequestStream] = weakref.WeakSet()  # loop side: every unfinished stream
        self._tracks: dict[str, _Track] = {}
        self._unscheduled: set[str] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()
        self._newly_scheduled = 0

    # ---- lifecycle (any thread) -----------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._beat = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._cmds.put(("stop",))
            self._thread.join(timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        """The loop runs and the engine is not dead (requests are accepted)."""
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def alive(self) -> bool:
        """Running and making progress (what ``/health`` reports)."""
        return self.running and self.stalled() is None

    def stalled(self) -> str | None:
        """Why the loop counts as stuck (work waits on it and no step or command pick-up finished for
        ``stall_timeout`` s), or None. An idle loop is healthy however long the OS left it unscheduled: on a
        loaded host the idle wait can overrun, and that must not turn /health 503."""
        if not self.stall_timeout or self._thread is None:
            return None
        if not self._streams and self._cmds.empty():
            return None
        quiet = time.monotonic() - self._beat
        if quiet <= self.stall_timeout:
            return None
        return (f"the engine has made no progress for {quiet:.0f} s with {len(self._streams)} request(s) in "
                f"flight (--engine-stall-timeout {self.stall_timeout:g})")

    def health(self) -> str | None:
        """None when healthy, else what is wrong (for ``/health``'s 503)."""
        if self.dead:
            return "the engine stopped after a failure; see the server log"  # (its text may name hosts, paths)
        if not self.running:
            return "the engine is not running"
        return self.stalled()

    # ---- shutdown (event-loop side) -------------------------------------------------------------
    def drain(self) -> None:
        """Refuse new requests from now on (503); those in flight run on."""
        self.draining = True

    @property
    def open_streams(self) -> int:
        return sum(not s.finished for s in self._open)

    def fail_open_streams(self, status: int, message: str) -> int:
        """End every unfinished stream with an error the client sees as it is (a shutdown's) and abort its
        request; returns how many."""
        streams = [s for s in self._open if not s.finished]
        for s in streams:
            s.fail(status, message, public=True)
        return len(streams)

    # ---- handler API (event-loop side) ----------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *, prompt: str | None = None,
                    request_id: str | None = None) -> RequestStream:
        """Queue a request; the returned stream yields its outputs. Must be called on an event loop."""
        if not self.running:
            raise EngineRequestError(503, f"the engine is not running{': ' + self.dead if self.dead else ''}")
        if self.draining:
            raise EngineRequestError(503, "the server is shutting down", public=True)
        rid = request_id or self.new_request_id()
        if self.log_prompts:
            n = self.max_log_len
            log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", rid,
                     prompt if prompt is None or n is None else prompt[:n], params,
                     list(prompt_token_ids)[:n] if n is not None else list(prompt_token_ids))
        stream = RequestStream(rid, asyncio.get_running_loop(), self)
        self._open.add(stream)
        params = dataclasses.replace(params, output_kind="delta")
        self._cmds.put(("add", stream, prompt, list(prompt_token_ids), params))
        return stream

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps (the only safe way to read its state)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", fn, fut))
        return fut

    async def run(self, fn: Callable[[Any], Any]):
        return await asyncio.wrap_future(self.call(fn))

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - recorded for /health, then re-raised
            self.dead = f"{type(e).__name__}: {e}"
            log.critical("engine loop died: %s", self.dead)
            raise

    def _loop(self) -> None:
        log.debug("engine loop started")
        self.stats.engine = self.engine.stats  # (counters count from here)
        while True:
            try:
                if not self._drain(block=not self.engine.has_unfinished_requests()):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
                self._beat = now = time.monotonic()
                if self.stats_log is not None:
                    s = self.stats.engine
                    self.stats_log.maybe_log(now, s.running, s.waiting, s.kv_cache_usage)
            except EngineDeadError as e:  # a tensor-parallel rank is gone: nothing can run any more
                self._engine_died(e)
                break
            except Exception as e:  # noqa: BLE001 - keep serving; fail what was in flight
                log.exception("engine loop error")
                for rid in list(self._streams):
                    self._fail(rid, 500, f"engine loop error: {type(e).__name__}: {e}")
        for rid in list(self._streams):
            self._fail(rid, 503, "the server is shutting down", public=True)
        log.debug("engine loop stopped")

    def _engine_died(self, e: EngineDeadError) -> None:
        self.dead = f"{type(e).__name__}: {e}"
        log.critical("the engine is dead, failing %d request(s): %s", len(self._streams), e)
        for rid in list(self._streams):
            self._fail(rid, 500, f"the engine died: {e}")
        if self.on_dead is not None:
            try:
                self.on_dead()
            except Exception:  # noqa: BLE001
                log.exception("on_dead callback failed")

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; waits for one when idle. Returns False on stop."""
        try:
            cmd = self._cmds.get(timeout=0.25) if block else self._cmds.get_nowait()
        except queue.Empty:
            return True
        self._beat = time.monotonic()  # the loop is alive: a stall counts from here, not from an idle wait
        while True:
            kind = cmd[0]
            if kind == "stop":
                return False
            try:
                if kind == "add":
                    self._add(*cmd[1:])
                elif kind == "abort":
                    self._abort(cmd[1])
                elif kind == "call":
                    fn, fut = cmd[1], cmd[2]
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(self.engine))
                        except BaseException as e:  # noqa: BLE001 - handed to the caller
                            fut.set_exception(e)
            except Exception:  # noqa: BLE001 - one bad command must not stop the loop
                log.exception("engine command %s failed", kind)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _add(self, stream: RequestStream, prompt, ids, params) -> None:
        if stream.finished:  # aborted before it reached the engine
            return
        try:
            self.engine.add_request(prompt, params, request_id=stream.request_id, prompt_token_ids=ids)
        except ValueError as e:
            stream._put(EngineRequestError(400, str(e)))
            return
        except Exception as e:  # noqa: BLE001
            log.exception("add_request failed")
            stream._put(EngineRequestError(500, f"could not add the request: {type(e).__name__}: {e}"))
            return
        self._streams[stream.request_id] = stream
        self._tracks[stream.request_id] = _Track(stream.arrival, len(ids))
        self._unscheduled.add(stream.request_id)

    def _abort(self, rid: str) -> None:
        self._streams.pop(rid, None)
        if rid in self._tracks:  # added and not yet finished
            self.engine.abort_request(rid)
            self.stats.aborted += 1
            self._end_track(rid, "abort", time.monotonic())

    def _fail(self, rid: str, status: int, message: str, public: bool = False) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:  # noqa: BLE001 - the request is being dropped anyway
            log.exception("abort of failed request %s", rid)
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream._put(EngineRequestError(status, message, public))
        self.stats.failed += 1
        self._end_track(rid, "error", time.monotonic())

    def _step(self) -> None:
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise  # not this step's requests' fault: the loop fails them all and stops
        except Exception as e:  # noqa: BLE001 - the engine fails requests itself; this is a bug in it
            log.exception("engine step raised; failing every request in flight (%d)", len(self._streams))
            for rid in list(self._streams):
                self._fail(rid, 500, f"the engine failed while running this request: {type(e).__name__}: {e}")
            return
        self.stats.steps += 1
        now = time.monotonic()
        self._mark_scheduled(start)
        for out in outputs:
            rid = out.request_id
            if out.error is not None:
                log.error("request %s failed in the engine: %s", rid, out.error)
                self._fail(rid, 500, f"the engine failed while running this request: {out.error}")
                continue
            self._track(out, now)
            stream = self._streams.get(rid)
            if stream is not None:
                stream._put(out)
            if out.finished:
                self._streams.pop(rid, None)

    # ---- metrics (engine thread) ----------------------------------------------------------------
    def _mark_scheduled(self, step_start: float) -> None:
        """Requests a step took out of the waiting queue: their queue time ends at the step's start."""
        if not self._unscheduled:
            return
        waiting, n = self.engine.stats.waiting_ids, 0
        for rid in list(self._unscheduled):
            if rid not in waiting:
                self._unscheduled.discard(rid)
                t = self._tracks.get(rid)
                if t is not None:
                    t.scheduled = step_start
                    n += 1
        self._newly_scheduled = n

    def _track(self, out: RequestOutput, now: float) -> None:
        t = self._tracks.get(out.request_id)
        if t is None:
            return
        new = sum(len(o.token_ids) for o in out.outputs)  # (a delta)
        if new:
            prompt = t.prompt_len if t.first is None else 0  # counted once its prefill is done, as vLLM does
            if self.metrics is not None:
                self.metrics.tokens(prompt, new)
                if t.first is None:
                    self.metrics.first_token(now - t.arrival)
                else:
                    self.metrics.inter_token(now - t.last)
            if self.stats_log is not None:
                self.stats_log.tokens(prompt, new)
            if t.first is None:
                t.first = now
                if t.scheduled is None:
                    t.scheduled = t.arrival
                    self._unscheduled.discard(out.request_id)
            t.last = now
            t.generated += new
        if out.finished:
            self._end_track(out.request_id, out.outputs[0].finish_reason or "stop", now)

    def _end_track(self, rid: str, reason: str, now: float) -> None:
        t = self._tracks.pop(rid, None)
        self._unscheduled.discard(rid)
        if t is None or self.metrics is None:
            return
        ran = t.scheduled is not None
        self.metrics.finished(
            reason, e2e=now - t.arrival, prompt_tokens=t.prompt_len, generation_tokens=t.generated,
            queue=t.scheduled - t.arrival if ran else None,
            prefill=((t.first if t.first is not None else now) - t.scheduled) if ran else None,
            decode=(now - t.first) if t.first is not None else None)

    def _publish(self) -> None:
        try:
            before, now = self.stats.engine, self.engine.stats
            self.stats.engine = now
            delta = _increments(_counters(now), _counters(before))
            if self.stats_log is not None:
                self.stats_log.prefix(self._newly_scheduled, delta[0], delta[1])
            self._newly_scheduled = 0
            if self.metrics is None:
                return
            if not now.ranks:
                self.metrics.scheduler_state(now.waiting, now.running, now.kv_cache_usage, now.host_kv_cache_usage)
                self.metrics.engine_counters(*delta)
                if now.spec_decode is not None:
                    self.metrics.spec_decode(now.spec_decode)
                return
            # a data-parallel engine: each rank's queues, KV-cache usage and counters under its own ``engine``
            # label (as vLLM's ``--data-parallel-size``)
            for r, st in enumerate(now.ranks):
                prev = before.ranks[r] if r < len(before.ranks) else EngineStats()
                self.metrics.scheduler_state(st.waiting, st.running, st.kv_cache_usage, engine=r)
                self.metrics.engine_counters(*_increments(_counters(st)[:3], _counters(prev)[:3]), engine=r)
        except Exception:  # noqa: BLE001 - metrics must never stop the loop
            log.exception("publishing engine stats failed")
