"""The canary's character-level tokenizer, written as a real ``tokenizer.json``.

One token per character keeps the vocabulary at 128 ids (so the embedding and head stay tiny) and
makes every task's answer a fixed number of tokens per digit. The file is an ordinary
``tokenizers`` WordLevel model, so :mod:`dsv4.chat.tokenizer` loads it like the release's: BOS and
EOS carry the DeepSeek-V4 strings at ids 0 and 1, and the chat-markup tokens exist as added
tokens so ``--chat`` prompts encode to single ids.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from ..chat.tokenizer import BOS_TOKEN, EOS_TOKEN

PAD_TOKEN = "<｜▁pad▁｜>"
UNK_TOKEN = "<｜unk｜>"
CHAT_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN]  # ids 0..3
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n+-*=:;,.?!#|()[]/_'\"<>@%&^~"
VOCAB_SIZE = 128


def vocab() -> list[str]:
    """Token strings in id order: specials, chat markup, characters, then reserved fillers."""
    toks = SPECIAL_TOKENS + CHAT_TOKENS + list(CHARS)
    if len(set(toks)) != len(toks):
        raise ValueError("canary vocabulary has a duplicate token")
    if len(toks) > VOCAB_SIZE:
        raise ValueError(f"canary vocabulary has {len(toks)} tokens, more than VOCAB_SIZE={VOCAB_SIZE}")
    return toks + [f"<｜reserved_{i}｜>" for i in range(VOCAB_SIZE - len(toks))]


def build_tokenizer():
    """A ``tokenizers.Tokenizer``: every character is one token, decoding concatenates."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    toks = vocab()
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token=UNK_TOKEN))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    reserved = [t for t in toks if t.startswith("<｜reserved_")]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + reserved])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TOKENS])
    return tk


def write_tokenizer(out_dir: str | Path, model_max_length: int) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tk = build_tokenizer()
    if tk.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise ValueError(f"canary tokenizer has {tk.get_vocab_size(with_added_tokens=True)} ids, expected {VOCAB_SIZE}")
    tk.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN,
        "model_max_length": model_max_length, "tokenizer_class": "PreTrainedTokenizerFast",
    }, ensure_ascii=False, indent=2) + "\n")
    return out / "tokenizer.json"


class CharCodec:
    """Fast encode/decode for training-data generation (no ``tokenizers`` call per sample).

    Gives the same ids as the written tokenizer.json for the characters of :data:`CHARS`
    (tests/canary checks this).
    """

    def __init__(self):
        self.tokens = vocab()
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.bos, self.eos, self.pad = 0, 1, 2
        self.user, self.assistant, self.think_end = (self.ids[t] for t in ("<｜User｜>", "<｜Assistant｜>", "</think>"))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the canary vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.tokens[i] for i in ids)
