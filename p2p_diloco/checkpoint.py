"""Crash-safe checkpoints of a peer's full state (:class:`PeerState`) at a round boundary.

Files are written atomically, so a crash or Ctrl-C while saving never costs the previous checkpoint, and every
load is verified, so a damaged file is reported on one line instead of silently resuming from wrong weights.
Checkpoints are shared (``p2p-diloco eval`` / ``export`` of a file someone handed over), so a file is read with
``torch.load(weights_only=True)``: tensors, containers and plain values only, never an arbitrary pickle. A
crafted file that names any other class or function is refused with a one-line error before anything of it
runs. (Format 3 keeps the numpy RNG state as plain values; formats 1 and 2 kept a numpy array there, which is
let through as the one extra type they need.)
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import re
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2p_diloco.errors import UsageError
from p2p_diloco.outer.optimizer import digest, legacy_digest
from p2p_diloco.outer.shards import global_digest, shard_digest

FORMAT = 3  # 3: plain values only (the numpy RNG state as a list), read with weights_only=True
# 2: the digest covers theta and momentum, and the round certificate is kept (a numpy array in the RNG state);
# 1: digest of theta only, no certificate (whole theta only: read, and its digest recomputed)
OLD_FORMATS = {1, 2}
THETA_ONLY = {1}  # formats whose digest covers theta only
# what formats 1 and 2 need beyond weights_only's tensors and containers: numpy's RNG key array (no code runs)
# (the reconstructor is taken from an array, not from numpy's private module path, which numpy 2 renamed)
_NUMPY_ARRAY = [np.ndarray(0).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]
_NAME = re.compile(r"round-(\d{8,})\.pt")


class CheckpointError(UsageError):
    """A checkpoint is missing, unreadable, corrupt or belongs to another config."""


@dataclass
class PeerState:
    """Everything a peer needs to continue exactly from a round boundary."""

    round: int  # swarm round number r (theta is theta(r))
    fingerprint: str  # config fingerprint of the run that wrote the checkpoint
    global_digest: str  # digest(theta + momentum), checked on load
    theta: list[torch.Tensor]  # global weights
    momentum: list[torch.Tensor]  # outer Nesterov momentum buffers, one per tensor of theta
    model: dict  # model.state_dict() (local weights)
    inner_optimizer: dict  # inner AdamW state_dict()
    data: dict  # data stream cursor (plain Python values)
    rng: dict  # from capture_rng()
    extra: dict = field(default_factory=dict)  # counters: tokens_trained, rounds_participated, ...
    certificate: dict | None = None  # the round certificate of theta(round), as Certificate.to_json(); None: none


def capture_rng() -> dict:
    """RNG states of Python ``random``, the numpy global generator, torch CPU and (if in use) every CUDA device."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy = (name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))  # plain values (weights_only)
    state = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    # is_initialized, not is_available: a process that never touched CUDA has consumed no CUDA randomness, and
    # initialising CUDA here would break any later fork() and create contexts the peer never asked for.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Restore RNG states captured by :func:`capture_rng`."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]  # (keys: a list, or a numpy array in formats 1 and 2)
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        # A resumed peer may see fewer GPUs than the one that saved; devices it no longer has are irrelevant.
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def _saveable(obj: Any) -> Any:
    """Copy of nested dicts/lists/tuples with every tensor compact and on the CPU.

    A tensor that is a whole CPU storage is written as it is, not cloned: a clone of the model, the inner optimizer
    and the outer state would cost 20 bytes per parameter at every checkpoint (docs/scale.md). That is safe because
    nothing changes them while ``torch.save`` writes them: the peer saves from its training thread at a round
    boundary (no inner step runs), under the outer state's lock (no outer step lands). A view is cloned, or
    ``torch.save`` would write the whole storage behind it; a device tensor is copied to the CPU.
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        whole = (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size())
        return t if whole else t.cpu().clone()
    if isinstance(obj, dict):
        # copy.copy keeps the dict's class and attributes: state_dict()'s ``_metadata`` carries module versions.
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _saveable(v)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_saveable(v) for v in obj)
    return obj


def atomic_save(payload: Any, final: Path) -> None:
    """``torch.save`` to ``final`` atomically: after a crash ``final`` holds the old or the new complete file.

    The file is written under a ``.tmp-`` name in the same directory (so the rename cannot cross file systems),
    fsynced, renamed over the final name, and the directory is fsynced.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:  # KeyboardInterrupt too: never leave a half-written temp file behind
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if os.name == "posix":  # makes the rename itself durable; directories cannot be opened on Windows
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class CheckpointStore:
    """A directory of ``round-XXXXXXXX.pt`` checkpoints, keeping the newest ``keep``.

    Args:
        directory: where the checkpoints live; created (with parents) on the first save.
        keep: how many checkpoints to keep; below 1 raises ValueError.
    """

    def __init__(self, directory: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def save(self, state: PeerState) -> Path:
        """Write ``state`` atomically (:func:`atomic_save`) as ``round-{round:08d}.pt`` and prune old checkpoints.
        Returns the new checkpoint's path."""
        payload = {"format": FORMAT, **{f.name: _saveable(getattr(state, f.name)) for f in fields(PeerState)}}
        final = self.directory / f"round-{state.round:08d}.pt"
        atomic_save(payload, final)
        # Pruning only after the new file is in place, so there is always at least one complete checkpoint. The
        # file just written is never pruned, even when it has a lower round number than the ones on disk.
        others = [p for p in self.paths() if p != final]
        for old in others[: max(0, len(others) + 1 - self.keep)]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        return final

    def check_usable(self) -> None:
        """Create the directory if it is missing and make sure a file can be written in it: at start-up, before the
        peer joins a swarm (otherwise a run finds out at its first round boundary).

        Raises:
            CheckpointError: (one line) the path is a file, or the directory cannot be created or written.
        """
        d = self.directory
        if d.exists() and not d.is_dir():
            raise CheckpointError(f"checkpoint directory {d} is a file, not a directory: give a directory (it is "
                                  f"created if missing)")
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=d)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {d} is not usable: {e.strerror or e}") from None

    def paths(self) -> list[Path]:
        """Existing checkpoint files, oldest to newest by round number (stray and ``.tmp-`` files ignored)."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _NAME.fullmatch(p.name) and p.is_file()]
        return sorted(found, key=_round_of)

    def latest(self) -> Path | None:
        """The newest checkpoint, or None."""
        paths = self.paths()
        return paths[-1] if paths else None

    def load(self, path: Path | None = None, fingerprint: str | None = None) -> PeerState:
        """Load and verify a checkpoint; never modifies or deletes files.

        Args:
            path: the checkpoint to load; None for :meth:`latest`.
            fingerprint: if given, the checkpoint must have been written by a run with this config fingerprint.

        Raises:
            CheckpointError: (one line) no checkpoint, unreadable, corrupt or from another config. If an older
                checkpoint of the store verifies, the message points to it.
        """
        if path is None:
            path = self.latest()
            if path is None:
                raise CheckpointError(f"no checkpoint in {self.directory}")
        path = Path(path)
        try:
            return _read(path, fingerprint)
        except CheckpointError as err:
            older = self._older_good(path, fingerprint)
            hint = f" (an older checkpoint is at {older}; remove the bad file to resume from it)" if older else ""
            raise CheckpointError(f"{err}{hint}") from err

    def _older_good(self, bad: Path, fingerprint: str | None) -> Path | None:
        """Newest checkpoint older than ``bad`` that passes every check of :meth:`load`.

        Fully loading candidates is slow for big models, but this only runs on the error path, and a hint that
        points to another broken file would be worse than none.
        """
        match = _NAME.fullmatch(bad.name)
        if match is None:
            return None
        for candidate in reversed([p for p in self.paths() if _round_of(p) < int(match.group(1))]):
            with contextlib.suppress(CheckpointError):
                _read(candidate, fingerprint)
                return candidate
        return None


def _round_of(path: Path) -> int:
    return int(_NAME.fullmatch(path.name).group(1))


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive


def read_failure(path: Path, exc: Exception) -> str:
    """Why ``torch.load`` could not read ``path``, in words (torch's own texts span lines and give advice about
    ``weights_only`` that does not apply): missing, empty, not a torch file, truncated, or refused content."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:  # missing, a directory, no permission
        return e.strerror or type(e).__name__
    if not head:
        return "the file is empty (truncated or corrupt)"
    if head != _ZIP_MAGIC:
        return "not a p2p-diloco checkpoint (not a file written by torch.save)"
    refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
    if refused:
        return (f"it names the Python global {refused.group(1)!r}, which a checkpoint never does (refused unread: "
                f"it could run code)")
    if "Weights only load failed" not in str(exc):
        return "the file is truncated or corrupt (an incomplete copy, or damaged on disk)"
    return "the file is corrupt (its contents are not what torch.save writes)"


def _read(path: Path, fingerprint: str | None) -> PeerState:
    """Load ``path`` and check format, field types, theta against its digest and theta/momentum shapes."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY):
            payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # truncated zip, garbage, a pickle of anything else, missing file: "cannot read"
        raise CheckpointError(f"cannot read checkpoint {path}: {read_failure(path, exc)}") from exc
    version = payload.get("format") if isinstance(payload, dict) else None
    if version is None:
        raise CheckpointError(f"{path} is not a p2p-diloco checkpoint (a torch file without the format field a "
                              f"checkpoint has; a model's weights, perhaps)")
    if version != FORMAT and version not in OLD_FORMATS:
        raise CheckpointError(f"checkpoint {path} has unknown format {version!r} (expected {FORMAT}: written by "
                              f"another version of p2p-diloco?)")
    types = {"round": int, "fingerprint": str, "global_digest": str, "theta": list, "momentum": list,
             "model": dict, "inner_optimizer": dict, "data": dict, "rng": dict, "extra": dict}
    for key, kind in types.items():
        if not isinstance(payload.get(key), kind) or (kind is int and isinstance(payload[key], bool)):
            raise CheckpointError(f"checkpoint {path} is corrupt: field {key!r} is missing or not a {kind.__name__}")
    theta, momentum = payload["theta"], payload["momentum"]
    if not all(isinstance(t, torch.Tensor) for t in theta + momentum):
        raise CheckpointError(f"checkpoint {path} is corrupt: theta/momentum hold non-tensors")
    if len(theta) != len(momentum) or any(t.shape != m.shape for t, m in zip(theta, momentum)):
        raise CheckpointError(f"checkpoint {path} is corrupt: momentum does not match theta in count or shapes")
    shard_digests = payload["extra"].get("shard_digests")  # outer.sharding = sharded: theta is in shard files
    if shard_digests is not None:
        if theta or momentum or not isinstance(shard_digests, list) or \
                global_digest(shard_digests) != payload["global_digest"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: its shard digests do not match its recorded digest")
        if version in THETA_ONLY:
            raise CheckpointError(f"checkpoint {path} is a sharded checkpoint of format {version}, written before "
                                  "shard digests covered the momentum: it cannot be verified by this version")
    elif (legacy_digest(theta) if version in THETA_ONLY else digest(theta + momentum)) != payload["global_digest"]:
        raise CheckpointError(f"checkpoint {path} is corrupt: theta and momentum do not match its recorded digest")
    if version in THETA_ONLY:
        payload = dict(payload, global_digest=digest(theta + momentum), certificate=None)
    if payload.get("certificate") is not None and not isinstance(payload["certificate"], dict):
        raise CheckpointError(f"checkpoint {path} is corrupt: field 'certificate' is not a dict")
    if fingerprint is not None and payload["fingerprint"] != fingerprint:
        raise CheckpointError(f"checkpoint {path} belongs to another config "
                              f"(fingerprint {payload['fingerprint'][:16]}, this run {fingerprint[:16]})")
    return PeerState(**{f.name: payload.get(f.name) for f in fields(PeerState)})


_SHARD_NAME = re.compile(r"shard-(\d{4,})-round-(\d{8,})\.pt")


class ShardFiles:
    """``outer.sharding = "sharded"``: each rank's logical shards of theta and the momentum, one file per shard and
    round in ``<checkpoint dir>/shards/``, written atomically *before* rank 0 writes the round's checkpoint (which
    records every shard's digest). Files are per logical shard, so any rank layout can resume from them."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory) / "shards"

    def path(self, j: int, round_: int) -> Path:
        return self.directory / f"shard-{j:04d}-round-{round_:08d}.pt"

    def save(self, j: int, round_: int, fingerprint: str, theta_j: torch.Tensor, momentum_j: torch.Tensor) -> None:
        atomic_save({"format": FORMAT, "shard": j, "round": round_, "fingerprint": fingerprint,
                     "digest": shard_digest(theta_j, momentum_j), "theta": theta_j.clone(),
                     "momentum": momentum_j.clone()},
                    self.path(j, round_))

    def load(self, j: int, round_: int, fingerprint: str, want_digest: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(theta_j, momentum_j) of round ``round_``; CheckpointError (one line) if missing or not the recorded one."""
        path = self.path(j, round_)
        try:
            payload = torch.load(path, weights_only=True, map_location="cpu")
            theta_j, momentum_j = payload["theta"], payload["momentum"]
            ok = (payload["shard"] == j and payload["round"] == round_ and payload["fingerprint"] == fingerprint
                  and theta_j.shape == momentum_j.shape and shard_digest(theta_j, momentum_j) == want_digest)
        except Exception as exc:
            raise CheckpointError(f"cannot read shard checkpoint {path}: {read_failure(path, exc)}") from exc
        if not ok:
            raise CheckpointError(f"shard checkpoint {path} is corrupt or not the one the round's checkpoint recorded")
        return theta_j, momentum_j

    def prune(self, shards: list[int], keep_rounds: set[int]) -> None:
        """Delete the files of ``shards`` whose round is not in ``keep_rounds``."""
        if not self.directory.is_dir():
            return
        for p in self.directory.iterdir():
            m = _SHARD_NAME.fullmatch(p.name)
            if m and int(m.group(1)) in shards and int(m.group(2)) not in keep_rounds:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
