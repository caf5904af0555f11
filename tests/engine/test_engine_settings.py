"""Engine settings are defined once (``dsv4.engine.settings``): ``LLM`` checks its keywords against
them, every command's engine flags come from them, and a bad value names the setting."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dsv4.engine.settings import EngineConfig, add_cli_args, cli_settings


def test_llm_refuses_an_unknown_setting_by_name(tiny_ckpt):
    from dsv4 import LLM

    with pytest.raises(TypeError, match=r"unknown setting\(s\) 'max_num_sequences'.*max_num_seqs"):
        LLM(str(tiny_ckpt), max_num_sequences=4)


@pytest.mark.parametrize("field,value,needle", [
    ("dtype", "float64", "dtype must be one of"),
    ("kv_cache_dtype", "fp16", "kv_cache_dtype must be one of"),
    ("backend", "cuda", "backend must be one of"),
    ("attention", "flash", "attention must be one of"),
    ("max_num_seqs", 0, "max_num_seqs must be at least 1"),
    ("max_model_len", 0, "max_model_len must be at least 1"),
    ("kv_cache_memory", -1, "kv_cache_memory must be positive"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in (0, 1]"),
])
def test_a_bad_value_names_the_setting(field, value, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EngineConfig(model="m", **{field: value})


@pytest.mark.parametrize("extra,needle", [
    ({}, r"data_parallel_size=2 needs enable_expert_parallel=True \(--enable-expert-parallel\)"),
    ({"enable_expert_parallel": True, "nnodes": 2}, "data_parallel_size=2 with nnodes=2"),
    ({"enable_expert_parallel": True, "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
     "data_parallel_size=2 with speculative_config=.*single process only"),
])
def test_data_parallel_layouts_that_are_not_implemented_are_refused_by_name(extra, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(model="m", data_parallel_size=2, **extra)
    ok = EngineConfig(model="m", data_parallel_size=2, enable_expert_parallel=True)
    EngineConfig(model="m", data_parallel_size=2, enable_expert_parallel=True, tensor_parallel_size=2)  # TP in DP
    assert ok.parallel and not EngineConfig(model="m", enable_expert_parallel=True).parallel
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        EngineConfig(model="m", data_parallel_size=0)


def test_fp8_is_an_alias_of_fp8_ds_mla():
    assert EngineConfig(model="m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8_ds_mla"


def test_every_setting_but_the_model_is_a_flag_with_its_default_and_help():
    p = argparse.ArgumentParser()
    add_cli_args(p)
    flags = {a.dest: a for a in p._actions if a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert set(flags) == fields
    for name, action in flags.items():
        assert action.help and "default:" in action.help, name
    assert "-tp" in flags["tensor_parallel_size"].option_strings
    assert "-dp" in flags["data_parallel_size"].option_strings
    ns = p.parse_args([])
    got = cli_settings(ns)
    assert EngineConfig(model="m", **got) == EngineConfig(model="m")  # the flags' defaults are the settings'
    ns = p.parse_args(["--kv-cache-memory", "512", "--no-enable-prefix-caching", "-tp", "2", "--enforce-eager",
                       "--no-async-scheduling", "--max-model-len", "4096", "--device", "cpu", "-dp", "3"])
    got = cli_settings(ns)
    assert got["kv_cache_memory"] == 512 << 20 and got["enable_prefix_caching"] is False  # MiB on the command line
    assert got["tensor_parallel_size"] == 2 and got["enforce_eager"] and got["async_scheduling"] is False
    assert got["max_model_len"] == 4096 and got["device"] == "cpu" and got["data_parallel_size"] == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--backend", "cuda"])


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "x"], ["probe"], ["eval", "canary"]])
def test_the_commands_take_every_engine_flag(command):
    from dsv4.cli import build_parser

    p = build_parser()
    a = p.parse_args(command + ["--max-num-seqs", "3", "--act-quant", "--seed", "7"])
    s = cli_settings(a)
    assert s["max_num_seqs"] == 3 and s["act_quant"] is True and s["seed"] == 7


def test_the_engine_copies_the_config_it_resolves(tiny_ckpt):
    from dsv4.engine.engine import LLMEngine

    cfg = EngineConfig(model=str(tiny_ckpt), kv_cache_memory=64 << 20, max_model_len=256, max_num_seqs=2)
    eng = LLMEngine(cfg)
    assert cfg.fp8_format == "auto" and cfg.async_scheduling is None  # the caller's object is untouched
    assert eng.config.fp8_format in ("ocp", "fnuz") and eng.config.async_scheduling is False
    assert eng.numerics is eng.kv_cache.numerics is eng.model.numerics  # built once, handed down


def test_dspark_drafting_under_tensor_parallelism_is_refused_by_name():
    """MTP drafting runs under tensor parallelism (tests/parallel); DSpark's passes do not yet."""
    dspark = {"method": "dspark", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="tensor_parallel_size=2, nnodes=1: DSpark drafting runs in a single process"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative_config=dspark)
    EngineConfig(model="m", tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_kv_cache_sizing_hands_the_allocators_cache_back_before_reading_free_memory(monkeypatch):
    """On a GPU the KV budget is what ``gpu_memory_utilization`` leaves of the driver's free memory; the
    blocks the caching allocator kept from loading (e.g. the originals of the weights stacked at load) are
    returned first, or the driver would count them as used. An explicit ``kv_cache_memory`` wins."""
    import torch

    from dsv4.engine.build import kv_cache_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def mem_get_info(device):
        calls.append("mem_get_info")
        return (60 << 30) if "empty_cache" in calls else (59 << 30), 100 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    cfg = EngineConfig(model="m", gpu_memory_utilization=0.5)
    assert kv_cache_memory(cfg, torch.device("cuda")) == 10 << 30
    assert calls == ["empty_cache", "mem_get_info"]
    assert kv_cache_memory(EngineConfig(model="m", kv_cache_memory=123), torch.device("cuda")) == 123
    assert kv_cache_memory(cfg, torch.device("cpu")) == 1 << 30
