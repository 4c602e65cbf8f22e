"""Documents held in memory as columns of Python lists, for the built-in corpus.

The built-in corpus is a few MB of text already in memory; wrapping it in a ``datasets.Dataset`` cost every peer
process the import of ``datasets`` and, through it, pandas and pyarrow: 1.35 s of its ~7 s start on this 2-core
machine, for nothing the corpus needs. :class:`Rows` offers the part of ``datasets.Dataset``'s interface that
:mod:`p2p_diloco.training.data` uses on map-style documents, with the same results (``tests/unit/test_data.py``
compares the two), so the data order, and with it every digest, is the same as before.
"""

from __future__ import annotations

from typing import Iterator, Sequence


class Rows:
    """Columns of equal length, each a list of values; rows are addressed by position.

    Args:
        columns: column name -> values (all the same length).
    """

    def __init__(self, columns: dict[str, list]):
        lengths = {len(values) for values in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"columns of different lengths: {sorted(lengths)}")
        self._columns = columns
        self._len = lengths.pop() if lengths else 0

    @property
    def column_names(self) -> list[str]:
        """The column names, in their order."""
        return list(self._columns)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: int | Sequence[int]) -> dict:
        """One row (a dict of values) for an int; for a sequence of positions, a dict of column -> list."""
        if isinstance(key, int):
            return {name: values[key] for name, values in self._columns.items()}
        return {name: [values[i] for i in key] for name, values in self._columns.items()}

    def select_columns(self, names: Sequence[str]) -> Rows:
        """These columns only (the values are shared, not copied)."""
        missing = [n for n in names if n not in self._columns]
        if missing:
            raise ValueError(f"no column(s) {missing} (columns: {self.column_names})")
        return Rows({n: self._columns[n] for n in names})

    def select(self, indices: Sequence[int], keep_in_memory: bool = True) -> Rows:  # noqa: ARG002 (Dataset's API)
        """The rows at ``indices``, in that order."""
        return Rows({name: [values[i] for i in indices] for name, values in self._columns.items()})

    def iter(self, batch_size: int) -> Iterator[dict]:
        """Batches of up to ``batch_size`` rows, each a dict of column -> list, in row order."""
        for start in range(0, self._len, batch_size):
            yield {name: values[start:start + batch_size] for name, values in self._columns.items()}

    def to_iterable_dataset(self):
        """The same rows as a ``datasets.IterableDataset`` (``data.streaming = "true"``: imports ``datasets``)."""
        from datasets import Dataset

        return Dataset.from_dict(self._columns).to_iterable_dataset()
