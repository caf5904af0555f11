"""The vocabulary of the tiny checkpoint that tests/engine and tests/parallel run (``tiny_ckpt`` there).

Those tests send token ids, not text: with the release tokenizer's first SMALL_VOCAB tokens the logits GEMM
and the sampler cost a sixteenth of the release vocabulary's (they were about a fifth of an engine test's
time on CPU). Tests of text, chats and grammars take ``tiny_ckpt_release_vocab``.
"""

SMALL_VOCAB = 8192
RELEASE_TOKEN_HI = 129000  # random prompts of the release vocabulary: below its added tokens
