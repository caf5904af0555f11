"""Greedy accuracy of a model on the canary's held-out tasks, through the engine or the reference.

``evaluate_engine`` is what ``dsv4 eval canary`` runs: the real serving path (scheduler, paged
cache in either cache dtype, the chosen backend). ``evaluate_reference`` runs the reference model on
dense per-sequence caches, batched; the training tool uses it to record the accuracy the CPU
tests compare the engine against.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path

import torch

from .tasks import TASKS, Example, heldout, score
from .tokenizer import CharCodec

MAX_NEW = {"add": 7, "mul": 7, "copy": 27, "recall": 5}  # ≥ the longest answer + EOS


def prompt_ids(ex: Example, codec: CharCodec) -> list[int]:
    return [codec.bos] + codec.encode(ex.prompt)


def answer_text(token_ids: list[int], codec: CharCodec) -> str:
    """Generated ids up to EOS, as text (ids outside the character set decode to their token string)."""
    out = []
    for t in token_ids:
        if t == codec.eos:
            break
        out.append(int(t))
    return codec.decode(out)


def summarize(examples: list[Example], outputs: list[str]) -> dict:
    """{"accuracy": {task: fraction}, "correct": {...}, "n": {...}, "outputs": [...]}"""
    correct, n = defaultdict(int), defaultdict(int)
    for ex, out in zip(examples, outputs):
        n[ex.task] += 1
        correct[ex.task] += score(ex, out)
    tasks = [t for t in TASKS if n[t]]
    return {
        "accuracy": {t: round(correct[t] / n[t], 4) for t in tasks},
        "correct": {t: correct[t] for t in tasks},
        "n": {t: n[t] for t in tasks},
        "outputs": [{"task": ex.task, "answer": ex.answer, "output": out} for ex, out in zip(examples, outputs)],
    }


def evaluate_engine(model: str, examples: list[Example] | None = None, llm=None, **engine_kw) -> dict:
    """Greedy accuracy per task of the model directory ``model`` through ``dsv4.LLM(model, **engine_kw)``
    (or through an already built ``llm``)."""
    from ..engine.sampling_params import SamplingParams
    from ..llm import LLM

    examples = heldout() if examples is None else examples
    codec = CharCodec()
    if llm is None:
        if engine_kw.get("kv_cache_memory") is None:
            engine_kw["kv_cache_memory"] = 256 << 20
        if engine_kw.get("max_model_len") is None:
            engine_kw["max_model_len"] = 2048
        llm = LLM(model, **engine_kw)
    prompts = [{"prompt_token_ids": prompt_ids(ex, codec)} for ex in examples]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW[ex.task]) for ex in examples]
    before = copy.deepcopy(llm.engine.spec_stats)
    outs = llm.generate(prompts, params)
    res = summarize(examples, [answer_text(o.outputs[0].token_ids, codec) for o in outs])
    if llm.engine.proposer is not None:
        res["speculative"] = speculative_report(llm.engine.spec_stats.since(before),
                                                llm.engine.proposer.num_speculative_tokens)
    return res


def speculative_report(stats, k: int) -> dict:
    """Acceptance of this evaluation's drafts (the canary is the signal that the MTP layer works)."""
    return {"num_speculative_tokens": k, "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": round(stats.num_accepted_tokens / stats.num_draft_tokens, 4)
            if stats.num_draft_tokens else None,
            "acceptance_length": round(stats.acceptance_length, 4),
            "per_position_acceptance": [round(r, 4) for r in stats.per_position_acceptance]}


def run_eval_command(a, model: str, engine_kw: dict) -> int:
    """``dsv4 eval canary``: print the JSON report; with ``--check``, exit 1 on a drop past ``--margin``."""
    import json
    import time

    from . import recorded_accuracy

    tasks = TASKS if a.tasks is None else tuple(t.strip() for t in a.tasks.split(",") if t.strip())
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"--tasks: unknown task(s) {bad}; choose from {list(TASKS)}")
    examples = [ex for ex in heldout(a.per_task, recall_per_task=a.recall) if ex.task in tasks]
    t0 = time.time()
    res = evaluate_engine(model, examples, **engine_kw)
    from ..engine.settings import EngineConfig

    kv = EngineConfig(model=model, **engine_kw).kv_cache_dtype  # (fp8 → fp8_ds_mla, as the engine takes it)
    recorded = (recorded_accuracy(model) or {}).get(f"checkpoint/{kv}")
    report = {"model": model, "kv_cache_dtype": kv, "backend": engine_kw.get("backend"),
              "dtype": engine_kw.get("dtype"), "seconds": round(time.time() - t0, 1), "n": res["n"],
              "accuracy": res["accuracy"], "recorded": recorded}
    if "speculative" in res:
        report["speculative"] = res["speculative"]
    failed = []
    if recorded is not None:
        report["delta"] = {t: round(res["accuracy"][t] - recorded[t], 4) for t in res["accuracy"] if t in recorded}
        failed = [t for t, d in report["delta"].items() if d < -a.margin]
    if a.check:
        if recorded is None:
            raise ValueError(f"--check: {model} has no canary.json accuracy for kv cache dtype {kv!r}")
        report["check"] = {"margin": a.margin, "failed": failed, "pass": not failed}
    if a.outputs:
        report["outputs"] = res["outputs"]
    text = json.dumps(report, indent=2)
    print(text)
    if a.json_out:
        Path(a.json_out).write_text(text + "\n")
    return 1 if (a.check and failed) else 0


@torch.no_grad()
def evaluate_reference(model, examples: list[Example] | None = None, batch_tokens: int = 1 << 15) -> dict:
    """Greedy accuracy per task of a :class:`~dsv4.model.model.ReferenceModel` (dense caches).

    Prompts are prefilled together as one batch of sequence chunks (split to stay under
    ``batch_tokens``), then decoded one token per live sequence per step.
    """
    from ..model.step import SeqChunk

    examples = heldout() if examples is None else examples
    codec = CharCodec()
    dev = model.device
    gen: list[list[int]] = [[] for _ in examples]
    caches = [model.new_cache() for _ in examples]
    last = [0] * len(examples)
    order = list(range(len(examples)))
    while order:  # prefill in batches
        batch, size = [], 0
        while order and (not batch or size + len(prompt_ids(examples[order[0]], codec)) <= batch_tokens):
            i = order.pop(0)
            batch.append(i)
            size += len(prompt_ids(examples[i], codec))
        ids = [prompt_ids(examples[i], codec) for i in batch]
        chunks = [SeqChunk(caches[i], 0, len(p)) for i, p in zip(batch, ids)]
        ends = torch.tensor(list(_cumsum([len(p) for p in ids])), device=dev) - 1
        logits = model.forward(torch.tensor(sum(ids, []), device=dev), chunks, logits_rows=ends).logits
        for i, row in zip(batch, logits.argmax(dim=-1).tolist()):
            last[i] = row
    live = list(range(len(examples)))
    while live:
        for i in live:
            gen[i].append(last[i])
        live = [i for i in live if last[i] != codec.eos and len(gen[i]) < MAX_NEW[examples[i].task]]
        if not live:
            break
        chunks = [SeqChunk(caches[i], caches[i].num_tokens, 1) for i in live]
        logits = model.forward(torch.tensor([last[i] for i in live], device=dev), chunks).logits
        for i, row in zip(live, logits.argmax(dim=-1).tolist()):
            last[i] = row
    return summarize(examples, [answer_text(g, codec) for g in gen])


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s
