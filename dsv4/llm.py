"""The offline API: ``LLM(model=...).generate(...)`` / ``.chat(...)``, shaped like vLLM's."""

from __future__ import annotations

from typing import Any, Sequence

from .engine.engine import EngineConfig, LLMEngine
from .engine.outputs import RequestOutput
from .engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", kv_cache_dtype: str = "fp8_ds_mla",
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int = 1, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9, seed: int = 0,
                 fp8_format: str = "auto", device: str | None = None, act_quant: bool = False, backend: str = "auto",
                 tokenizer=None, attention: str = "auto", enforce_eager: bool = False,
                 async_scheduling: bool | None = None,
                 enable_expert_parallel: bool = False, nnodes: int = 1, node_rank: int = 0,
                 master_addr: str = "127.0.0.1", master_port: int | None = None, distributed_timeout: float = 300.0):
        """The parallel arguments (``tensor_parallel_size`` > 1 and the ones after ``async_scheduling``)
        start worker processes, one per rank; see docs/distributed.md. ``shutdown()`` stops them."""
        if model is None:  # the embedded canary (dsv4/assets/canary), like `dsv4 generate` without --model
            from .canary import default_model_dir

            model = default_model_dir()
        self.engine = LLMEngine(EngineConfig(
            model=str(model), dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=tensor_parallel_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization, seed=seed, fp8_format=fp8_format, device=device,
            act_quant=act_quant, backend=backend, attention=attention,
            enforce_eager=enforce_eager, async_scheduling=async_scheduling,
            enable_expert_parallel=enable_expert_parallel, nnodes=nnodes,
            node_rank=node_rank, master_addr=master_addr, master_port=master_port,
            distributed_timeout=distributed_timeout), tokenizer=tokenizer)

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (they also stop when this process exits)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    @staticmethod
    def _normalize(prompts) -> list[dict[str, Any]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
            prompts = [{"prompt_token_ids": list(prompts)}]
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                out.append({"prompt": p})
            elif isinstance(p, dict) and ("prompt" in p or "prompt_token_ids" in p):
                out.append(p)
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                out.append({"prompt_token_ids": list(p)})
            else:
                raise ValueError(f"prompts[{i}] must be a string, a list of token ids, or a dict with "
                                 f"'prompt' or 'prompt_token_ids'; got {type(p).__name__}")
        return out

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        items = self._normalize(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(items):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(items)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(items)
        ids = []
        try:
            for item, p in zip(items, params):
                ids.append(self.engine.add_request(item.get("prompt"), _copy(p),
                                                   prompt_token_ids=item.get("prompt_token_ids")))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        try:
            done = self.engine.run_to_completion(ids)
        except BaseException:
            for rid in ids:  # a failed step must not leave this call's requests holding pages
                self.engine.abort_request(rid)
            raise
        return [done[r] for r in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, thinking: bool | None = None,
             reasoning_effort: str | None = None, tools: list | None = None,
             chat_template_kwargs: dict | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Render OpenAI-style messages with the DeepSeek-V4 encoding and generate.

        Defaults follow vLLM: thinking mode with effort "high" unless told otherwise.
        """
        from .chat import effort_version_for_config, encode_messages, map_reasoning_effort

        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kw = dict(chat_template_kwargs or {})
        think = kw.pop("thinking", kw.pop("enable_thinking", thinking))
        effort = kw.pop("reasoning_effort", reasoning_effort)
        mapped_think, mapped_effort = map_reasoning_effort(effort)
        if think is None:
            think = mapped_think
        version = effort_version_for_config(self.engine.model_config.raw)
        prompts = [encode_messages(c, thinking=bool(think), reasoning_effort=mapped_effort if think else None,
                                   tools=tools, effort_version=version) for c in convs]
        tok = self.engine.tokenizer
        return self.generate([{"prompt": p, "prompt_token_ids": tok.encode(p)} for p in prompts], sampling_params,
                             use_tqdm=use_tqdm)


def _copy(p: SamplingParams) -> SamplingParams:
    """The caller's parameters, reported only when finished: ``generate`` returns final outputs, so
    the engine need not copy every running request's tokens at every step."""
    from .engine.engine import _fields

    return SamplingParams(**{**_fields(p), "output_kind": "final_only"})
