"""0731-style checkpoints: the synthetic DSpark stages under the release's names, validated strictly
(a missing or misshapen draft tensor is an error naming it, expected vs found), the optional
confidence head, and the config's DSpark fields checked."""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint.reader import Checkpoint, CheckpointError
from dsv4.config import ConfigError, config_from_dict

SHARED = "mtp.1.ffn.shared_experts.w1"  # the tensors a public deployment once skipped for the draft
MARKOV = "mtp.2.markov_head.markov_w2.weight"
CONF = "mtp.2.confidence_head.proj.weight"


def _drop(ck, *names):
    """Remove tensors from their shards and the index."""
    idx = ck.index()
    for name in names:
        ck.rewrite_shard(ck.shard_of(name), lambda t, n=name: t.pop(n))
        del idx["weight_map"][name]
    ck.write_index(idx)


def _replace(ck, name, tensor):
    def edit(t):
        t[name] = tensor

    ck.rewrite_shard(ck.shard_of(name), edit)


def test_tiny_dspark_holds_the_release_names(tiny_dspark_ckpt):
    ck = Checkpoint(tiny_dspark_ckpt)
    assert ck.problems() == [] and set(ck.keys()) == set(ck.specs)
    cfg = ck.config
    assert cfg.is_dspark and cfg.num_dspark_stages == 3 and cfg.num_mtp_layers == 0
    h, r = cfg.hidden_size, cfg.dspark_markov_rank
    want = {"mtp.0.main_proj.weight": ("F8_E4M3", [h, 3 * h]), "mtp.0.main_proj.scale": ("F8_E8M0", [2, 6]),
            "mtp.0.main_norm.weight": ("BF16", [h]), "mtp.2.norm.weight": ("BF16", [h]),
            "mtp.2.hc_head_fn": ("F32", [4, 4 * h]), "mtp.2.markov_head.markov_w1.weight": ("BF16", [8, r]),
            MARKOV: ("BF16", [8, r]), CONF: ("BF16", [1, h + r]), f"{SHARED}.weight": ("F8_E4M3", [128, h])}
    assert {n: (ck.entries[n].dtype, list(ck.entries[n].shape)) for n in want} == want
    for m in range(3):
        assert f"mtp.{m}.attn.wkv.weight" in ck.entries and f"mtp.{m}.ffn.experts.15.w2.weight" in ck.entries


def test_a_missing_draft_tensor_is_an_error_naming_it(tiny_dspark_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_dspark_ckpt)
    _drop(ck, f"{SHARED}.weight", f"{SHARED}.scale")
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    msg = str(ei.value)
    assert "(2 problems)" in msg
    assert f"missing tensor '{SHARED}.weight' (expected F8_E4M3[128, 256])" in msg
    assert f"missing tensor '{SHARED}.scale' (expected F8_E8M0[1, 2])" in msg


def test_a_misshapen_or_mistyped_draft_tensor_is_an_error_naming_it(tiny_dspark_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_dspark_ckpt)
    _replace(ck, MARKOV, torch.zeros(8, 16, dtype=torch.bfloat16))
    _replace(ck, "mtp.0.main_proj.weight", torch.zeros(256, 768, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    msg = str(ei.value)
    assert f"tensor '{MARKOV}' in {ck.shard_of(MARKOV)}: shape expected [8, 32], found [8, 16]" in msg
    assert "tensor 'mtp.0.main_proj.weight'" in msg and "dtype expected F8_E4M3, found BF16" in msg


def test_the_confidence_head_is_optional_but_checked(tiny_dspark_ckpt, corrupt_copy):
    from dsv4.model.model import ReferenceModel

    ck = corrupt_copy(tiny_dspark_ckpt)
    fname = ck.shard_of(CONF)
    _drop(ck, CONF)
    assert Checkpoint(ck.path).problems() == []
    assert not ReferenceModel(ck.path).dspark.has_confidence
    assert ReferenceModel(tiny_dspark_ckpt).dspark.has_confidence
    ck.rewrite_shard(fname, lambda t: t.__setitem__(CONF, torch.zeros(1, 100, dtype=torch.bfloat16)))
    idx = ck.index()
    idx["weight_map"][CONF] = fname
    ck.write_index(idx)
    with pytest.raises(CheckpointError, match=rf"tensor '{CONF}' in {fname}: shape expected \[1, 288\], "
                                              r"found \[1, 100\]"):
        Checkpoint(ck.path)


@pytest.mark.parametrize("change,match", [
    ({"dspark_target_layer_ids": [40, 41, 43]}, r"'dspark_target_layer_ids' must be a non-empty list of layer ids "
                                                r"in 0\.\.42, found \[40, 41, 43\]"),
    ({"dspark_target_layer_ids": []}, "'dspark_target_layer_ids' must be a non-empty list"),
    ({"dspark_noise_token_id": 129280}, r"'dspark_noise_token_id' \(129280\) must be a token id below vocab_size"),
    ({"dspark_block_size": 0}, "'dspark_block_size' must be positive, found 0"),
    ({"dspark_markov_rank": None}, "field 'dspark_markov_rank' must be int, found None"),
    ({"compress_ratios": "main"}, "no DSpark stages"),
])
def test_dspark_fields_are_checked(flash_0731_dict, change, match):
    d = dict(flash_0731_dict)
    for k, v in change.items():
        d[k] = d["compress_ratios"][:43] if v == "main" else v
    with pytest.raises(ConfigError, match=match):
        config_from_dict(d)


def test_a_missing_dspark_field_is_named(flash_0731_dict):
    d = dict(flash_0731_dict)
    del d["dspark_markov_rank"]
    with pytest.raises(ConfigError, match="DSpark field 'dspark_markov_rank' is missing"):
        config_from_dict(d)


def test_presets_follow_the_release(flash_0731_dict):
    """flash-0731 is the release's config.json; a DSpark preset cut to fewer layers keeps its three
    stages and takes its target layers from the last ones."""
    from dsv4.checkpoint.synthetic import build_config

    assert build_config("flash-0731") == flash_0731_dict
    for preset in ("tiny-dspark", "flash-0731"):
        c = config_from_dict(build_config(preset, layers=6))
        assert (c.num_dspark_stages, c.dspark_target_layer_ids, c.num_hidden_layers) == (3, (3, 4, 5), 6)
