"""``join`` adopts the run's published config before it builds anything, so that ``p2p-diloco join
--initial-peers <maddr> --run-id <id>`` is enough to join a run, whatever config the run was started with.

Precedence: defaults < the run's published config < ``--config`` file < ``--set`` < explicit flags. The rules
(which records are trusted, what is refused, what is only noticed) are in :mod:`p2p_diloco.config.adoption`; the
read, through a short-lived light DHT client, in :mod:`p2p_diloco.swarm.run_config`.
"""

from __future__ import annotations

import argparse
import logging
import tomllib
from pathlib import Path
from typing import Callable, Sequence

from ..config import Config, parse_set
from ..config.adoption import adopt, run_settings, trusted_configs, variants
from ..config.sharing import CLASSES, LOCAL, get
from .parser import _given_flags

log = logging.getLogger("p2p_diloco")

def explicit_settings(args: argparse.Namespace) -> set[str]:
    """The ``"section.key"`` settings the command line gives: its ``--config`` file's, its ``--set`` items' and its
    flags' (the file was already read and checked by :func:`~p2p_diloco.cli.parser.load_join_config`)."""
    names: set[str] = set()
    if args.config:
        for section, values in tomllib.loads(Path(args.config).read_text()).items():
            names |= {f"{section}.{key}" for key in values} if isinstance(values, dict) else set()
    for item in args.sets:
        section, key, _ = parse_set(item)
        names.add(f"{section}.{key}")
    return names | set(_given_flags(args))


def _read_run_records(cfg: Config) -> tuple[dict, dict]:
    """The run's live and config records, through a light client (a stop signal aborts the read at once)."""
    from ..runtime.signals import StopSignals
    from ..swarm.run_config import read_run_records

    StopSignals().install()  # start-up: nothing to save yet (the peer installs its own handlers later)
    return read_run_records(cfg.swarm.initial_peers, cfg.run.run_id, cfg.swarm.startup_timeout,
                            cfg.swarm.initial_peers_wait)


def adopt_run_config(args: argparse.Namespace, cfg: Config,
                     read: Callable[[Config], tuple[dict, dict]] = _read_run_records) -> tuple[Config, list[str]]:
    """``cfg`` with the run's published settings under the ones this command line gives.

    Args:
        args: the parsed ``join`` command line.
        cfg: its config (:func:`~p2p_diloco.cli.parser.load_join_config`).
        read: returns the run's ``(live, configs)`` records (tests give them without a network).

    Returns:
        ``(config, notices)``: the notices are INFO lines to log once the peer is up (until then stderr shows only
        errors).

    Raises:
        ConfigMismatch: a fingerprinted or shared setting given here differs from the run's, or (without
            ``--config``) the live peers publish different configs.
        SwarmError: the swarm could not be reached.
    """
    if not cfg.swarm.initial_peers:  # a new swarm: nothing to adopt
        return cfg, []
    from ..swarm.allowlist import resolve_allowed_peers

    run_id = cfg.run.run_id
    live, configs = read(cfg)
    trusted = trusted_configs(configs, live, resolve_allowed_peers(cfg.swarm.allowed_peers))
    if not trusted:
        return cfg, [f"run {run_id!r}: no live peer has published its config (yet): using this peer's own"]
    differ = variants(trusted)
    if differ and args.config:  # no guessing between them; the file decides (the swarm refuses it if it differs)
        return cfg, [f"the live peers of run {run_id!r} publish {differ}: using --config {args.config}"]
    settings, disputed = run_settings(trusted, run_id)  # ConfigMismatch if they differ
    explicit = explicit_settings(args)
    who = f"{len(trusted)} live peer{'s' * (len(trusted) > 1)}"
    merged, notices = adopt(cfg, explicit, settings, disputed, who)
    changed = [name for name in CLASSES if CLASSES[name] != LOCAL and get(merged, name) != get(cfg, name)]
    listed = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
    notices.insert(0, f"run {run_id!r}: adopted the config published by {who} (fingerprint {merged.fingerprint()}"
                      f"{'; ' + listed if changed else ''})")
    return merged, notices


def cluster_config(args: argparse.Namespace, cfg: Config, cluster) -> tuple[Config | None, list[str]]:
    """:func:`adopt_run_config` for a peer of several local ranks (torchrun): rank 0 reads the run, its followers
    receive its config. ``(None, [])`` on a follower whose rank 0 failed (rank 0 reports why)."""
    from ..local.cluster import check

    if cluster.rank != 0:
        cfg, notices = cluster.broadcast_objects([None, []])
        return cfg, notices
    try:
        cfg, notices = adopt_run_config(args, cfg)  # device and rank layout are local
        check(cfg, cluster.world)
    except BaseException:
        cluster.broadcast_objects([None, []])
        raise
    cluster.broadcast_objects([cfg, []])
    return cfg, notices


def with_notices(on_started: Callable, notices: Sequence[str]) -> Callable:
    """``on_started`` followed by logging ``notices`` (INFO reaches stderr only once the peer is up)."""

    def started(swarm) -> None:
        on_started(swarm)
        for line in notices:
            log.info("%s", line)

    return started
