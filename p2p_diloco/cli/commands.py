"""The subcommands ``join``, ``bootstrap``, ``status``, ``eval`` and ``export`` (``swarm`` is in :mod:`.launcher`).

The modules that pull in torch, transformers or hivemind are imported inside the commands that need them, after the
input is checked: bad input must fail with one line within a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from pathlib import Path

from ..artifacts import given_checkpoint, new_output_dir
from ..config import Config
from ..errors import ConfigError, SwarmError, UsageError
from ..metrics import EventLog
from ..metrics.sinks import FanOut, TensorBoardSink, WandbSink, check_sinks
from ..runtime.signals import StopSignals
from .parser import check_identity_path, load_join_config, validate_maddr
from .status_view import format_view, swarm_view
from .util import ENV_INITIAL_PEERS, EXIT_USAGE, STDERR_HANDLER, write_json_atomic

log = logging.getLogger("p2p_diloco")


def _install_stop_handlers(stop: threading.Event, quiet: bool = False, starting: bool = False) -> StopSignals:
    """SIGINT/SIGTERM handlers (:mod:`p2p_diloco.runtime.signals`). First signal: stop at the next safe point
    (``stop`` is set); second: interrupt now (cleanup still runs). With ``starting``, until the returned object's
    ``running()``, the first signal interrupts at once (nothing to save yet). Its ``exit_code`` is the command's:
    128 + the first signal's number, or 0.
    """
    signals = StopSignals(stop, quiet).install()
    if not starting:
        signals.running()
    return signals


def cmd_join(args: argparse.Namespace) -> int:
    """``p2p-diloco join``: run one peer (or, under torchrun, one local rank of a peer) until the run ends.

    Args:
        args: The parsed ``join`` command line.

    Returns:
        The exit code: 0, or 128 + the signal's number when SIGINT/SIGTERM stopped the peer (130, 143).
    """
    check_sinks(args.metrics, args.log_dir)
    cfg = load_join_config(args)
    from ..local.cluster import Cluster
    from .adopt import adopt_run_config, cluster_config

    cluster = Cluster.from_env(cfg)  # launched by torchrun with several local ranks
    if cfg.swarm.initial_peers and cfg.swarm.initial_peers_wait > 0:
        # Started together with its initial peer: import the peer's modules (torch, transformers: seconds of CPU)
        # now, while that peer starts up, rather than after waiting for it.
        import p2p_diloco.peer.build  # noqa: F401
    # the run's published config under ours, before anything is built (the model comes from it)
    own_data = cfg.data.path
    cfg, notices = cluster_config(args, cfg, cluster) if cluster else adopt_run_config(args, cfg)
    if cfg is None:  # a follower whose rank 0 could not adopt the run's config (rank 0 says why)
        cluster.close()
        return EXIT_USAGE
    from ..training.sources import check_data_source

    try:  # a bad local data.path: one line in a tenth of a second, before torch is loaded
        check_data_source(cfg.data)
    except ConfigError as e:
        if cfg.data.path == own_data:
            raise
        raise ConfigError(f"{e} (data.path {cfg.data.path!r} is the run's, adopted from its published config: "
                          f"give this machine's own data with --set data.path=...)") from None
    if cluster and cluster.rank != 0:  # a follower: no swarm, no output; rank 0 is the peer
        from ..local.follower import follow

        try:
            follow(cfg, cluster)
        finally:
            cluster.close()
        return 0
    summary, code = _run_peer(args, cfg, cluster, notices)
    if args.summary_json:
        write_json_atomic(args.summary_json, summary)
    log.info("summary: %s", json.dumps(summary))
    return code


def _run_peer(args: argparse.Namespace, cfg: Config, cluster, notices: list[str]) -> tuple[dict, int]:
    """Build and run the peer (rank 0 of a cluster, if any); its end-of-run summary and the exit code.

    Until the first round starts a stop signal aborts at once (nothing to save); from then on it stops the peer at
    the next safe point (see :func:`_install_stop_handlers`)."""
    from ..peer.build import build_peer
    from ..swarm.swarm import Swarm
    from .adopt import with_notices
    from .live import StatusLine

    stop = threading.Event()
    signals = _install_stop_handlers(stop, starting=True)
    events = EventLog(None)
    metrics = FanOut([StatusLine(), events])  # the status line first: FanOut shows status texts on its first sink
    on_started = with_notices(_on_started(args, cfg, stop, events, metrics), notices)  # the adoption's notices
    try:
        try:
            peer = build_peer(cfg, metrics, Swarm, stop=stop, on_started=on_started, cluster=cluster,
                              on_training=signals.running)
        except BaseException:  # e.g. a checkpoint we cannot resume: the other ranks wait for our first command
            if cluster:
                cluster.stop_followers()
            raise
        return peer.run(), signals.exit_code
    finally:
        metrics.close()
        if cluster:
            cluster.close()


def _on_started(args: argparse.Namespace, cfg: Config, stop: threading.Event, events: EventLog, metrics: FanOut):
    """The callback run once the peer's swarm is up: print the join line, start the metric sinks."""

    def on_started(swarm) -> None:
        STDERR_HANDLER.setLevel(logging.INFO)  # until now only errors: bad input must give a one-line error
        # a client-mode peer is reachable at no address: it hands on the entry points it joined through
        maddrs = cfg.swarm.initial_peers if cfg.swarm.client_mode else swarm.visible_maddrs()
        print(f"p2p-diloco join --initial-peers {' '.join(maddrs)} --run-id {cfg.run.run_id}", flush=True)
        if cfg.swarm.client_mode:
            log.info("client mode: peer id %s, no inbound connections", swarm.peer_id)
        if args.log_dir:  # each sink under DIR/<peer id>/ (the peer id is known only now)
            peer_dir = Path(args.log_dir) / swarm.peer_id
            events.set_dir(peer_dir, events="jsonl" in args.metrics)
            if "tensorboard" in args.metrics:
                metrics.add(TensorBoardSink(peer_dir / "tensorboard"))
            if "wandb" in args.metrics:
                metrics.add(WandbSink(peer_dir, cfg.run.run_id, swarm.peer_id, cfg.to_dict()))

    return on_started


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """``p2p-diloco bootstrap``: run a DHT-only node until SIGINT/SIGTERM; print the line others join with.

    Args:
        args: The parsed ``bootstrap`` command line.

    Returns:
        The exit code: 128 + the number of the signal that stopped it (130 for SIGINT, 143 for SIGTERM).

    Raises:
        SwarmError: The node's DHT process died.
    """
    if args.startup_timeout <= 0:
        raise UsageError(f"--startup-timeout must be > 0, got {args.startup_timeout}")
    host = [validate_maddr(m, need_peer_id=False) for m in args.host_maddrs]
    announce = [validate_maddr(m, need_peer_id=False) for m in args.announce_maddrs]
    initial = [validate_maddr(m, need_peer_id=True) for m in args.initial_peers]
    check_identity_path(args.identity_path)
    from ..swarm.bootstrap import BootstrapNode

    node = BootstrapNode(host, announce, args.identity_path, args.startup_timeout, initial)
    stop = threading.Event()
    signals = _install_stop_handlers(stop, starting=True)  # a signal during the start aborts it at once
    node.start()
    try:
        signals.running()
        print(f"p2p-diloco join --initial-peers {' '.join(node.visible_maddrs())}", flush=True)
        log.info("bootstrap node %s up; Ctrl-C to stop", node.peer_id)
        while not stop.wait(1.0):
            if not node.dht.is_alive():
                raise SwarmError("the DHT process of the bootstrap node died")
    finally:
        node.shutdown()
    return signals.exit_code


def cmd_status(args: argparse.Namespace) -> int:
    """``p2p-diloco status``: print the run's live peers once, or every ``--watch`` seconds until SIGINT/SIGTERM.

    Args:
        args: The parsed ``status`` command line.

    Returns:
        The exit code: 0, or 128 + the number of the signal that stopped ``--watch`` (130 for SIGINT, 143 for
        SIGTERM).
    """
    peers = args.initial_peers or os.environ.get(ENV_INITIAL_PEERS, "").split()
    if not peers:
        raise UsageError(f"--initial-peers (or ${ENV_INITIAL_PEERS}) is required: the swarm to look at")
    peers = [validate_maddr(m, need_peer_id=True) for m in peers]
    if args.watch is not None and args.watch <= 0:
        raise UsageError(f"--watch must be > 0 seconds, got {args.watch}")
    if args.startup_timeout <= 0:
        raise UsageError(f"--startup-timeout must be > 0, got {args.startup_timeout}")
    run_id = args.run_id or Config().run.run_id
    from ..swarm.status import StatusClient

    stop = threading.Event()
    signals = _install_stop_handlers(stop, quiet=True, starting=True)  # StatusClient's start_dht cleans up
    client = StatusClient(peers, run_id, args.startup_timeout)
    signals.running()
    try:
        while True:
            view = swarm_view(run_id, client.read_live_records())
            print(json.dumps(view) if args.json else format_view(view), flush=True)
            if args.watch is None or stop.wait(args.watch):
                return signals.exit_code
            if not args.json:
                print(flush=True)
    finally:
        client.shutdown()


def cmd_eval(args: argparse.Namespace) -> int:
    """``p2p-diloco eval``: eval loss and perplexity of a checkpoint's global weights, on one line (or JSON).

    Args:
        args: The parsed ``eval`` command line.

    Returns:
        The exit code, 0.
    """
    given_checkpoint(args.checkpoint)  # said at once, not after the imports (load_trained checks it again)
    from ..export import evaluate_trained, load_trained

    result = evaluate_trained(load_trained(args.checkpoint, args.config, args.sets))
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(f"round {result['round']} (global digest {result['global_digest'][:12]}): "
              f"eval_loss={result['eval_loss']:.4f} perplexity={result['perplexity']:.3f} "
              f"on {result['eval_tokens']} held-out tokens of {result['data_path']}", flush=True)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``p2p-diloco export``: write a checkpoint's global weights as a Hugging Face model + tokenizer.

    Args:
        args: The parsed ``export`` command line.

    Returns:
        The exit code, 0.
    """
    given_checkpoint(args.checkpoint)  # both said at once, not after the imports (export.py checks them again)
    new_output_dir(args.out)
    from ..export import export_trained, load_trained

    trained = load_trained(args.checkpoint, args.config, args.sets)
    out = export_trained(trained, args.out)
    print(f"exported round {trained.state.round} (global digest {trained.state.global_digest[:12]}) to {out}",
          flush=True)
    return 0
