"""The embedded canary is a small, valid release-format checkpoint with its own tokenizer, and the
training tool still runs end to end on the reference model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from dsv4.canary.model import checkpoint_tensors, load_params
from dsv4.canary.tasks import TASKS
from dsv4.canary.tokenizer import CharCodec, build_tokenizer
from dsv4.checkpoint.inspect import inspect_checkpoint
from dsv4.checkpoint.reader import Checkpoint
from dsv4.config import LayerType, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_embedded_checkpoint_is_valid_small_and_every_layer_kind(canary_dir):
    text, ok = inspect_checkpoint(canary_dir)
    assert ok, text
    size = sum(p.stat().st_size for p in Path(canary_dir).iterdir())
    assert size < 12 * 2**20, f"canary is {size / 2**20:.1f} MiB"
    cfg = load_config(canary_dir)
    assert cfg.layer_types == [LayerType.SWA, LayerType.CSA, LayerType.HCA, LayerType.CSA]
    assert cfg.is_hash_layer(0) and not cfg.is_hash_layer(1) and cfg.num_mtp_layers == 1
    assert cfg.head_dim == 512 and cfg.sliding_window == 128 and cfg.compress_ratio(2) == 32
    assert cfg.index_topk == 16 and cfg.expert_dtype == "fp4" and cfg.quant.scale_fmt == "ue8m0"
    specs = Checkpoint(canary_dir).specs
    assert specs["layers.1.attn.wq_b.weight"].dtype == "F8_E4M3"
    assert specs["layers.1.ffn.experts.0.w1.weight"].dtype == "I8"  # MXFP4, two values per byte


def test_tokenizer_json_is_the_builders_and_loads_in_the_engine(canary_dir):
    from dsv4.chat.tokenizer import load_tokenizer

    committed = json.loads(Path(canary_dir, "tokenizer.json").read_text())
    assert committed == json.loads(build_tokenizer().to_str())
    tok, cfg, codec = load_tokenizer(canary_dir), load_config(canary_dir), CharCodec()
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id) == (0, 1)
    assert tok.vocab_size == cfg.vocab_size == 128
    text = "copy:k3x9q=\n12+34=46; ab:123;?ab="
    assert tok.encode(text) == codec.encode(text) and tok.decode(tok.encode(text)) == text
    assert len(tok.encode("<｜User｜>1+1=<｜Assistant｜></think>")) == 7


def test_canary_json_records_accuracy_per_task_and_cache_dtype(canary_info, held):
    for key in ("checkpoint/auto", "checkpoint/fp8_ds_mla"):
        assert set(canary_info["accuracy"][key]) == set(TASKS)
        masks = canary_info["correct"][key]
        for t in TASKS:
            n = sum(e.task == t for e in held)
            assert len(masks[t]) == n and canary_info["accuracy"][key][t] == round(masks[t].count("1") / n, 4)


def test_export_reproduces_the_committed_weights(canary_dir):
    """Exporting the stored values again gives the same checkpoint (same keys, dtypes, shapes and
    decoded values): the writer is the release format and training resumes from exactly it.

    Bytes can differ where a 128×128 block's largest code is exactly 224: the re-derived UE8M0
    scale is then half as large and every code one exponent step higher, the same values.
    """
    from safetensors.torch import load_file

    from dsv4.formats import dequantize_block_fp8, dequantize_mxfp4

    ckpt = Checkpoint(canary_dir)
    on_disk = {}
    for p in Path(canary_dir).glob("*.safetensors"):
        on_disk.update(load_file(str(p)))
    again = checkpoint_tensors(load_params(canary_dir), ckpt.config)
    assert set(again) == set(on_disk)

    def decoded(t, name):
        spec = ckpt.specs[name]
        stem = name[: -len(".weight")]
        if spec.role == "fp8_weight":
            return dequantize_block_fp8(t[name], t[stem + ".scale"])
        if spec.role == "fp4_weight":
            return dequantize_mxfp4(t[name], t[stem + ".scale"])
        return t[name]

    for name, spec in ckpt.specs.items():
        assert again[name].dtype == on_disk[name].dtype and again[name].shape == on_disk[name].shape, name
        if not spec.role.endswith("_scale"):
            assert torch.equal(decoded(again, name), decoded(on_disk, name)), name


def test_cli_defaults_to_the_canary(canary_dir):
    from dsv4.cli import _model_or_canary, build_parser

    p = build_parser()
    for argv in (["generate", "--prompt", "1+1="], ["probe"], ["serve"], ["eval", "canary"]):
        a = p.parse_args(argv)
        assert getattr(a, "model", None) is None and _model_or_canary(a.model) == canary_dir
    assert _model_or_canary("/some/dir") == "/some/dir"


def test_training_tool_runs_one_step_and_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "c"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "train_canary.py"), "--out", str(out), "--device", "cpu",
                        "--max-steps", "1", "--seqs", "1", "--seq-len", "160", "--recall-len", "150", "150",
                        "--evals", "", "--eval-per-task", "1", "--eval-recall", "1", "--far-from", "1.0",
                        "--near-eval", "2", "--swiglu-limit", "4"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trained 1 steps" in r.stdout and "near-recall" in r.stdout
    assert "in-window recall (fp32 weights, 2 examples" in r.stdout
    text, ok = inspect_checkpoint(out)
    assert ok, text
    info = json.loads((out / "canary.json").read_text())
    assert info["steps"] == 1 and 0.0 <= info["diagnostics"]["recall_in_window_fp32"] <= 1.0
    assert json.loads((out / "config.json").read_text())["swiglu_limit"] == 4.0  # the clamp it was trained with


def test_near_recall_batches_keep_every_question_inside_the_window():
    """The curriculum's first phase (``--far-from``): each answered record starts fewer than
    window (128) tokens before its answer, so plain attention can see it."""
    import random

    from dsv4.canary.data import make_batch
    from dsv4.canary.tokenizer import CharCodec

    codec, rng, asked = CharCodec(), random.Random(1), 0
    for seq in make_batch(rng, codec, 8, 600, (150, 400), n_recall=2, near=True):
        tok = [codec.decode([t]) if len(codec.decode([t])) == 1 else "\0" for t in seq.ids]  # 1 char per token
        text = "".join(tok)
        for i, ch in enumerate(text):
            if ch == "?" and i + 3 < len(text) and text[i + 3] == "=" and text[i + 1: i + 3].isalpha():
                rec = text.rfind(text[i + 1: i + 3] + ":", 0, i)
                if rec >= 0:
                    asked += 1
                    assert (i + 4) - rec < 128, text[rec: i + 8]
    assert asked >= 16


def test_far_distance_questions_ask_records_in_the_given_range():
    """``--far-distance 130 250``: far questions ask records just beyond the window; the default
    asks any record at least FAR (150) tokens back."""
    import random

    from dsv4.canary.data import recall_sequence
    from dsv4.canary.tasks import FAR
    from dsv4.canary.tokenizer import CharCodec

    codec, rng = CharCodec(), random.Random(2)
    for far, lo, hi in (((130, 250), 130, 250), (None, FAR, 10 ** 9)):
        dists = []
        for _ in range(20):
            seq = recall_sequence(rng, codec, 600, 700, queries=6, p_far=1.0, far=far)
            text = "".join(codec.decode([t]) if len(codec.decode([t])) == 1 else "\0" for t in seq.ids)
            for i, ch in enumerate(text):
                if ch == "?" and text[i + 3] == "=":
                    dists.append(i - text.rfind(text[i + 1: i + 3] + ":", 0, i))
        assert len(dists) >= 40 and all(lo <= d <= hi for d in dists), (far, min(dists), max(dists))
    assert max(dists) > 250  # the default reaches further back


def _chars(codec, ids):
    return "".join(codec.decode([t]) if len(codec.decode([t])) == 1 else "\0" for t in ids)


def test_heldout_recall_is_a_dense_cluster_in_filler_asked_from_beyond_the_window():
    """The held-out recall: 3-8 records back to back inside ``.`` filler, the asked one at least
    FAR tokens before the question (only the compressed caches can carry it)."""
    from dsv4.canary.tasks import CLUSTER, FAR, FILLER, RECORD_LEN, heldout

    rec = [e for e in heldout(32, recall_per_task=24) if e.task == "recall"]
    assert len(rec) == 24
    for e in rec:
        body, key = e.prompt[: e.prompt.rindex("?")], e.prompt[-3:-1]
        cluster = body.strip(FILLER)
        assert FILLER not in cluster and len(cluster) % RECORD_LEN == 0
        assert CLUSTER[0] <= len(cluster) // RECORD_LEN <= CLUSTER[1]
        assert body.count(key + ":") == 1 and f"{key}:{e.answer};" in cluster
        assert len(body) - body.index(key + ":") >= FAR


def test_haystack_questions_ask_records_beyond_the_given_distance():
    """Training's far recall (``--far-distance LO HI``): every record of the cluster starts more
    than LO tokens before every question; near sequences keep the questions in the window."""
    import random

    from dsv4.canary.data import haystack_sequence
    from dsv4.canary.tokenizer import CharCodec

    codec, rng = CharCodec(), random.Random(3)
    for p_far, lo, hi in ((1.0, 130, 10 ** 9), (0.0, 0, 128)):
        dists = []
        for _ in range(20):
            seq = haystack_sequence(rng, codec, 300, 700, queries=6, p_far=p_far, far=(130, 250))
            text = _chars(codec, seq.ids)
            for i, ch in enumerate(text):
                if ch == "?" and text[i + 3] == "=":
                    r = text.rfind(text[i + 1: i + 3] + ":", 0, i)
                    dists.append(i - r)
                    assert text[i + 4: i + 7] == text[r + 3: r + 6]  # the answer is the record's value
        assert len(dists) >= 20 and all(lo < d < hi for d in dists), (p_far, min(dists), max(dists))
