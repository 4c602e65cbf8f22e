"""What the CLI's modules share: the usage exit code, the initial-peers variable, stderr logging, atomic JSON."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

EXIT_USAGE = 2
ENV_INITIAL_PEERS = "P2P_DILOCO_INITIAL_PEERS"

# One handler for the whole process: `join` starts it at WARNING (bad input must give a one-line error) and raises it
# to INFO once the peer is up (commands.cmd_join).
STDERR_HANDLER = logging.StreamHandler(sys.stderr)


def setup_logging(level: int) -> None:
    """Send log records of ``level`` and above to stderr, and quiet the chattiest libraries.

    Args:
        level: The level of :data:`STDERR_HANDLER`; the root logger itself passes INFO.
    """
    handler = STDERR_HANDLER
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in ("datasets", "transformers", "filelock", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # huggingface_hub prints every retry twice (its own handler and ours); its errors reach us as exceptions anyway.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    # No tqdm bars from datasets ("Generating train split"), the hub or transformers (which follows the hub's
    # setting): read when those libraries are first imported, which is after this. "0" in the environment keeps them.
    for var in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(var, "1")


def write_json_atomic(path: str | Path, obj) -> None:
    """Write JSON via a temp file + rename, so a reader never sees half a file.

    Args:
        path: The file to write; its directory is created if missing.
        obj: Anything :func:`json.dumps` takes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
