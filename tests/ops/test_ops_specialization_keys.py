"""Which Triton specializations a step shape produces, listed without a GPU (``dsv4.ops.compiles``).

A specialization the start-up did not build is compiled in a request's path: seconds of stall for
every stream. Triton picks one from each launch's constexprs, each integer argument's class (1,
divisible by 16, other) and each pointer's 16-byte alignment; here the keys are computed from the
arguments as Triton's binder computes them, with no kernel run (``recording(launch=...)``: only the
greedy sampler's kernels run, everything else leaves zeroed outputs), so a shape that brings a new
key fails on any CPU. The GPU twin, which counts real builds, is
``tests/gpu/test_gpu_no_compiles_after_startup.py``.
"""

import random

import pytest
import torch

from dsv4.engine.precompile import list_launches, zeroed_allocations
from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM
from dsv4.ops import compiles
from dsv4.ops.triton import greedy

MAX_LEN, SEQS, BUDGET = 512, 8, 1024  # a step may be longer than a prompt: several prompts
GREEDY = (greedy._chunk_kernel, greedy._row_kernel)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), backend="triton", kv_cache_dtype="fp8_ds_mla", dtype="bfloat16", enforce_eager=True,
              max_model_len=MAX_LEN, kv_cache_memory=1 << 28, max_num_seqs=SEQS, max_num_batched_tokens=BUDGET,
              warm_up=False)
    # the sampler's greedy pick through torch (None: the torch op): interpreted over the vocabulary it
    # would be most of these tests' time, and its keys (one per vocabulary size) are not what they are about
    llm.engine.ops.greedy_pick = None
    return llm.engine


@pytest.fixture(scope="module")
def warm(engine):
    """The start-up's keys: the warm-up plan's launches (what ``precompile`` lists and builds)."""
    return list_launches(engine, None)


def _run(eng, batches):
    """Each batch: requests (prompt ids, max_tokens) added together, a few steps, the next batch arriving
    while it decodes; then every request to its end."""
    for b, batch in enumerate(batches):
        for i, (ids, out) in enumerate(batch):
            eng.add_request(prompt_token_ids=ids, request_id=f"b{b}-{i}",
                            params=SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
        for _ in range(3):
            if eng.has_unfinished_requests():
                eng.step()
    while eng.has_unfinished_requests():
        eng.step()


def _keys_of(eng, batches):
    with compiles.recording(launch=GREEDY) as rec, zeroed_allocations(), torch.no_grad():
        _run(eng, batches)
    return rec


def _new(rec, warm):
    return [compiles.Launches.diff(k, warm.keys) for k in rec.new_since(warm)]


def test_the_warm_up_lists_the_attention_path_kernels(warm):
    names = warm.kernels()
    for k in ("_sparse_attn_kernel", "_compressor_kernel", "_indexer_logits_kernel", "_fp8_linear_kernel",
              "_moe_up_kernel", "_kv_norm_rope_insert_kernel"):
        assert k in names, f"{k} not launched by the warm-up: {sorted(names)}"
    # a kernel meets its step's shapes only through do_not_specialize'd integers and pointers: one key per
    # (layer kind, tile) — far fewer than the warm-up's launches
    assert len(warm.keys) < sum(warm.keys.values()) / 10


def test_step_shapes_that_used_to_build_in_the_request_path_bring_no_new_key(engine, warm):
    """Shapes the H200 saw building: one-block tables (n_blocks = stride = 1), tables and token ids staged at
    offsets that are not 16-byte aligned (odd totals before them), odd counts of closing tokens, a prefix hit,
    ragged mixes of decodes and prefill chunks, and steps of the whole budget made of several prompts (the
    attention's keys decoded once from 512 tokens, the dense GEMMs' prefill tile from 1,024)."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(300)]
    batches = [
        [([7], 2)],  # one token, one block
        [([rng.randrange(3, 1000) for _ in range(n)], 2) for n in (3, 17, 5)],  # odd staged offsets
        [(shared + [9, 10, 11], 3), ([4] * 33, 2)],
        [(shared + [12], 2), ([5] * 257, 1)],  # prefix hit beside a chunked prefill
        [([6] * (MAX_LEN - 20), 3), ([8] * 2, 4), ([9] * 129, 1)],
        [([rng.randrange(3, 1000) for _ in range(BUDGET // SEQS)], 2) for _ in range(SEQS)],
        [([rng.randrange(3, 1000) for _ in range(300)], 1) for _ in range(2)],
    ]
    new = _new(_keys_of(engine, batches), warm)
    assert not new, "specializations the warm-up did not list:\n" + "\n".join(new)


def test_a_random_workload_brings_no_new_key(engine, warm):
    rng = random.Random(11)
    batches = []
    for _ in range(3):
        batch = []
        for _ in range(rng.randint(1, SEQS)):
            n = rng.choice([1, 2, rng.randint(3, 64), rng.randint(65, 300), rng.randint(300, MAX_LEN - 20)])
            batch.append(([rng.randrange(3, 1000) for _ in range(n)], rng.randint(1, 6)))
        batches.append(batch)
    new = _new(_keys_of(engine, batches), warm)
    assert not new, "specializations the warm-up did not list:\n" + "\n".join(new)


def test_a_recipe_rebuilds_the_key_it_was_recorded_with(warm):
    """What ``precompile``'s workers compile is the recorded specialization: the stand-in arguments of a
    recipe (dtype, alignment, the integers and constexprs themselves) give the same key."""
    import importlib

    assert warm.recipes
    for key, (module, name, named) in warm.recipes.items():
        kernel = getattr(importlib.import_module(module), name)
        args = {k: (compiles._MockTensor(v[1], v[2]) if v[0] == "tensor" else v[1]) for k, v in named.items()}
        assert compiles.launch_key(kernel, (), args) == key, name


def test_launch_keys_follow_tritons_rules():
    """The key's classes: integers 1 / divisible by 16 / other unless do_not_specialize'd, pointers aligned
    or not, constexprs by value — and a kernel's do_not_specialize list removes the class."""
    from dsv4.ops.triton.sparse_attention import _sparse_attn_kernel as k

    names = [p[0] for p in compiles._params(k)]
    base = {n: 16 for n in names}
    x = torch.zeros(8, dtype=torch.int64)
    base.update(q_ptr=x, pos_ptr=x[1:], BLOCK_H=16)
    spec = dict((a[0], a[1:]) for a in compiles.launch_key(k, (), base)[1])
    assert spec["q_ptr"] == ("*i64", "D") and spec["pos_ptr"] == ("*i64", None)  # (pos_ptr: do_not_specialize)
    assert spec["H"] == ("i32", "D") and spec["Lc"] == ("i32", None)
    assert spec["BLOCK_H"] == ("constexpr", "16")
    one = dict((a[0], a[1:]) for a in compiles.launch_key(k, (), {**base, "H": 1, "Lc": 1})[1])
    assert one["H"] == ("constexpr", 1) and one["Lc"] == ("i32", None)


def test_worker_processes_rebuild_every_listed_key(warm):
    """``precompile``'s step 2: every recipe pickles, its kernel resolves in a fresh (spawned) process and
    its stand-in arguments give the recorded key there. (On the CPU the interpreter compiles nothing; the
    GPU test counts the real builds.)"""
    from dsv4.engine.precompile import build_parallel

    counts, built = build_parallel(list(warm.recipes.values()), workers=2)
    assert counts["failed"] == 0 and sorted(built) == sorted(warm.recipes)
    # a recipe that cannot be built is counted and left to the warm-up; the others are built
    good = next(iter(warm.recipes.values()))
    counts, built = build_parallel([("dsv4.ops.triton.dense", "_no_such_kernel", {}), good], workers=2)
    assert counts == {"built": 1, "failed": 1, "seconds": counts["seconds"]} and len(built) == 1


def test_a_plan_built_before_is_not_listed_again(engine, tmp_path, monkeypatch):
    from dsv4.engine import precompile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    digest = precompile.plan_digest(engine)
    assert precompile.plan_digest(engine) == digest  # (a function of the settings, not of the object)
    assert not precompile._manifest_has(digest)
    precompile.record_built(digest)
    assert precompile.precompile(engine, None, workers=2, digest=digest) is None
