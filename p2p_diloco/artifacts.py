"""The paths ``eval`` and ``export`` are given, checked with the standard library only.

The CLI checks them before it imports torch and transformers (seconds), so that a typo is one line at once;
:mod:`p2p_diloco.export` checks them with the same functions, for its callers that are not the CLI.
"""

from __future__ import annotations

from pathlib import Path

from p2p_diloco.errors import UsageError


def given_checkpoint(path: str | Path) -> Path:
    """``path`` (user-expanded): a checkpoint file or a checkpoint directory, which must exist.

    Raises:
        UsageError: it is neither a file nor a directory.
    """
    p = Path(path).expanduser()
    if not (p.is_file() or p.is_dir()):
        raise UsageError(f"checkpoint not found: {p}")
    return p


def new_output_dir(out: str | Path) -> Path:
    """``out`` (user-expanded): where an export goes; it must not exist, or be an empty directory.

    Raises:
        UsageError: it exists and is a file or a non-empty directory.
    """
    p = Path(out).expanduser()
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise UsageError(f"{p} already exists and is not an empty directory")
    return p
