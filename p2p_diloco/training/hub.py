"""Hugging Face Hub access that fails within seconds when the hub cannot be reached.

Asked for a hub name without a network, transformers and huggingface_hub retry every file five times with backoff
(1 + 2 + 4 + 8 + 8 s), and print each retry twice: about 50 s and 45 lines before their one-line error. So before
the first hub name is loaded we ask the hub once, with a short timeout, and remember the answer for the process:

* reachable: the libraries load as usual (downloads, updates, gated repos with a token);
* unreachable (or ``HF_HUB_OFFLINE`` set): a tokenizer or model already in the local cache loads from it
  (``local_files_only``), a cached dataset loads when ``HF_HUB_OFFLINE=1``; anything else is one
  :class:`ConfigError` that says what to do.

huggingface_hub 2.x also asks the hub, once per process and with a 3 s timeout, for its list of agent harnesses
(for the User-Agent header), even with ``local_files_only``: one more refused dial, or at most 3 s more where
packets are dropped (``tests/unit/test_hub.py`` counts the dials).

Nothing here imports transformers or datasets: the callers pass the loading function.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Callable, TypeVar

from p2p_diloco.config import ConfigError

PROBE_TIMEOUT = 3.0  # seconds: a reachable hub answers a HEAD well within it; an unreachable one costs at most this
LOCAL_PATH = "give a local path (a directory written by save_pretrained)"
OFFLINE_HINT = f"offline, {LOCAL_PATH}, or load it once with internet so that it is cached and set HF_HUB_OFFLINE=1"
OFFLINE_SET = "HF_HUB_OFFLINE is set"
GATED_HINT = ("if the repo is gated or private, accept its terms on the hub and log in with `hf auth login` "
              "(formerly `huggingface-cli login`) or set HF_TOKEN")

T = TypeVar("T")


def looks_local(name: str) -> bool:
    """True for names that can only mean a local path (hub repo ids cannot start with ``/``, ``.`` or ``~``)."""
    return name.startswith(("/", ".", "~"))


def short_reason(exc: BaseException) -> str:
    """First non-empty line of an exception message, truncated: enough to act on, no traceback noise."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = lines[0] if lines else type(exc).__name__
    return reason if len(reason) <= 200 else reason[:197] + "..."


def offline_mode() -> bool:
    """Whether the user asked for the local cache only (``HF_HUB_OFFLINE=1`` or ``TRANSFORMERS_OFFLINE=1``)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_endpoint() -> str:
    """The hub's base URL (``HF_ENDPOINT``, or https://huggingface.co)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


@lru_cache(maxsize=1)
def hub_unreachable() -> str | None:
    """Why the hub cannot be used now, in a few words, or None when it answers. Asked once per process.

    One HEAD request through huggingface_hub's own HTTP client (so proxies and ``HF_ENDPOINT`` apply) with no retry:
    any HTTP answer counts as reachable; a DNS failure, a refused connection or :data:`PROBE_TIMEOUT` do not.
    """
    if offline_mode():
        return OFFLINE_SET
    from huggingface_hub.utils import get_session

    try:
        get_session().head(hub_endpoint(), timeout=PROBE_TIMEOUT)
    except Exception as e:  # httpx's ConnectError, ConnectTimeout, ProxyError, ...
        return f"{hub_endpoint()} is unreachable: {short_reason(e)}"
    return None


def _is_auth_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return type(exc).__name__ in ("GatedRepoError", "RepositoryNotFoundError") or any(
        s in text for s in ("gated", "401", "403", "restricted", "private repository"))


def explain(name: str, exc: BaseException, down: str | None) -> str:
    """The reason a hub ``name`` failed to load, with what to do about it (one line)."""
    if down == OFFLINE_SET:
        return f"not in the local Hugging Face cache, and {down}: {LOCAL_PATH}, or download it once with internet"
    if down:
        return f"not in the local Hugging Face cache, and {down}; {OFFLINE_HINT}"
    if _is_auth_error(exc):
        return f"{short_reason(exc)} ({GATED_HINT})"
    return short_reason(exc)


def load_named(kind: str, name: str, load: Callable[..., T]) -> T:
    """Load a tokenizer or model from a local path or a hub name, failing within seconds when the hub is unreachable.

    Args:
        kind: what is loaded, for the error message ("tokenizer", "model").
        name: a local path or a hub repo id.
        load: ``from_pretrained``-like: called with the (user-expanded) name, plus ``local_files_only=True`` when
            the hub cannot be reached.

    Returns:
        What ``load`` returned.

    Raises:
        ConfigError: a missing local path, or a load failure, on one line that says what to do.
    """
    path = os.path.expanduser(name)
    if os.path.exists(path) or looks_local(name):
        if not os.path.exists(path):
            raise ConfigError(f"cannot load {kind} {name}: no such file or directory")
        down = None  # a local directory never touches the hub
    else:
        down = hub_unreachable()
    try:
        return load(path, local_files_only=True) if down else load(path)
    except Exception as e:  # OSError (missing files, no network), ValueError (bad config), KeyError, ...
        raise ConfigError(f"cannot load {kind} {name}: {explain(name, e, down)}") from None


def check_hub_dataset(path: str, streaming: bool) -> None:
    """Fail fast before ``datasets`` tries to reach an unreachable hub for dataset ``path``.

    With ``HF_HUB_OFFLINE=1`` datasets reads a non-streamed dataset from its own cache, so that case is left to it.

    Raises:
        ConfigError: the hub is unreachable (or ``HF_HUB_OFFLINE`` is set and the dataset would be streamed).
    """
    down = hub_unreachable()
    local = "use local files (data.path = a directory, glob or file)"
    if down == OFFLINE_SET and streaming:
        raise ConfigError(f"cannot load dataset {path}: {down} and a streamed dataset is read from the hub; {local}, "
                          'or set data.streaming = "false" to use a copy in the datasets cache')
    if down and down != OFFLINE_SET:
        raise ConfigError(f"cannot load dataset {path}: {down}; offline, {local}, or set HF_HUB_OFFLINE=1 to use a "
                          'copy in the datasets cache (with data.streaming = "false")')
