"""The offline API: ``LLM(model=...).generate(...)`` / ``.chat(...)``, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from .engine.engine import LLMEngine
from .engine.outputs import RequestOutput
from .engine.sampling_params import SamplingParams
from .engine.settings import EngineConfig


def build_engine(config: EngineConfig, tokenizer=None) -> LLMEngine:
    """The engine of ``config``; a tensor-parallel config first starts its worker processes
    (``dsv4.parallel.start_executor``) and hands the engine their driver; a data-parallel one is
    an engine per rank behind one front end with LLMEngine's interface
    (``dsv4.parallel.start_data_parallel``)."""
    if config.data_parallel_size > 1:
        from .parallel import start_data_parallel

        return start_data_parallel(config, tokenizer)
    executor = None
    if config.parallel:
        from .parallel import start_executor

        executor = start_executor(config)
    try:
        return LLMEngine(config, tokenizer=tokenizer, executor=executor)
    except BaseException:
        if executor is not None:
            executor.shutdown()
        raise


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer=None, **settings):
        if isinstance(tokenizer, (str, os.PathLike)):  # a path, as vLLM takes it: the setting
            settings["tokenizer"], tokenizer = str(tokenizer), None
        """``settings``: the engine settings (``dsv4.engine.settings.EngineConfig``'s fields: ``dtype``,
        ``max_model_len``, ``tensor_parallel_size``, …; an unknown name is a TypeError naming it). The
        parallel ones start worker processes, one per rank (docs/distributed.md); ``shutdown()`` stops
        them. Without ``model``: the embedded canary model (dsv4/assets/canary)."""
        if model is None:  # like `dsv4 generate` without --model
            from .canary import default_model_dir

            model = default_model_dir()
        self.engine = build_engine(EngineConfig.from_kwargs("LLM", model=str(model), **settings), tokenizer=tokenizer)

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (they also stop when this process exits)."""
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
            failed = next((done[r] for r in ids if r in done and done[r].exception is not None), None)
            if failed is not None:  # the engine finished it with an error: raise what failed it
                raise failed.exception
        except BaseException:
            for rid in ids:  # a failed call must not leave its other requests holding pages
                self.engine.abort_request(rid)
            raise
        return [done[r] for r in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, thinking: bool | None = None,
             reasoning_effort: str | None = None, tools: list | None = None,
             chat_template_kwargs: dict | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Render OpenAI-style messages with the DeepSeek-V4 encoding and generate.

        Defaults follow vLLM: thinking mode with effort "high" unless told otherwise.
        """
        from .chat import effort_version_for_config, map_reasoning_effort, render_messages

        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kw = dict(chat_template_kwargs or {})
        think = kw.pop("thinking", kw.pop("enable_thinking", thinking))
        effort = kw.pop("reasoning_effort", reasoning_effort)
        mapped_think, mapped_effort = map_reasoning_effort(effort)
        if think is None:
            think = mapped_think
        version = effort_version_for_config(self.engine.model_config.raw)
        prompts = [render_messages(c, thinking=bool(think), reasoning_effort=mapped_effort if think else None,
                                   tools=tools, effort_version=version) for c in convs]
        tok = self.engine.tokenizer
        return self.generate([{"prompt": p.text, "prompt_token_ids": tok.encode_prompt(p)} for p in prompts],
                             sampling_params, use_tqdm=use_tqdm)


def _copy(p: SamplingParams) -> SamplingParams:
    """The caller's parameters, reported only when finished: ``generate`` returns final outputs, so
    the engine need not copy every running request's tokens at every step."""
    return dataclasses.replace(p, output_kind="final_only")
