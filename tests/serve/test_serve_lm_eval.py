"""lm-eval's ``local-completions`` model runs two tiny local tasks against the server, offline.

* ``tiny_mc``: multiple_choice → loglikelihood requests (echo + logprobs, token-id prompts);
* ``tiny_gen``: generate_until with a stop sequence and a small max_gen_toks.

The tasks are YAML + jsonl written to the test's tmp dir; lm-eval tokenizes with the checkpoint's
tokenizer.json through transformers (tokenizer_backend=huggingface).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import httpx
import pytest
from serve_test_support import metric

for _dep in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_dep)

HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None

pytestmark = pytest.mark.skipif(
    not HAVE_LM_EVAL, reason='lm-eval is not installed (pip install "lm-eval[api]==0.4.13")'
)

MC = [
    {"question": "What color is the sky?", "choices": ["blue", "green", "red"], "label": 0},
    {"question": "How many legs does a cat have?", "choices": ["two", "four"], "label": 1},
    {"question": "Which is a fruit?", "choices": ["carrot", "apple", "stone"], "label": 1},
]
GEN = [
    {"question": "Say hello.", "answer": "hello"},
    {"question": "Count to three.", "answer": "1 2 3"},
]


def _write_tasks(root) -> str:
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (tasks / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN))
    (tasks / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
""")
    (tasks / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return str(tasks)


# `lm_eval --model local-completions --model_args ... --include_path TASKS --tasks tiny_mc,tiny_gen --limit 3`
# through lm-eval's Python entry point, in a subprocess: the same model class, requests and
# evaluation, minus the CLI's indexing of its ~13,000 built-in task YAMLs (about 25 s here).
RUNNER = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

model_args, tasks, out = sys.argv[1:4]
res = simple_evaluate(model="local-completions", model_args=model_args, tasks=["tiny_mc", "tiny_gen"],
                      limit=3, batch_size=1, log_samples=False,
                      task_manager=TaskManager(include_path=tasks, include_defaults=False))
json.dump(res["results"], open(out, "w"), default=str)
"""


def test_lm_eval_local_completions(real_server, tiny_ckpt, tmp_path):
    tasks = _write_tasks(tmp_path)
    out = tmp_path / "results.json"
    model_args = (
        f"model=tiny,base_url={real_server.url}/v1/completions,tokenizer={tiny_ckpt},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,timeout=300"
    )
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        TOKENIZERS_PARALLELISM="false",
    )
    r = subprocess.run(
        [sys.executable, "-c", RUNNER, model_args, tasks, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"lm-eval failed:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    results = json.loads(out.read_text())
    assert 0.0 <= results["tiny_mc"]["acc,none"] <= 1.0
    assert "exact_match,none" in results["tiny_gen"]
    # every request came through the server: 8 loglikelihood choices + 2 generations
    metrics = httpx.get(real_server.url + "/metrics").text
    assert metric(metrics, "http_requests_total", handler="/v1/completions", status="2xx") == 10
    assert real_server.on_engine(lambda e: e.kv.leaks()) == []
