"""Where ``data.path`` points, checked without torch or datasets: local files (a directory, a glob or one file) or a
hub dataset. Light, so that a command can check its data within a fraction of a second, before the heavy imports
(:func:`check_data_source`); :mod:`.data` loads what these functions found.
"""

from __future__ import annotations

import glob
import os

from p2p_diloco.config import ConfigError, DataConfig
from p2p_diloco.training.hub import looks_local

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def is_local(path: str) -> bool:
    """Whether ``data.path`` names local data (the built-in corpus, a path or a glob) rather than a hub dataset."""
    return (path.startswith("builtin:") or os.path.exists(path) or glob.has_magic(path) or looks_local(path)
            or path.endswith(tuple(BUILDERS)))


def resolve_data_files(path: str) -> list[str]:
    """The data files ``path`` names (a directory, a glob, or one file), sorted; ConfigError if none."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = [
            os.path.join(folder, f)
            for folder, dirs, names in os.walk(path)
            for f in names
            if f.endswith(tuple(BUILDERS)) and not f.startswith(".")
        ]
    else:
        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
    if files:
        return sorted(files)
    if os.path.isdir(path):
        raise ConfigError(f"no data files ({', '.join(BUILDERS)}) in directory {path}")
    if not glob.has_magic(path):
        raise ConfigError(f"data path {path} does not exist")
    raise ConfigError(f"no data files match {path}")


def check_has_text(files: list[str], path: str) -> None:
    """ConfigError when every file is empty (datasets' own error would be "An error occurred while generating ...")."""
    if any(os.path.getsize(f) > 0 for f in files):
        return
    if len(files) == 1:
        raise ConfigError(f"data file {files[0]} is empty: it has no text")
    raise ConfigError(f"every data file of {path} is empty ({len(files)} files, e.g. {files[0]}): they have no text")


def builder_for(files: list[str]) -> str:
    """The ``datasets`` builder that reads ``files`` (one file type per path)."""
    builders = {BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in builders:
        raise ConfigError(f"unsupported data file type in {files[0]}...; use {', '.join(BUILDERS)}")
    if len(builders) > 1:
        raise ConfigError(f"data files mix formats ({', '.join(sorted(builders))}); use one file type per path")
    return builders.pop()


def check_data_source(cfg: DataConfig) -> None:
    """Check ``data.path`` as far as it can be checked without loading anything: local files exist, have one
    supported type and are not all empty. A hub dataset is checked when it is loaded (:mod:`.hub`).

    Raises:
        ConfigError: the local data is missing, of a mixed or unsupported type, or empty.
    """
    if cfg.path.startswith("builtin:") or not is_local(cfg.path):
        return
    files = resolve_data_files(cfg.path)
    builder_for(files)
    check_has_text(files, cfg.path)
