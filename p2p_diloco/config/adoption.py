"""Adopting the run's published config, and refusing a config that differs from it. No network here.

Precedence of a joiner's settings (lowest to highest): defaults < the run's published config < ``--config`` file
< ``--set`` < explicit flags. A setting the joiner gives itself (file, ``--set`` or flag) that differs from the
run's is refused when it is fingerprinted or shared (:class:`ConfigMismatch`, naming the keys and both values),
and reported in one notice when it is per-peer (:mod:`.sharing` classifies every setting).

**Which published configs are trusted** (:func:`trusted_configs`). A config record is signed by its owner, but any
fresh key can sign one, so a signature proves nothing about the run. A record counts only if its owner

1. has a live record of the run right now, and not a ``left`` one;
2. is in ``swarm.allowed_peers``, in a private run;
3. publishes a config whose fingerprint equals the fingerprint in its own live record (the one it matchmakes
   under): honest peers always publish such a pair.

The trusted records must agree on every fingerprinted and shared setting, or the joiner does not guess: it
refuses with the variants and how many peers publish each (:func:`run_settings`). A per-peer setting is adopted
only where every trusted record holds the same value (otherwise the joiner keeps its own and says so). So a
stranger, who can always publish a live record and a matching config of its own, can at worst make a joiner
without ``--config`` refuse (or keep its own value of a per-peer setting), never make it silently adopt a config
the honest peers do not publish, *as long as the joiner reads at least one honest peer's records*. The limit: a
joiner whose DHT reads reach only a stranger's records (no honest peer live, or initial peers that hide them)
adopts the stranger's config, as it would join the stranger's swarm anyway; ``--config`` (checked against every
trusted record) and ``swarm.allowed_peers`` are the answers to a hostile swarm.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Collection, Mapping

from ..errors import ConfigError, ConfigMismatch
from ..protocol.records import Phase
from .loading import apply_overrides
from .schema import Config
from .sharing import CLASSES, LOCAL, PER_PEER, agreement_view, config_of, get


def trusted_configs(configs: Mapping[str, Any], live: Mapping[str, Any], allowed: Collection[str] | None = None,
                    me: str | None = None) -> dict[str, dict[str, Any]]:
    """The published configs a peer may trust (module docstring): ``{peer_id: record}``.

    Args:
        configs: ``{peer_id: published config record}`` as read from ``<run_id>.config`` (signatures checked).
        live: ``{peer_id: live record}`` as read from ``<run_id>.live``.
        allowed: ``swarm.allowed_peers`` resolved (None: an open swarm).
        me: our own peer id, left out.

    Returns:
        The trusted records, each restricted to the settings this version knows and publishes.
    """
    out = {}
    for pid, record in configs.items():
        theirs = live.get(pid)
        if (pid == me or not isinstance(record, Mapping) or not isinstance(theirs, Mapping)
                or theirs.get("phase") == Phase.LEFT or (allowed is not None and pid not in allowed)):
            continue
        try:
            fingerprint = config_of(record).fingerprint()
        except (ConfigError, TypeError, ValueError, AttributeError):  # garbage a schema let through: not trusted
            continue
        if theirs.get("fp") == fingerprint:
            out[pid] = {name: value for name, value in record.items() if CLASSES.get(name, LOCAL) != LOCAL}
    return out


def _view_key(record: Mapping[str, Any]) -> str:
    return json.dumps(agreement_view(config_of(record)), sort_keys=True)


def variants(trusted: Mapping[str, Mapping[str, Any]]) -> str:
    """How the trusted records differ in fingerprinted and shared settings: ``""`` if they agree, else e.g.
    ``"2 different configs: train.inner_steps=20 (2 peers) | train.inner_steps=50 (1 peer)"``."""
    groups: dict[str, list[str]] = {}
    for pid, record in sorted(trusted.items()):
        groups.setdefault(_view_key(record), []).append(pid)
    if len(groups) < 2:
        return ""
    views = [json.loads(key) for key in groups]
    differing = sorted(k for k in set().union(*views) if len({json.dumps(v.get(k)) for v in views}) > 1)
    listed = " | ".join(
        f"{', '.join(f'{k}={v.get(k)!r}' for k in differing)} ({len(pids)} peer{'s' * (len(pids) > 1)})"
        for v, pids in sorted(zip(views, groups.values(), strict=True), key=lambda item: -len(item[1])))
    return f"{len(groups)} different configs: {listed}"


def run_settings(trusted: Mapping[str, Mapping[str, Any]], run_id: str) -> tuple[dict[str, Any], dict[str, list]]:
    """The run's settings, as the trusted records publish them.

    Args:
        trusted: :func:`trusted_configs`' result (not empty).
        run_id: for the messages.

    Returns:
        ``(settings, disputed)``: every setting all trusted records hold with one value, and the per-peer settings
        on which they differ (``{name: [values]}``), which are not adopted.

    Raises:
        ConfigMismatch: the trusted records differ in a fingerprinted or shared setting (one line: the variants,
            how many peers publish each, and what to do).
    """
    differ = variants(trusted)
    if differ:
        raise ConfigMismatch(f"the live peers of run {run_id!r} publish {differ}; cannot tell which is the run's: "
                             f"pass its settings with --config")
    settings: dict[str, Any] = {}
    disputed: dict[str, list] = {}
    for name in sorted(set().union(*(set(r) for r in trusted.values()))):
        values = [r[name] for r in trusted.values() if name in r]
        distinct = {json.dumps(v, sort_keys=True): v for v in values}
        if len(distinct) == 1 and len(values) == len(trusted):
            settings[name] = values[0]
        elif len(distinct) > 1 and CLASSES[name] == PER_PEER:
            disputed[name] = [distinct[k] for k in sorted(distinct)]
    return settings, disputed


def conflicts(ours: Config, theirs: Config, published: Collection[str] | None = None) -> list[str]:
    """``"key: ours X, theirs Y"`` for every fingerprinted or shared setting on which two configs disagree.

    Args:
        ours: this peer's config.
        theirs: a run's or another peer's config (:func:`~p2p_diloco.config.sharing.config_of`).
        published: the settings ``theirs`` was published with; shared settings it lacks (an older peer's record)
            are not compared. None: all of them.
    """
    shared = None if published is None else set(published)
    a, b = agreement_view(ours, shared), agreement_view(theirs, shared)
    return [f"{k}: ours {get(ours, k)!r}, theirs {get(theirs, k)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def mismatch_message(run_id: str, who: str, diffs: list[str]) -> str:
    """The one-line refusal (:class:`ConfigMismatch`): ``run 'r' already has <who> with a different config
    (<diffs>); ...``, ``diffs`` from :func:`conflicts`."""
    return (f"run {run_id!r} already has {who} with a different config ({'; '.join(diffs)}); use the same config "
            f"(or leave those settings out to adopt the run's) or another --run-id")


def check_against_peers(cfg: Config, configs: Mapping[str, Any], live: Mapping[str, Any],
                        allowed: Collection[str] | None = None, me: str | None = None) -> None:
    """A starting peer's check (the real swarm's and the in-memory one's): refuse if a trusted live peer
    (:func:`trusted_configs`) publishes a fingerprinted or shared setting that differs from ``cfg``'s.

    Raises:
        ConfigMismatch: one line naming the first such peer, the keys and both values.
    """
    for pid, theirs in sorted(trusted_configs(configs, live, allowed, me).items()):
        diffs = conflicts(cfg, config_of(theirs), theirs.keys())
        if diffs:
            raise ConfigMismatch(mismatch_message(cfg.run.run_id, f"peer {pid}", diffs))


def adopt(local: Config, explicit: Collection[str], settings: Mapping[str, Any],
          disputed: Mapping[str, list] | None = None, who: str = "live peers") -> tuple[Config, list[str]]:
    """This peer's config in a run that publishes ``settings``: the run's values under the ones given here.

    Args:
        local: the config from defaults, ``--config``, ``--set`` and flags (unchanged).
        explicit: the ``"section.key"`` settings the joiner gave itself (file, ``--set``, flags).
        settings: the run's settings (:func:`run_settings`).
        disputed: per-peer settings the trusted peers differ on (kept as ``local`` has them, and named).
        who: the peers ``settings`` came from, for the messages (e.g. ``"2 live peers"``).

    Returns:
        ``(config, notices)``: the checked config, and at most one notice line about per-peer settings.

    Raises:
        ConfigMismatch: an explicit fingerprinted or shared setting differs from the run's.
        ConfigError: the adopted values and the explicit ones together break a check (e.g. a request timeout
            given here that is not below the run's matchmaking time).
    """
    run_id = local.run.run_id
    nested: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        if CLASSES.get(name, LOCAL) != LOCAL and name not in explicit:
            section, key = name.split(".")
            nested.setdefault(section, {})[key] = copy.copy(value)
    merged = apply_overrides(copy.deepcopy(local), nested)
    diffs = conflicts(merged, config_of(settings), settings.keys())
    if diffs:
        raise ConfigMismatch(mismatch_message(run_id, who, diffs))
    own = [f"{name}={get(merged, name)!r} (run: {settings[name]!r})" for name in sorted(explicit)
           if CLASSES.get(name) == PER_PEER and name in settings and get(merged, name) != settings[name]]
    own += [f"{name}={get(merged, name)!r} (peers differ: {', '.join(map(repr, values))})"
            for name, values in sorted((disputed or {}).items())]
    notices = [f"run {run_id!r}: this peer's own per-peer settings: {'; '.join(own)}"] if own else []
    return merged, notices

