"""Training text: load documents with `datasets`, hold some out for eval, and pack tokens into fixed rows.

``data.path`` is ``builtin:stdlib`` (this interpreter's standard-library ``.py`` files: always there, so
a fresh checkout trains offline), local files (a directory, a glob, or one ``.txt``/``.json(l)``/``.parquet``
file), or else a hub dataset (streamed by default). Every peer sees the same train/eval split (a hash
of each document, or a separate ``eval_split``) but reads the training documents in its own seeded order.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import sys
import sysconfig
from collections import deque
from functools import lru_cache
from typing import TYPE_CHECKING, Iterator, Union

import numpy as np
import torch

from p2p_diloco.config import ConfigError, DataConfig
from p2p_diloco.training.hub import check_hub_dataset, explain, offline_mode, short_reason
from p2p_diloco.training.rows import Rows
from p2p_diloco.training.sources import builder_for, check_has_text, is_local, resolve_data_files

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

BUILTIN_STDLIB = "builtin:stdlib"
TOKENIZE_CHUNK = 64  # documents per tokenizer call: big enough to be fast, small enough to start quickly
HASH_PREFIX = 2048  # characters of a document that decide its split

# datasets (and pandas, pyarrow) is imported only for data it loads: the built-in corpus is Rows (rows.py).
Documents = Union["Dataset", "IterableDataset", Rows]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- loading


@lru_cache(maxsize=2)
def _stdlib_sources(max_bytes: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(relative paths, texts) of the stdlib ``.py`` files, in path order, capped at ``max_bytes`` of UTF-8."""
    root = sysconfig.get_paths()["stdlib"]
    rels = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]  # third-party code
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        rels += [f if rel == "." else f"{rel}/{f}" for f in files if f.endswith(".py")]
    paths, texts, total = [], [], 0
    for rel in sorted(rels):
        if total >= max_bytes:
            break
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        data = text.encode("utf-8")[: max_bytes - total]  # cut the last file so the cap is exact
        paths.append(rel)
        texts.append(data.decode("utf-8", errors="ignore"))
        total += len(data)
    return tuple(paths), tuple(texts)


def _streamed(ds: Documents) -> bool:
    """Whether ``ds`` is a streaming dataset (only ``datasets`` makes those, so it is imported if ``ds`` is one)."""
    return "datasets" in sys.modules and isinstance(ds, sys.modules["datasets"].IterableDataset)


def _builtin_documents(cfg: DataConfig) -> Rows:
    if cfg.path != BUILTIN_STDLIB:
        raise ConfigError(f"unknown built-in corpus {cfg.path!r} (known: {BUILTIN_STDLIB})")
    paths, texts = _stdlib_sources(cfg.max_bytes)
    # "path" is the split key: stable even if a file's text changes between patch releases.
    return Rows({"text": list(texts), "path": list(paths)})


def _load(path: str, what: str, hub: bool = False, **kwargs) -> Documents:
    import datasets

    try:
        return datasets.load_dataset(path, **kwargs)
    except Exception as e:  # FileNotFoundError, DatasetNotFoundError, connection errors, bad JSON, ...
        if hub and offline_mode():
            reason = ("not in the datasets cache, and HF_HUB_OFFLINE is set: use local files (data.path = a "
                      "directory, glob or file), or download it once with internet")
        else:
            reason = explain(path, e, down=None) if hub else short_reason(e)  # explain: a gated dataset needs a login
        raise ConfigError(f"cannot load dataset {what}: {reason}") from None


def _select_text(ds: Documents, column: str, what: str) -> Documents:
    """Keep only the text column, renamed to ``"text"`` so the rest of the module needs no column name."""
    columns = ds.column_names
    if columns is None:  # a streaming dataset whose features are only known once read
        columns = list(next(iter(ds), {}).keys())
    if column not in columns:
        raise ConfigError(f"dataset {what} has no column {column!r} (columns: {', '.join(columns)})")
    ds = ds.select_columns([column])
    return ds if column == "text" else ds.rename_column(column, "text")


def load_documents(cfg: DataConfig, split: str) -> Documents:
    """All documents of one split, as a (map-style or streaming) dataset.

    Args:
        cfg: the ``[data]`` section.
        split: a split name. Local files and the built-in corpus hold a single split, ``cfg.train_split``.

    Returns:
        A dataset with a ``"text"`` column (the built-in corpus also has ``"path"``). It is an
        ``IterableDataset`` when streaming: ``streaming = "true"``, or ``"auto"`` for a hub dataset.

    Raises:
        ConfigError: nothing to load, an unknown split or column, or a loading failure.
    """
    local = is_local(cfg.path)
    streaming = cfg.streaming == "true" or (cfg.streaming == "auto" and not local)
    if local and (cfg.eval_split or split != cfg.train_split):
        raise ConfigError("local data has one split: leave data.eval_split empty to hold out documents by hash")
    if cfg.path.startswith("builtin:"):
        ds = _builtin_documents(cfg)
        return ds.to_iterable_dataset() if streaming else ds
    if local:
        files = resolve_data_files(cfg.path)
        builder = builder_for(files)
        check_has_text(files, cfg.path)
        # A .txt document is a paragraph: per-line documents would put an eos after every line.
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        ds = _load(builder, cfg.path, data_files=files, split="train", streaming=streaming, **extra)
    else:
        check_hub_dataset(cfg.path, streaming)  # seconds, not datasets' minute of retries, when the hub is unreachable
        ds = _load(cfg.path, f"{cfg.path}[{split}]", hub=True, name=cfg.name or None, split=split, streaming=streaming)
    return _select_text(ds, cfg.text_column, cfg.path)


def _held_out(key: str, fraction: float) -> bool:
    """Whether a document (identified by ``key``) belongs to eval: same answer on every machine."""
    return int(hashlib.sha256(key[:HASH_PREFIX].encode("utf-8")).hexdigest()[:8], 16) / 2**32 < fraction


def _split_by_hash(ds: Documents, cfg: DataConfig, want_eval: bool) -> Documents:
    key = "path" if cfg.path == BUILTIN_STDLIB else "text"

    def keep(batch: dict) -> list[bool]:
        return [_held_out(k, cfg.eval_fraction) == want_eval for k in batch[key]]

    if _streamed(ds):  # lazy: applied as documents stream past
        return ds.filter(keep, batched=True)
    # Map-style: collect the kept row numbers and select them in memory, which (unlike Dataset.filter)
    # writes no cache file for peers to race on and draws no progress bar.
    kept, start = [], 0
    for batch in ds.select_columns([key]).iter(batch_size=1000):
        kept += [start + i for i, flag in enumerate(keep(batch)) if flag]
        start += len(batch[key])
    return ds.select(kept, keep_in_memory=True)


def train_documents(cfg: DataConfig) -> Documents:
    """The training documents: ``train_split``, minus the hash-held-out ones when there is no ``eval_split``.

    Raises:
        ConfigError: loading failed, or (map-style data) no document is left for training.
    """
    ds = load_documents(cfg, cfg.train_split)
    ds = ds if cfg.eval_split or cfg.eval_fraction == 0 else _split_by_hash(ds, cfg, want_eval=False)
    if not _streamed(ds) and len(ds) == 0:
        raise ConfigError(f"no training documents in {cfg.path} after holding out eval documents "
                          "(lower data.eval_fraction)")
    return ds


def eval_documents(cfg: DataConfig) -> Documents:
    """The eval documents: ``eval_split`` if set, else the hash-held-out part of ``train_split``."""
    if cfg.eval_split:
        return load_documents(cfg, cfg.eval_split)
    return _split_by_hash(load_documents(cfg, cfg.train_split), cfg, want_eval=True)


# ----------------------------------------------------------------------------- packing


def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no eos token; packed documents need one as a separator")
    return tokenizer.eos_token_id


def _tokenize(tokenizer, texts: list[str], eos: int) -> list[np.ndarray]:
    """Token ids of each text followed by ``eos``. The tokenizer adds no special tokens of its own."""
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return [np.array([*t, eos], dtype=np.int64) for t in ids]


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    # Hash (seed, epoch) into one 63-bit seed: any int seed works and each epoch gets a fresh order.
    mixed = int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "big") >> 1
    return torch.randperm(n, generator=torch.Generator().manual_seed(mixed))


class PackedStream:
    """One peer's endless, deterministic stream of training batches.

    The stream is the concatenation, over epochs, of every training document (in a seeded order) each
    followed by eos, cut into rows of ``seq_len`` tokens. Documents are tokenized lazily, 64 at a time.

    The cursor (:meth:`state_dict`) is ``(epoch, doc, offset)``: the document at position ``doc`` of
    that epoch's order is the first not fully consumed, and ``offset`` of its tokens are used. A stream
    with the same seed resumes exactly from it. For streaming datasets the position counts documents
    in the shuffled stream: resuming re-reads and skips them, and is exact as long as the dataset and
    its shuffle are reproducible (the same files, seed and `datasets` version).
    """

    def __init__(self, tokenizer, cfg: DataConfig, seed: int, docs: Documents | None = None):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.seed = seed
        self.eos_id = _eos_id(tokenizer)
        self._docs = train_documents(cfg) if docs is None else docs  # docs: train_documents(cfg), loaded earlier
        self._texts: Iterator[str] | None = None  # the current epoch's remaining documents
        self._reset(epoch=0, doc=0)

    @property
    def tokens_per_batch(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len

    def close(self) -> None:
        """Close the document iterator now. A streaming dataset's iterator owns a thread pool; left to the garbage
        collector, its shutdown can run inside CPython's thread bootstrap and deadlock the process (seen here)."""
        texts, self._texts = self._texts, None
        if texts is not None:
            texts.close()

    def _reset(self, epoch: int, doc: int) -> None:
        self.close()
        self._epoch, self._next_doc = epoch, doc  # the next document to tokenize
        self._pending: deque[tuple[int, int, np.ndarray]] = deque()  # (epoch, doc, tokens) not yet used up
        self._offset = 0  # tokens of _pending[0] already used
        self._available = 0  # unused tokens in _pending

    def _epoch_texts(self, epoch: int, start: int) -> Iterator[str]:
        """The texts of ``epoch`` in this peer's order, from position ``start`` on."""
        if _streamed(self._docs):
            ds = self._docs.shuffle(seed=self.seed % 2**32, buffer_size=self.cfg.shuffle_buffer)
            ds.set_epoch(epoch)
            yield from itertools.islice((ex["text"] for ex in ds), start, None)
            return
        order = _permutation(len(self._docs), self.seed, epoch)
        for i in range(start, len(order), TOKENIZE_CHUNK):
            yield from self._docs[order[i : i + TOKENIZE_CHUNK].tolist()]["text"]

    def _fill(self) -> None:
        """Tokenize the next chunk of documents, moving on to the next epoch when one runs out."""
        chunk: list[tuple[int, int, str]] = []
        while len(chunk) < TOKENIZE_CHUNK:
            if self._texts is None:
                self._texts = self._epoch_texts(self._epoch, self._next_doc)
            text = next(self._texts, None)
            if text is None:
                if self._next_doc == 0:
                    raise ConfigError(f"no training documents in {self.cfg.path}")
                self._epoch, self._next_doc, self._texts = self._epoch + 1, 0, None
                continue
            chunk.append((self._epoch, self._next_doc, text))
            self._next_doc += 1
        for (epoch, doc, _), tokens in zip(chunk, _tokenize(self.tokenizer, [t for *_, t in chunk], self.eos_id)):
            self._pending.append((epoch, doc, tokens))
            self._available += len(tokens)

    def next_batch(self) -> torch.Tensor:
        """The next ``[batch_size, seq_len]`` LongTensor of token ids."""
        n = self.tokens_per_batch
        while self._available < n:
            self._fill()
        out = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            tokens = self._pending[0][2]
            take = min(len(tokens) - self._offset, n - filled)
            out[filled : filled + take] = tokens[self._offset : self._offset + take]
            filled += take
            self._offset += take
            if self._offset == len(tokens):
                self._pending.popleft()
                self._offset = 0
        self._available -= n
        return torch.from_numpy(out).view(self.cfg.batch_size, self.cfg.seq_len)

    def state_dict(self) -> dict:
        """A small JSON-serialisable cursor: ``{"epoch", "doc", "offset"}``."""
        if self._pending:
            epoch, doc, _ = self._pending[0]
            return {"epoch": epoch, "doc": doc, "offset": self._offset}
        return {"epoch": self._epoch, "doc": self._next_doc, "offset": 0}

    def load_state_dict(self, state: dict) -> None:
        """Resume from a cursor made by :meth:`state_dict` of a stream with the same seed and data."""
        epoch, doc, offset = (state.get(k) for k in ("epoch", "doc", "offset"))
        if not all(isinstance(v, int) and v >= 0 for v in (epoch, doc, offset)):
            raise ValueError(f"not a PackedStream state: {state!r}")
        self._reset(epoch, doc)
        if offset:
            self._fill()
            if offset >= len(self._pending[0][2]):
                raise ValueError(f"offset {offset} is past the end of document {doc} of epoch {epoch}")
            self._offset = offset
            self._available -= offset


def eval_batches(tokenizer, cfg: DataConfig, num_batches: int) -> list[torch.Tensor]:
    """The first ``num_batches`` eval batches (``[batch_size, seq_len]`` LongTensors), the same on every peer.

    The held-out documents are packed in their stored order, without shuffling. When they hold fewer tokens than
    ``num_batches`` batches need (a small dataset), the eval set shrinks to the whole batches they fill, with one
    warning: every peer holds out the same documents, so every peer shrinks it alike.

    Raises:
        ConfigError: the held-out documents do not fill even one batch.
    """
    eos = _eos_id(tokenizer)
    per_batch = cfg.batch_size * cfg.seq_len
    need = num_batches * per_batch
    if need <= 0:
        return []
    parts, have = [], 0
    for batch in eval_documents(cfg).iter(batch_size=TOKENIZE_CHUNK):
        parts += _tokenize(tokenizer, batch["text"], eos)
        have = sum(map(len, parts))
        if have >= need:
            break
    fits = min(num_batches, have // per_batch)
    if fits == 0:
        raise ConfigError(
            f"not enough eval text in {cfg.path}: {have} tokens held out, one eval batch needs {per_batch} "
            "(raise data.eval_fraction, set data.eval_split, or lower data.batch_size or data.seq_len)")
    if fits < num_batches:
        log.warning("only %d tokens of eval text in %s: evaluating on %d batch%s instead of eval.batches = %d "
                    "(raise data.eval_fraction for more)", have, cfg.path, fits, "" if fits == 1 else "es",
                    num_batches)
    flat = torch.from_numpy(np.concatenate(parts)[: fits * per_batch])
    return list(flat.view(fits, cfg.batch_size, cfg.seq_len).unbind(0))
