"""``dsv4 probe``: the evidence-chain probe of a bring-up, stage by stage.

Stages (each printed as it runs, each in the JSON report):

1. ``env`` — devices, platform profile, FP8 encoding, Triton, how the backend resolves.
2. ``config`` — the layer schedule (SWA / CSA / HCA, hash layers, MTP) and the key sizes.
3. ``checkpoint`` — key count, dtypes, expert dtype, validation against the config's inventory.
4. ``engine init`` — the engine (weights, KV cache size in tokens, ops).
5. ``generate`` — every prompt alone (batch size 1): TOKEN_IDS, TOKEN_DECODE (each token decoded
   with special tokens), FINISH_REASON, OUTPUT_REPR and a verdict computed from the token ids.
6. ``batch consistency`` — the prompts again at every other batch size: a first token or an output
   that differs from the batch-size-1 run is a FAIL (NaNs only at batch 8 were a real failure).
7. ``repeat`` — the largest batch again: outputs must be identical run to run.
8. ``reference agreement`` — each batch-1 output against the dense-cache reference model run
   teacher-forced in the same numerics (:mod:`dsv4.validate.oracle`): catches the deterministic
   wrong cache reader that gives *consistent* garbage.
9. ``golden`` — with ``--expect FILE``: the tokens must equal a recorded run (``--record FILE``).
   This is what catches a fault the oracle shares with the engine (e.g. a wrong activation).
10. ``validate`` — with ``--validate``: the first layer/op that produced a non-finite value.

Logits are checked finite on every engine step (and the sampler's ``FloatingPointError`` is caught
and reported). The verdict is PASS only when no stage failed; ``dsv4 probe`` exits 0 only on PASS.
Decoding is greedy with ``ignore_eos`` and ``max_tokens ≥ 2`` — the first token comes from
prefill, and a broken decode only shows from the second token on.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from .. import env
from .verdict import SequenceVerdict, VerdictConfig, judge_tokens

GOLDEN_FORMAT = "dsv4-probe-golden/1"


# ---- prompts --------------------------------------------------------------------------------------
@dataclass
class PromptSpec:
    kind: str  # "chat": rendered with the DeepSeek-V4 chat encoding (LLM.chat); "raw": LLM.generate
    text: str | None = None
    messages: list[dict] | None = None

    def __post_init__(self):
        if self.kind not in ("chat", "raw"):
            raise ValueError(f"prompt kind must be 'chat' or 'raw', got {self.kind!r}")
        if self.kind == "chat" and self.messages is None:
            if self.text is None:
                raise ValueError("a chat prompt needs text or messages")
            self.messages = [{"role": "user", "content": self.text}]
        if self.kind == "raw" and not isinstance(self.text, str):
            raise ValueError("a raw prompt needs text")

    def label(self) -> str:
        shown = self.text if self.text is not None else self.messages[-1].get("content", "")
        return f"{self.kind} {shown!r}" if len(self.messages or []) <= 1 else f"chat ({len(self.messages)} messages)"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "text": self.text, "messages": self.messages}


DEFAULT_PROMPTS = (
    PromptSpec("chat", "你好，请介绍一下你自己。"),
    PromptSpec("chat", "What is 17 + 25? Answer briefly."),
    PromptSpec("raw", "The capital of France is"),
    PromptSpec("raw", "def fibonacci(n):"),
)


def load_prompts(path: str | os.PathLike) -> list[PromptSpec]:
    """Prompts from a file.

    ``.json``: a list whose items are strings (raw), ``{"chat": text}``, ``{"raw": text}``,
    ``{"messages": [...]}`` or ``{"kind": "chat"|"raw", "text": ...}``. Any other file: one prompt
    per line, ``chat:`` / ``raw:`` prefixes choose the kind (default raw); blank lines and lines
    starting with ``#`` are skipped.
    """
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    out: list[PromptSpec] = []
    if p.suffix == ".json":
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"{p}: expected a JSON list of prompts")
        for i, it in enumerate(items):
            if isinstance(it, str):
                out.append(PromptSpec("raw", it))
            elif isinstance(it, dict) and "messages" in it:
                out.append(PromptSpec("chat", messages=list(it["messages"])))
            elif isinstance(it, dict) and ("chat" in it or "raw" in it):
                kind = "chat" if "chat" in it else "raw"
                out.append(PromptSpec(kind, it[kind]))
            elif isinstance(it, dict) and "kind" in it:
                out.append(PromptSpec(it["kind"], it.get("text"), it.get("messages")))
            else:
                raise ValueError(f"{p}: prompt {i} is not a string or a prompt object: {it!r}")
    else:
        for line in text.splitlines():
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            if s.startswith("chat:"):
                out.append(PromptSpec("chat", s[5:].strip()))
            elif s.startswith("raw:"):
                out.append(PromptSpec("raw", s[4:].lstrip()))
            else:
                out.append(PromptSpec("raw", s))
    if not out:
        raise ValueError(f"{p}: no prompts")
    return out


# ---- options and report ---------------------------------------------------------------------------
@dataclass
class ProbeOptions:
    model: str
    engine_kwargs: dict = field(default_factory=dict)  # engine settings (EngineConfig's fields: the command's flags)
    prompts: list[PromptSpec] | None = None
    max_tokens: int = 32
    batch_sizes: tuple[int, ...] = (1, 2, 8, 16)
    repeats: int = 2  # runs of the largest batch, compared with each other
    validate: bool = False
    ref_tokens: int = 4  # reference agreement over the first N tokens (0: all)
    ref_tol: float = 0.05  # nats: a top-1 disagreement within this margin is a near-tie
    logprob_tol: float = 0.1  # nats: engine logprob of its token vs the reference's
    top_logprobs: int = 5
    batch_tie_tol: float = 0.0  # nats: outputs that part at a near-tie this close only warn (0: any difference fails)
    oracle: str = "shared"  # shared: the engine's model on a dense cache; torch: a separate torch model; off
    exact_oracle: bool = True  # re-judge failing low-precision steps against the float32 reference (oracle.py)
    expect: str | None = None
    record: str | None = None
    json_report: str | None = None
    thinking: bool = False
    seed: int = 0
    verdict: dict = field(default_factory=dict)  # VerdictConfig overrides (max_run, …)

    def check(self) -> None:
        if self.max_tokens < 2:
            raise ValueError(f"--max-tokens {self.max_tokens}: at least 2 (the first token comes from prefill; "
                             f"only the second one exercises decode)")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"--batch-sizes {list(self.batch_sizes)}: positive integers")
        if self.repeats < 1:
            raise ValueError("--repeats must be ≥ 1")
        if self.oracle not in ("shared", "torch", "off"):
            raise ValueError(f"--oracle must be shared, torch or off, got {self.oracle!r}")
        if self.batch_tie_tol < 0:
            raise ValueError("--batch-tie-tol must be ≥ 0")
        if self.ref_tokens < 0:
            raise ValueError("--ref-tokens must be ≥ 0 (0: all generated tokens)")


@dataclass
class Stage:
    name: str
    status: str = "PASS"  # PASS | FAIL | WARN | SKIP
    seconds: float = 0.0
    data: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.problems.append(msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)

    def finalize(self) -> None:
        if self.status == "SKIP":
            return
        self.status = "FAIL" if self.problems else ("WARN" if self.warnings else "PASS")


@dataclass
class Generation:
    prompt_index: int
    context: str  # "bs=1", "bs=8 run 2", …
    batch_size: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    token_decode: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list | None = field(default=None, repr=False)
    verdict: SequenceVerdict | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return {"prompt_index": self.prompt_index, "context": self.context, "batch_size": self.batch_size,
                "prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
                "token_decode": self.token_decode, "text": self.text, "finish_reason": self.finish_reason,
                "error": self.error, "verdict": self.verdict.to_dict() if self.verdict else None,
                "top_logprobs": None if self.logprobs is None else
                [sorted(([t, round(v.logprob, 5)] for t, v in d.items()), key=lambda x: -x[1]) if d else None
                 for d in self.logprobs]}


@dataclass
class ProbeReport:
    stages: list[Stage] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    options: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return "FAIL" if any(s.status == "FAIL" for s in self.stages) else "PASS"

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == "PASS" else 1

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    @property
    def problems(self) -> list[str]:
        return [f"[{s.name}] {p}" for s in self.stages for p in s.problems]

    @property
    def first_failure(self) -> str | None:
        p = self.problems
        return p[0] if p else None

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "exit_code": self.exit_code, "first_failure": self.first_failure,
                "problems": self.problems, "options": self.options,
                "stages": [asdict(s) for s in self.stages],
                "generations": [g.to_dict() for g in self.generations]}


class _Abort(Exception):
    """A critical stage failed: the later stages cannot run."""


# ---- the probe ------------------------------------------------------------------------------------
class Probe:
    def __init__(self, opts: ProbeOptions, out: TextIO | None = None, model=None):
        opts.check()
        self.o = opts
        self.out = out or sys.stdout
        self.shared_model = model  # tests: a prebuilt ReferenceModel (skips the weight load)
        self.report = ProbeReport(options=_jsonable(asdict(opts)))
        self.prompts = list(opts.prompts or DEFAULT_PROMPTS)
        self.llm = None
        self.monitor = None
        self.context = ""
        self.logit_rows = 0
        self.bad_logit_rows: list[str] = []
        self.baseline: list[Generation] = []
        self.prompt_ids: list[list[int]] = []
        self.batch_runs: dict[int, list[Generation]] = {}

    # ---- printing ---------------------------------------------------------------------------------
    def say(self, text: str = "") -> None:
        try:
            self.out.write(text + "\n")
        except UnicodeEncodeError:
            self.out.write(text.encode("ascii", "backslashreplace").decode() + "\n")
        self.out.flush()

    def _stage(self, name: str, fn: Callable[[Stage], None], critical: bool = False) -> Stage:
        st = Stage(name)
        self.report.stages.append(st)
        self.say(f"### STAGE: {name}")
        t0 = time.perf_counter()
        try:
            fn(st)
        except _Abort:
            raise
        except Exception as e:  # noqa: BLE001 - a stage reports what broke and the probe goes on
            st.fail(f"{type(e).__name__}: {e}")
            st.data["traceback"] = traceback.format_exc(limit=8)
        st.seconds = round(time.perf_counter() - t0, 3)
        st.finalize()
        for w in st.warnings:
            self.say(f"  WARN: {w}")
        for p in st.problems:
            self.say(f"  FAIL: {p}")
        self.say(f"  => {name}: {st.status} ({st.seconds:.1f} s)")
        if critical and st.status == "FAIL":
            raise _Abort(name)
        return st

    def _skip(self, name: str, why: str) -> None:
        st = Stage(name, status="SKIP", data={"reason": why})
        self.report.stages.append(st)
        self.say(f"### STAGE: {name}\n  => {name}: SKIP ({why})")

    # ---- run --------------------------------------------------------------------------------------
    def run(self) -> ProbeReport:
        names = ["env", "config", "checkpoint", "engine init", "generate", "batch consistency", "repeat",
                 "reference agreement", "golden", "validate"]
        try:
            self._stage("env", self._env)
            self._stage("config", self._config, critical=True)
            self._stage("checkpoint", self._checkpoint, critical=True)
            self._stage("engine init", self._engine_init, critical=True)
            try:
                self._stage("generate", self._generate)
                self._stage("batch consistency", self._batches)
                self._stage("repeat", self._repeat)
                if self.o.oracle == "off":
                    self._skip("reference agreement", "--oracle off")
                else:
                    self._stage("reference agreement", self._reference)
                if self.o.expect or self.o.record:
                    self._stage("golden", self._golden)
                else:
                    self._skip("golden", "no --expect / --record file")
                if self.o.validate:
                    self._stage("validate", self._validate)
                else:
                    self._skip("validate", "off (--validate installs the finite checks)")
            finally:
                if self.monitor is not None:
                    self.monitor.uninstall()
                if self.llm is not None:
                    self.llm.engine.runner.__dict__.pop("run", None)
        except _Abort as e:
            done = {s.name for s in self.report.stages}
            for n in names:
                if n not in done:
                    self._skip(n, f"stage '{e}' failed")
        self._summary()
        if self.o.json_report:
            Path(self.o.json_report).write_text(json.dumps(self.report.to_dict(), indent=2, ensure_ascii=False,
                                                           default=str), encoding="utf-8")
            self.say(f"JSON report: {self.o.json_report}")
        return self.report

    def _summary(self) -> None:
        r = self.report
        self.say("### SUMMARY")
        for s in r.stages:
            extra = f" ({len(s.problems)} problems)" if s.problems else ""
            self.say(f"  {s.name:<20} {s.status}{extra}")
        self.say(f"DSV4_VERDICT: {r.verdict}")
        if r.first_failure:
            self.say(f"FIRST_FAILURE: {r.first_failure}")

    # ---- stage: env -------------------------------------------------------------------------------
    def _env(self, st: Stage) -> None:
        import platform as pyplatform

        import torch

        from .. import __version__
        from ..ops.platform import detect_platform, interpreting

        d = st.data
        d["python"] = pyplatform.python_version()
        d["torch"] = torch.__version__
        d["dsv4"] = __version__
        if torch.cuda.is_available():
            devs = []
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                devs.append(f"cuda:{i} {p.name} {p.total_memory / 2**30:.1f} GiB")
            d["devices"] = devs
            d["hip"] = getattr(torch.version, "hip", None)
        else:
            d["devices"] = [f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"]
        plat = detect_platform()
        d["platform"] = plat.describe()
        d["platform_fp8"] = plat.fp8_format
        d["native_fp8"] = plat.native_fp8
        engine_fp8 = self.o.engine_kwargs.get("fp8_format", "auto")
        if engine_fp8 == "auto":
            engine_fp8 = plat.fp8_format or "ocp"
        d["engine_fp8_format"] = engine_fp8
        d["DSV4_PLATFORM_FP8"] = env.platform_fp8()
        d["triton"] = _triton_version()
        d["TRITON_INTERPRET"] = interpreting()
        backend = self.o.engine_kwargs.get("backend", "auto")
        d["backend"] = backend
        d["ops"] = _describe_ops(backend, self.o.engine_kwargs.get("attention", "auto"))
        self.say(f"  devices: {', '.join(d['devices'])}")
        self.say(f"  platform: {d['platform']}")
        self.say(f"  FP8 encoding: platform {plat.fp8_format} (native {plat.native_fp8}), "
                 f"engine KV cache fp8_format {engine_fp8}")
        self.say(f"  triton: {d['triton'] or 'not installed'} (TRITON_INTERPRET={int(d['TRITON_INTERPRET'])}, "
                 f"kernels usable here: {plat.triton})")
        self.say(f"  backend {backend}: {d['ops']}")
        if plat.kind != "cpu" and plat.fp8_format != engine_fp8:
            st.warn(f"the platform's FP8 encoding is {plat.fp8_format} but the engine writes {engine_fp8} bytes: "
                    f"every reader of those bytes must decode {engine_fp8}")
        if backend == "triton" and not plat.triton:
            st.warn("backend triton requested but Triton kernels cannot run here"
                    + (" (on CPU set TRITON_INTERPRET=1)" if plat.kind == "cpu" else ""))

    # ---- stage: config ----------------------------------------------------------------------------
    def _config(self, st: Stage) -> None:
        from ..config import load_config

        cfg = load_config(self.o.model)
        self.cfg = cfg
        types = [t.name for t in cfg.layer_types]
        counts = {k: types.count(k) for k in ("SWA", "CSA", "HCA")}
        d = st.data
        d.update(layers=cfg.num_hidden_layers, schedule=cfg.schedule_summary(), layer_type_counts=counts,
                 hidden_size=cfg.hidden_size, heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                 sliding_window=cfg.sliding_window, index_topk=cfg.index_topk, routed_experts=cfg.n_routed_experts,
                 experts_per_tok=cfg.num_experts_per_tok, expert_dtype=cfg.expert_dtype, vocab_size=cfg.vocab_size,
                 bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, swiglu_limit=cfg.swiglu_limit,
                 mtp_layers=cfg.num_mtp_layers, max_position_embeddings=cfg.max_position_embeddings)
        self.say(f"  layers: {cfg.num_hidden_layers} ({counts['SWA']} SWA, {counts['CSA']} CSA, {counts['HCA']} HCA), "
                 f"hash layers {cfg.num_hash_layers}, MTP {cfg.num_mtp_layers}")
        self.say(f"  schedule: {cfg.schedule_summary()}")
        self.say(f"  hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}×{cfg.head_dim}, window "
                 f"{cfg.sliding_window}, index top-k {cfg.index_topk}, experts {cfg.n_routed_experts} "
                 f"(top-{cfg.num_experts_per_tok}, {cfg.expert_dtype}), swiglu_limit {cfg.swiglu_limit}, "
                 f"vocab {cfg.vocab_size}, BOS {cfg.bos_token_id} EOS {cfg.eos_token_id}")

    # ---- stage: checkpoint ------------------------------------------------------------------------
    def _checkpoint(self, st: Stage) -> None:
        from ..checkpoint.reader import Checkpoint

        ck = Checkpoint(self.o.model, config=self.cfg, validate=False)
        d = st.data
        d["keys"] = len(ck.entries)
        d["files"] = len(ck.files)
        d["bytes"] = ck.total_bytes()
        d["dtypes"] = {k: {"tensors": c, "bytes": b} for k, (c, b) in ck.bytes_by_dtype().items()}
        ex = next((n for n in ck.entries if ".ffn.experts." in n and n.endswith(".w1.weight")), None)
        d["expert_weight"] = None if ex is None else {"name": ex, "dtype": ck.entries[ex].dtype,
                                                      "shape": list(ck.entries[ex].shape)}
        probs = ck.problems()
        d["problems"] = probs[:50]
        dt = ", ".join(f"{k} {c}" for k, (c, _) in ck.bytes_by_dtype().items())
        self.say(f"  {d['keys']} tensors in {d['files']} files, {d['bytes'] / 2**30:.2f} GiB ({dt})")
        if ex is not None:
            e = ck.entries[ex]
            self.say(f"  expert dtype: config {self.cfg.expert_dtype}, {ex} is {e.dtype}{list(e.shape)}")
            packed = e.dtype in ("I8", "U8")
            if (self.cfg.expert_dtype == "fp4") != packed:
                st.fail(f"config says expert_dtype={self.cfg.expert_dtype} but {ex} is stored as {e.dtype}")
        self.say(f"  validation: {'OK' if not probs else f'{len(probs)} problems'}")
        for p in probs[:10]:
            st.fail(p)
        if len(probs) > 10:
            st.fail(f"… and {len(probs) - 10} more checkpoint problems")

    # ---- stage: engine init -----------------------------------------------------------------------
    def _engine_init(self, st: Stage) -> None:
        from ..engine.engine import LLMEngine
        from ..engine.settings import EngineConfig
        from ..llm import LLM

        kw = {**self.o.engine_kwargs, "seed": self.o.seed}
        t0 = time.perf_counter()
        if self.shared_model is None:
            self.llm = LLM(self.o.model, **kw)
        else:
            llm = LLM.__new__(LLM)
            llm.engine = LLMEngine(EngineConfig.from_kwargs("probe", model=str(self.o.model), **kw),
                                   model=self.shared_model)
            self.llm = llm
            st.data["model"] = "provided (shared weights)"
        eng = self.llm.engine
        b = eng.kv_cache.budget
        d = st.data
        d.update(seconds=round(time.perf_counter() - t0, 2), device=str(eng.model.device), dtype=str(eng.model.dtype),
                 kv_cache_dtype=eng.kv_cache.numerics.kv_cache_dtype, fp8_format=eng.kv_cache.numerics.fmt.name,
                 cache_tokens=b.capacity_tokens, cache_blocks=b.num_blocks, swa_pages=b.num_swa_pages,
                 cache_mib=round(b.total_bytes / 2**20, 1), max_model_len=eng.max_model_len,
                 max_num_seqs=eng.config.max_num_seqs, prefix_caching=eng.config.enable_prefix_caching,
                 ops=eng.ops.describe())
        self.say(
            f"  ENGINE_READY in {d['seconds']:.1f} s: {d['device']} {d['dtype']}, KV cache {d['kv_cache_dtype']} "
            f"({d['fp8_format']}): {b.capacity_tokens} tokens ({b.num_blocks} blocks, {b.num_swa_pages} SWA pages, "
            f"{d['cache_mib']} MiB), max_model_len {eng.max_model_len}"
        )
        self.tok = eng.tokenizer
        self.vcfg = VerdictConfig(
            bos_token_id=eng.model_config.bos_token_id,
            eos_token_id=eng.model_config.eos_token_id,
            pad_token_id=getattr(self.tok, "pad_token_id", None),
            **self.o.verdict,
        )
        # logits are checked on every step (cheap: [rows, vocab] on the host); the sampler raises on
        # non-finite rows it samples from, this also covers rows it does not
        inner = eng.runner.execute  # the forward both the synchronous and the async step call

        def checked_execute(batch):
            logits = inner(batch)
            self.logit_rows += int(logits.shape[0])
            if logits.numel() and not bool(logits.isfinite().all()):
                bad = int((~logits.isfinite()).any(dim=-1).sum())
                self.bad_logit_rows.append(f"{bad} of {logits.shape[0]} logits rows non-finite during {self.context}")
            if self.monitor is not None:
                self.monitor.check_logits(logits)
            return logits

        eng.runner.execute = checked_execute
        if self.o.validate:
            from .finite import FiniteMonitor

            self.monitor = FiniteMonitor().install(eng.model)
            self.say(
                "  --validate: finite checks installed on every layer boundary and attention q / k_window / "
                "k_compressed / logits / probs"
            )
        for bs in self.o.batch_sizes:
            if bs > eng.config.max_num_seqs:
                st.warn(
                    f"batch size {bs} > max_num_seqs {eng.config.max_num_seqs}: at most "
                    f"{eng.config.max_num_seqs} requests run at once"
                )

    # ---- generation helpers -------------------------------------------------------------------------
    def _set_context(self, ctx: str) -> None:
        self.context = ctx
        if self.monitor is not None:
            self.monitor.context = ctx

    def _params(self):
        from ..engine.sampling_params import SamplingParams

        return SamplingParams(
            temperature=0.0,
            max_tokens=self.o.max_tokens,
            ignore_eos=True,
            logprobs=self.o.top_logprobs,
            seed=self.o.seed,
        )

    def _chat_ids(self, spec: PromptSpec) -> list[int]:
        from ..chat import effort_version_for_config, encode_messages

        eng = self.llm.engine
        text = encode_messages(
            spec.messages,
            thinking=self.o.thinking,
            reasoning_effort=None,
            tools=None,
            effort_version=effort_version_for_config(eng.model_config.raw),
        )
        return self.tok.encode(text)

    def _call(self, fn: Callable[[], list], n: int) -> tuple[list | None, str | None]:
        try:
            return fn(), None
        except FloatingPointError as e:
            err = f"non-finite logits (sampler: {e})"
        except Exception as e:  # noqa: BLE001 - the engine broke; report it with the run
            err = f"engine error: {type(e).__name__}: {e}"
        eng = self.llm.engine
        for rid in list(eng.requests):  # the step raised mid-run: free what the requests hold
            eng.abort_request(rid)
        return None, err

    def _record(self, pi: int, ctx: str, bs: int, prompt_ids: list[int], out, err: str | None) -> Generation:
        g = Generation(pi, ctx, bs, list(prompt_ids))
        if out is None:
            g.error = err
            g.verdict = SequenceVerdict(problems=[err or "no output"])
        else:
            c = out.outputs[0]
            g.token_ids = list(c.token_ids)
            g.token_decode = [self.tok.decode([t]) for t in c.token_ids]
            g.text = c.text
            g.finish_reason = c.finish_reason
            g.logprobs = c.logprobs
            g.verdict = judge_tokens(
                g.token_ids,
                finish_reason=c.finish_reason,
                max_tokens=self.o.max_tokens,
                ignore_eos=True,
                config=self.vcfg,
            )
        self.report.generations.append(g)
        return g

    def _print_generation(self, g: Generation, spec: PromptSpec) -> None:
        self.say(f"  [prompt {g.prompt_index}] {spec.label()} ({len(g.prompt_token_ids)} prompt tokens, {g.context})")
        if g.error:
            self.say(f"    ERROR: {g.error}")
        else:
            self.say(f"    TOKEN_IDS: {g.token_ids}")
            self.say(f"    TOKEN_DECODE: {g.token_decode!r}")
            self.say(f"    FINISH_REASON: {g.finish_reason}")
            self.say(f"    OUTPUT_REPR: {g.text!r}")
        self.say(f"    VERDICT: {g.verdict.summary()}")

    # ---- stage: generate (batch size 1) -------------------------------------------------------------
    def _generate(self, st: Stage) -> None:
        params = self._params()
        self.baseline = []
        self.prompt_ids = []
        for i, spec in enumerate(self.prompts):
            self._set_context(f"generate bs=1 prompt {i}")
            if spec.kind == "chat":
                ids = self._chat_ids(spec)
                outs, err = self._call(lambda: self.llm.chat(spec.messages, params, thinking=self.o.thinking), 1)
            else:
                ids = self.tok.encode(spec.text)
                outs, err = self._call(lambda: self.llm.generate(spec.text, params), 1)
            out = outs[0] if outs else None
            if out is not None and list(out.prompt_token_ids) != ids:
                st.warn(f"prompt {i}: the engine encoded {len(out.prompt_token_ids)} tokens, the probe {len(ids)}")
                ids = list(out.prompt_token_ids)
            self.prompt_ids.append(ids)
            g = self._record(i, "bs=1", 1, ids, out, err)
            self.baseline.append(g)
            self._print_generation(g, spec)
            if not g.verdict.ok:
                for p in g.verdict.problems:
                    st.fail(f"prompt {i} ({spec.kind}): {p}")
        st.data["outputs"] = [g.to_dict() for g in self.baseline]
        self._logits_check(st)

    def _logits_check(self, st: Stage) -> None:
        st.data["logits_rows_checked"] = self.logit_rows
        if self.bad_logit_rows:
            st.data["non_finite_logits"] = list(self.bad_logit_rows)
            for b in self.bad_logit_rows:
                st.fail(f"non-finite logits: {b}")
            self.bad_logit_rows = []

    # ---- stage: batch consistency ------------------------------------------------------------------
    def _batch_run(self, bs: int, ctx: str) -> list[Generation]:
        P = len(self.prompts)
        order = [i % P for i in range(max(bs, P))]
        params = self._params()
        gens: list[Generation] = []
        for j in range(0, len(order), bs):
            group = order[j : j + bs]
            self._set_context(f"generate {ctx}")
            items = [{"prompt_token_ids": self.prompt_ids[pi]} for pi in group]
            outs, err = self._call(lambda: self.llm.generate(items, params), len(group))
            for k, pi in enumerate(group):
                gens.append(self._record(pi, ctx, bs, self.prompt_ids[pi], outs[k] if outs else None, err))
        return gens

    def _compare(self, st: Stage, gens: list[Generation], ref: list[Generation], what: str, ref_name: str) -> int:
        """Fail on errors, bad verdicts and token differences; returns how many outputs equal the reference."""
        same = 0
        for r, g in enumerate(gens):
            base = ref[r] if len(ref) == len(gens) else self.baseline[g.prompt_index]
            tag = f"{what} request {r} (prompt {g.prompt_index})"
            if g.error:
                st.fail(f"{tag}: {g.error}")
                continue
            if not g.verdict.ok:
                st.fail(f"{tag}: {'; '.join(g.verdict.problems)}")
            if base.error:
                continue
            if g.token_ids == base.token_ids:
                same += 1
                continue
            p = next(
                (k for k, (x, y) in enumerate(zip(g.token_ids, base.token_ids)) if x != y),
                min(len(g.token_ids), len(base.token_ids)),
            )
            margin, how = _tie_margin(base, g, p)
            if p == 0:
                msg = f"{tag}: first token {g.token_ids[:1]} differs from the {ref_name} run's {base.token_ids[:1]}"
            else:
                msg = (
                    f"{tag}: tokens differ from the {ref_name} run from position {p} "
                    f"({g.token_ids[p : p + 4]} vs {base.token_ids[p : p + 4]})"
                )
            msg += f"; {how}"
            if margin is not None and margin <= self.o.batch_tie_tol:
                st.warn(msg + f" ≤ --batch-tie-tol {self.o.batch_tie_tol:g}: a near-tie")
            else:
                st.fail(msg)
            self.say(f"    {tag} TOKEN_IDS: {g.token_ids}")
            self.say(f"    {ref_name} run TOKEN_IDS: {base.token_ids}")
        return same

    def _batches(self, st: Stage) -> None:
        self.batch_runs: dict[int, list[Generation]] = {1: self.baseline}
        others = [b for b in dict.fromkeys(self.o.batch_sizes) if b != 1]
        if not others:
            st.data["note"] = "only batch size 1 requested"
            self.say("  only batch size 1 requested")
            return
        for bs in others:
            gens = self._batch_run(bs, f"bs={bs}")
            self.batch_runs[bs] = gens
            same = self._compare(st, gens, [], f"bs={bs}", "bs=1")
            first_same = sum(
                1 for g in gens if not g.error and g.token_ids[:1] == self.baseline[g.prompt_index].token_ids[:1]
            )
            st.data[f"bs={bs}"] = {"requests": len(gens), "identical_to_bs1": same, "first_token_equal": first_same}
            self.say(
                f"  bs={bs}: {len(gens)} requests, first token equal to bs=1: {first_same}/{len(gens)}, "
                f"identical: {same}/{len(gens)}"
            )
        self._logits_check(st)

    # ---- stage: repeat ---------------------------------------------------------------------------------
    def _repeat(self, st: Stage) -> None:
        if self.o.repeats < 2:
            st.data["note"] = "--repeats 1"
            self.say("  --repeats 1: nothing to repeat")
            return
        bs = max(self.o.batch_sizes)
        first = self.batch_runs.get(bs) or self.baseline
        for r in range(2, self.o.repeats + 1):
            if bs == 1:
                gens = []
                params = self._params()
                for i, ids in enumerate(self.prompt_ids):
                    self._set_context(f"repeat {r} bs=1 prompt {i}")
                    outs, err = self._call(lambda: self.llm.generate([{"prompt_token_ids": ids}], params), 1)
                    gens.append(self._record(i, f"bs=1 run {r}", 1, ids, outs[0] if outs else None, err))
            else:
                gens = self._batch_run(bs, f"bs={bs} run {r}")
            same = self._compare(st, gens, first, f"run {r} bs={bs}", "first")
            st.data[f"run {r}"] = {"batch_size": bs, "requests": len(gens), "identical": same}
            self.say(f"  run {r} of bs={bs}: identical to run 1: {same}/{len(gens)}")
        self._logits_check(st)

    # ---- stage: reference agreement --------------------------------------------------------------------
    def _oracle_model(self):
        eng = self.llm.engine
        return eng.model if self.o.oracle == "shared" else self._torch_reference(eng.model.dtype)

    def _torch_reference(self, dtype):
        """A separately loaded torch reference model in ``dtype``, in the engine's cache numerics."""
        from ..model.model import ReferenceModel

        eng = self.llm.engine
        return ReferenceModel(self.o.model, dtype=dtype, device=eng.model.device, numerics=eng.numerics)

    def _reference(self, st: Stage) -> None:
        import torch

        from .oracle import compare, teacher_forced_logits

        eng = self.llm.engine
        model = self._oracle_model()
        numerics = eng.numerics
        st.data["oracle"] = (
            f"{'the engine model' if self.o.oracle == 'shared' else 'a separate torch reference model'}"
            f" on a dense cache ({numerics.kv_cache_dtype}, {numerics.fmt.name}), teacher-forced"
        )
        self.say(f"  oracle: {st.data['oracle']}")
        rows, judged = [], []  # judged: (generation, steps compared, same-precision logits, agreement)
        kw = dict(
            tol=self.o.ref_tol, logprob_tol=self.o.logprob_tol, top_k=self.o.top_logprobs, logit_dtype=model.dtype
        )
        for g in self.baseline:
            i = g.prompt_index
            self._set_context(f"reference prompt {i}")
            if not g.token_ids:
                with torch.no_grad():
                    lg = teacher_forced_logits(model, numerics, g.prompt_token_ids, [0], 1)
                first = int(lg[0].argmax()) if bool(lg.isfinite().all()) else None
                self.say(f"  [prompt {i}] engine gave no tokens ({g.error}); the reference's first token: {first}")
                st.fail(f"prompt {i}: no engine tokens to compare (reference first token {first})")
                rows.append({"prompt_index": i, "reference_first_token": first})
                continue
            n = len(g.token_ids) if self.o.ref_tokens == 0 else min(self.o.ref_tokens, len(g.token_ids))
            logits = teacher_forced_logits(model, numerics, g.prompt_token_ids, g.token_ids, n)
            judged.append((g, n, logits, compare(g.token_ids, logits, g.logprobs, **kw)))
        # a bf16 model on random weights is ill-conditioned (MoE routing near-ties): where the engine
        # parts from the same-precision reference, ask the float32 reference who is closer to it
        failing = [j for j, (*_, a) in enumerate(judged) if not a.ok]
        if failing and self.o.exact_oracle and model.dtype != torch.float32:
            if model is not eng.model:
                del model
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            exact = self._torch_reference(torch.float32)  # weights dequantized on its device
            st.data["exact_oracle"] = "the torch reference in float32, for the prompts that failed"
            self.say(
                f"  {len(failing)} prompt(s) part from the {kw['logit_dtype']} reference: judged again "
                f"against the float32 reference"
            )
            for j in failing:
                g, n, logits, _ = judged[j]
                self._set_context(f"float32 reference prompt {g.prompt_index}")
                xl = teacher_forced_logits(exact, numerics, g.prompt_token_ids, g.token_ids, n)
                judged[j] = (g, n, logits, compare(g.token_ids, logits, g.logprobs, exact_logits=xl, **kw))
            del exact
        for g, n, logits, a in judged:
            i = g.prompt_index
            agree = sum(1 for s in a.steps if s.engine_token == s.oracle_token)
            dl = [abs(s.engine_logprob - s.oracle_logprob) for s in a.steps if s.engine_logprob is not None]
            ov = [s.topk_overlap for s in a.steps if s.topk_overlap is not None]
            self.say(
                f"  [prompt {i}] {n} steps: top-1 agrees {agree}/{len(a.steps)}, "
                f"engine tokens {g.token_ids[:n]} reference top-1 {[s.oracle_token for s in a.steps]}, "
                f"max |Δlogprob| {max(dl) if dl else float('nan'):.3g}, "
                f"top-{self.o.top_logprobs} overlap {min(ov) if ov else float('nan'):.2f}"
                f" → {'PASS' if a.ok else 'FAIL'}"
            )
            for p in a.problems:
                st.fail(f"prompt {i}: {p}")
            for w in a.warnings:
                st.warn(f"prompt {i}: {w}")
            rows.append({"prompt_index": i, **a.to_dict()})
        rows.sort(key=lambda r: r["prompt_index"])
        st.data["prompts"] = rows

    # ---- stage: golden ------------------------------------------------------------------------------------
    def _golden(self, st: Stage) -> None:
        eng = self.llm.engine
        if self.o.expect:
            gold = json.loads(Path(self.o.expect).read_text(encoding="utf-8"))
            if gold.get("format") != GOLDEN_FORMAT:
                raise ValueError(f"{self.o.expect}: not a probe golden file (format {gold.get('format')!r})")
            for k in ("kv_cache_dtype", "fp8_format", "dtype"):
                mine = getattr(eng.config, k)
                if gold.get(k) is not None and gold[k] != mine:
                    st.warn(f"golden run used {k}={gold[k]}, this run {mine}")
            table = {tuple(p["prompt_token_ids"]): toks for p, toks in zip(gold["prompts"], gold["token_ids"])}
            matched = 0
            for g in self.baseline:
                want = table.get(tuple(g.prompt_token_ids))
                if want is None:
                    st.warn(f"prompt {g.prompt_index} is not in the golden file")
                    continue
                n = min(len(want), len(g.token_ids))
                if len(want) != len(g.token_ids):
                    st.warn(
                        f"prompt {g.prompt_index}: golden has {len(want)} tokens, this run {len(g.token_ids)}; "
                        f"comparing the first {n}"
                    )
                p = next((k for k in range(n) if want[k] != g.token_ids[k]), None)
                if g.error or p is not None or n == 0:
                    where = g.error or (
                        f"position {p}: {g.token_ids[p : p + 4]} vs golden {want[p : p + 4]}"
                        if p is not None
                        else "no tokens"
                    )
                    st.fail(f"prompt {g.prompt_index}: tokens differ from the golden run ({where})")
                    self.say(f"  [prompt {g.prompt_index}] golden TOKEN_IDS: {want}")
                    self.say(f"  [prompt {g.prompt_index}] this run    : {g.token_ids}")
                else:
                    matched += 1
            st.data["expect"] = {"file": self.o.expect, "matched": matched, "prompts": len(self.baseline)}
            self.say(f"  --expect {self.o.expect}: {matched}/{len(self.baseline)} prompts match the golden tokens")
        if self.o.record:
            if any(g.error for g in self.baseline):
                st.fail("not recording a golden file: some prompts produced no tokens")
                return
            gold = {
                "format": GOLDEN_FORMAT,
                "model": str(self.o.model),
                "max_tokens": self.o.max_tokens,
                "kv_cache_dtype": eng.config.kv_cache_dtype,
                "fp8_format": eng.config.fp8_format,
                "dtype": eng.config.dtype,
                "backend": eng.config.backend,
                "prompts": [{**p.to_dict(), "prompt_token_ids": ids} for p, ids in zip(self.prompts, self.prompt_ids)],
                "token_ids": [g.token_ids for g in self.baseline],
            }
            Path(self.o.record).write_text(json.dumps(gold, ensure_ascii=False, indent=1), encoding="utf-8")
            st.data["record"] = self.o.record
            self.say(f"  --record: golden tokens written to {self.o.record}")

    # ---- stage: validate -----------------------------------------------------------------------------------
    def _validate(self, st: Stage) -> None:
        m = self.monitor
        st.data.update(m.to_dict())
        if m.first is None:
            self.say(f"  {m.checks} finite checks over {m.forwards} forwards: all finite")
            return
        self.say(f"  FIRST_NON_FINITE: {m.first.describe()}")
        for e in m.events[1:6]:
            self.say(f"    then: {e.describe()}")
        st.fail(f"first non-finite value: {m.first.describe()}")


def _tie_margin(a: Generation, b: Generation, p: int) -> tuple[float | None, str]:
    """How close the two runs were to choosing each other's token at the first differing step ``p``
    (their prefixes are equal there): the larger of the two runs' logprob gaps, and a description."""
    if p >= len(a.token_ids) or p >= len(b.token_ids) or not a.logprobs or not b.logprobs:
        return None, "no logprobs at the divergence"
    ta, tb = a.token_ids[p], b.token_ids[p]
    gaps, parts = [], []
    for name, g, mine, other in (("A", a, ta, tb), ("B", b, tb, ta)):
        d = g.logprobs[p] if p < len(g.logprobs) else None
        if not d or mine not in d:
            return None, "no logprobs at the divergence"
        lp_mine = d[mine].logprob
        if other in d:
            gaps.append(lp_mine - d[other].logprob)
            parts.append(f"{g.context}: {mine} {lp_mine:.4f} vs {other} {d[other].logprob:.4f}")
        else:
            low = min(v.logprob for v in d.values())
            gaps.append(lp_mine - low)
            parts.append(f"{g.context}: {mine} {lp_mine:.4f}, {other} below its top-{len(d) - 1} (< {low:.4f})")
    m = max(gaps)
    return m, f"at that step {'; '.join(parts)}: margin {m:.4g} nats"


def run_probe(opts: ProbeOptions, out: TextIO | None = None, model=None) -> ProbeReport:
    """Run every stage; returns the report (``report.exit_code`` is 0 only on PASS)."""
    return Probe(opts, out=out, model=model).run()


# ---- small helpers --------------------------------------------------------------------------------------
def _triton_version() -> str | None:
    """The installed Triton's version, without importing it (an import costs seconds on CPU)."""
    import importlib.metadata
    import importlib.util

    try:
        if importlib.util.find_spec("triton") is None:
            return None
        return importlib.metadata.version("triton")
    except Exception:  # noqa: BLE001
        return None


def _describe_ops(backend: str, attention: str) -> str:
    """The op set an engine with these settings would run, op by op (``resolve_op_set``: the one place)."""
    try:
        from ..ops.platform import detect_platform
        from ..ops.selection import fast_path, resolve_op_set

        device = "cuda" if detect_platform().kind != "cpu" else "cpu"
        ops = resolve_op_set(backend, attention, device)
        if not fast_path(backend, device) and not ops.paged_attention:
            return "reference torch path (no fast kernels)"
        return ops.describe()
    except Exception as e:  # noqa: BLE001
        return f"unresolved ({type(e).__name__}: {e})"


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
