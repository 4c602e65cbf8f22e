"""Tokenizers: a built-in byte-level tokenizer that needs no files, or anything AutoTokenizer can load.

The byte tokenizer is the offline default: ids 0..255 are the raw UTF-8 bytes of the text and id 256 is
``<|endoftext|>`` (eos = bos = pad). It is built in code from fixed tables, so every process on every
machine gets the same ids without downloading or sharing a file.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from p2p_diloco.config import ConfigError, TokenizerConfig
from p2p_diloco.training.hub import load_named

BYTE_TOKENIZER = "byte"
EOS_TOKEN = "<|endoftext|>"


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table, the alphabet ``ByteLevel`` works in.

    Printable Latin-1 bytes map to themselves; the rest (control chars, space, ...) are shifted to 256+.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE with the 256 byte symbols as its whole vocabulary (id == byte value) and no merges."""
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the text is mapped byte by byte, so decode(encode(x)) == x exactly.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    # Added after the base vocab, so it gets id 256.
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def _load_pretrained(name: str) -> PreTrainedTokenizerFast:
    tok = load_named("tokenizer", name, AutoTokenizer.from_pretrained)
    if tok.eos_token is None:
        raise ConfigError(f"tokenizer {name} has no eos token; packed documents need one as a separator")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tokenizer(cfg: TokenizerConfig) -> PreTrainedTokenizerFast:
    """Build the tokenizer named by ``cfg``.

    Args:
        cfg: ``name_or_path == "byte"`` selects the built-in byte-level tokenizer (vocab 257); anything
            else is passed to ``AutoTokenizer.from_pretrained`` (a local directory, or a hub name already in
            the local cache, works offline: :mod:`.hub`).

    Returns:
        A fast tokenizer with an eos token and a pad token (pad defaults to eos).

    Raises:
        ConfigError: the tokenizer cannot be loaded, or it has no eos token.
    """
    name = cfg.name_or_path.strip()
    if not name:
        raise ConfigError("tokenizer.name_or_path is empty (use \"byte\" for the built-in tokenizer)")
    if name == BYTE_TOKENIZER:
        return _byte_tokenizer()
    return _load_pretrained(name)


def vocab_size(tok: PreTrainedTokenizerFast) -> int:
    """Number of ids the model must embed: the base vocab plus added tokens (``len(tok)``)."""
    return len(tok)
