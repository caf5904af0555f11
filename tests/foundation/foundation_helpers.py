"""Shared helpers for tests/foundation (imported by its conftest and test files)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from dsv4.checkpoint.reader import INDEX_FILE

REAL_CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "reference" / "configs"
FLASH_0423 = REAL_CONFIGS / "DeepSeek-V4-Flash.config.json"
FLASH_0731 = REAL_CONFIGS / "DeepSeek-V4-Flash-0731.config.json"

DSPARK_FIELDS = {"dspark_block_size": 5, "dspark_noise_token_id": 128799,
                 "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256}


def flash_0423_dict() -> dict:
    if FLASH_0423.exists():
        return json.loads(FLASH_0423.read_text())
    from dsv4.checkpoint.synthetic import build_config  # the generator's transcription of the release

    return build_config("flash")


def flash_0731_dict() -> dict:
    if FLASH_0731.exists():
        return json.loads(FLASH_0731.read_text())
    d = flash_0423_dict()
    d["compress_ratios"] = d["compress_ratios"] + [0, 0]
    d.update(copy.deepcopy(DSPARK_FIELDS))
    return d


# ---- checkpoint corruption helpers --------------------------------------------------------------

class CkptCopy:
    """A writable copy of a checkpoint directory with small editing helpers."""

    def __init__(self, path: Path):
        self.path = path

    @property
    def index_path(self) -> Path:
        return self.path / INDEX_FILE

    def index(self) -> dict:
        return json.loads(self.index_path.read_text())

    def write_index(self, idx: dict) -> None:
        self.index_path.write_text(json.dumps(idx, indent=2))

    def shard_of(self, name: str) -> str:
        return self.index()["weight_map"][name]

    def shards(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    def rewrite_shard(self, fname: str, edit) -> None:
        """Load every tensor of one shard, let ``edit(dict)`` change it in place, write it back."""
        from safetensors.torch import load_file, save_file

        p = self.path / fname
        tensors = load_file(str(p))
        edit(tensors)
        save_file(tensors, str(p), metadata={"format": "pt"})


# ---- a small extra checkpoint ----------------------------------------------------------------------
# The tiny preset with 1 layer (+ MTP), a 512-token vocabulary and 4 experts: generated in about a
# second (embed/head/tid2eid and expert quantization dominate tiny's generation time). Nothing under
# test depends on those sizes.
SMALL_SEED = 7
SMALL_LAYERS = 1
SMALL_OVERRIDES = {"vocab_size": 512, "n_routed_experts": 4, "num_experts_per_tok": 2}


def write_small(out: Path, seed: int = SMALL_SEED) -> Path:
    from dsv4.checkpoint.synthetic import write_checkpoint

    return write_checkpoint(out, preset="tiny", layers=SMALL_LAYERS, seed=seed, overrides=SMALL_OVERRIDES,
                            progress=False)
