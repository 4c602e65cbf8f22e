"""``p2p-diloco``: one console entry with subcommands (``join``, ``swarm``, ``bootstrap``, ``status``,
``eval``, ``export``).

Every kind of bad input ends the same way: one line on stderr, exit code 2, no traceback, within seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

from ..errors import SwarmError, UsageError

EXIT_USAGE = 2
ENV_INITIAL_PEERS = "P2P_DILOCO_INITIAL_PEERS"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + error
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def validate_maddr(text: str, need_peer_id: bool) -> str:
    """Parse ``text`` with the multiaddr package; initial peers must name the peer (``/p2p/<peer id>``)."""
    from multiaddr import Multiaddr

    try:
        maddr = Multiaddr(text)
        protocols = [p.name for p in maddr.protocols()]
    except Exception as e:
        raise UsageError(f"invalid multiaddr {text!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    if need_peer_id and "p2p" not in protocols:
        raise UsageError(f"multiaddr {text!r} must end with /p2p/<peer id>")
    return str(maddr)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML run config (see configs/)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key; the value is parsed as TOML, else taken as a string")
    p.add_argument("--run-id", help="peers with the same run id (and config) train together")
    p.add_argument("--max-rounds", type=int, help="stop once swarm round R is complete")
    p.add_argument("--inner-steps", type=int, help="inner steps per round (H)")
    p.add_argument("--log-dir", help="write events.jsonl and peer.log under DIR/<peer id>/")
    p.add_argument("--summary-json", help="write the end-of-run summary to this JSON file")


def _add_join_parser(sub) -> None:
    join = sub.add_parser("join", help="run one peer: start a new swarm or join one")
    join.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                      help=f"multiaddrs of live peers (also from ${ENV_INITIAL_PEERS}); none = new swarm")
    join.add_argument("--host-maddrs", nargs="+", metavar="MADDR",
                      help="addresses to listen on (default: every interface, any free port)")
    join.add_argument("--announce-maddrs", nargs="+", metavar="MADDR",
                      help="public addresses to advertise (behind port forwarding)")
    join.add_argument("--client-mode", action="store_true", default=None,
                      help="accept no inbound connections (behind NAT): still contributes its pseudo-gradient")
    join.add_argument("--use-relay", action=argparse.BooleanOptionalAction, default=None,
                      help="libp2p circuit relay (default: on)")
    join.add_argument("--use-auto-relay", action=argparse.BooleanOptionalAction, default=None,
                      help="find relays and advertise relayed addresses (peers behind NAT; default: off)")
    join.add_argument("--startup-timeout", type=float, metavar="SECONDS",
                      help="how long p2pd may take to start and reach the initial peers (default 30)")
    join.add_argument("--identity-path", metavar="FILE",
                      help="RSA identity file: the same peer id across restarts (created if missing)")
    join.add_argument("--data-seed", type=int, help="this peer's data order (default: from its peer id)")
    join.add_argument("--checkpoint-dir", help="save a checkpoint here at round boundaries (keeps the last k)")
    join.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    join.add_argument("--metrics", nargs="+", default=["jsonl"], metavar="SINK",
                      help="jsonl (events.jsonl, default), tensorboard, wandb (offline unless WANDB_MODE): "
                           "any of them, under --log-dir")
    join.add_argument("--allowed-peers", nargs="+", metavar="ID_OR_FILE",
                      help="a private run: only these peer ids (or files of them) may average with us or download "
                           "our state (docs/security.md)")
    join.add_argument("--debug-step-delay", type=float, metavar="SECONDS",
                      help="test only: sleep this long after every inner step (a slow peer)")
    join.add_argument("--debug-corrupt-pseudo-gradient", metavar="nan|scale:<k>|random",
                      help="test only: a malicious peer that sends a corrupted pseudo-gradient every round")
    _add_config_args(join)


def _add_network_parsers(sub) -> None:
    """``bootstrap`` and ``status``: DHT nodes that do not train."""
    boot = sub.add_parser("bootstrap", help="run a DHT-only node (no training) that others join through")
    boot.add_argument("--host-maddrs", nargs="+", metavar="MADDR", default=["/ip4/0.0.0.0/tcp/0"],
                      help="addresses to listen on (default: every interface, any free port)")
    boot.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", default=[],
                      help="public addresses to advertise (behind port forwarding)")
    boot.add_argument("--identity-path", metavar="FILE",
                      help="RSA identity file: the same peer id across restarts (created if missing)")
    boot.add_argument("--initial-peers", nargs="+", metavar="MADDR", default=[],
                      help="other bootstrap nodes to connect to (optional)")
    boot.add_argument("--startup-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="how long p2pd may take to start")
    status = sub.add_parser("status", help="show the live peers of a run, from their signed DHT records")
    status.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                        help=f"multiaddrs of live peers or a bootstrap node (also from ${ENV_INITIAL_PEERS})")
    status.add_argument("--run-id", help="the run to show (default: the default config's run id)")
    status.add_argument("--json", action="store_true", help='print {"peers": [...], ...} as one JSON object')
    status.add_argument("--watch", nargs="?", type=float, const=5.0, metavar="SECONDS",
                        help="refresh every SECONDS (default 5) until Ctrl-C")
    status.add_argument("--startup-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="how long p2pd may take to start")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="p2p-diloco", description="Coordinator-free DiLoCo training over hivemind.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_join_parser(sub)
    swarm = sub.add_parser("swarm", help="run N peers on 127.0.0.1, each a separate join process")
    swarm.add_argument("--peers", type=int, required=True, help="number of peers")
    swarm.add_argument("--data-seed", type=int, help="peer i reads data order S+i (default: from each peer id)")
    swarm.add_argument("--debug-step-delay", type=float, nargs="+", metavar="SECONDS",
                       help="test only: sleep after every inner step; one value for all peers, or one per peer")
    _add_config_args(swarm)
    _add_network_parsers(sub)
    for name, text in (("eval", "eval loss and perplexity of a checkpoint's global weights"),
                       ("export", "write a checkpoint's global weights as a Hugging Face model + tokenizer")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--checkpoint", required=True, metavar="PATH",
                         help="a checkpoint file, or a --checkpoint-dir (its newest checkpoint)")
        cmd.add_argument("--config", help="TOML config (default: the run's config, saved in the checkpoint)")
        cmd.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                         help="override one config key, e.g. data.path=FILE to evaluate on another dataset")
    sub.choices["eval"].add_argument("--json", action="store_true", help="print the result as one JSON object")
    sub.choices["export"].add_argument("--out", required=True, metavar="DIR",
                                       help="new (or empty) directory for save_pretrained files")
    return parser


def load_join_config(args: argparse.Namespace):
    """defaults < --config file < --set < explicit flags."""
    from ..config import apply_overrides, load_config

    cfg = load_config(args.config, args.sets)
    flags: dict[str, dict] = {"run": {}, "train": {}, "data": {}, "swarm": {}, "checkpoint": {}, "debug": {}}
    if isinstance(getattr(args, "debug_step_delay", None), float):
        flags["debug"]["step_delay"] = args.debug_step_delay
    if getattr(args, "debug_corrupt_pseudo_gradient", None) is not None:
        flags["debug"]["corrupt_pseudo_gradient"] = args.debug_corrupt_pseudo_gradient
    if getattr(args, "checkpoint_dir", None) is not None:
        flags["checkpoint"]["dir"] = args.checkpoint_dir
    if getattr(args, "resume", False):
        flags["checkpoint"]["resume"] = True
    if args.run_id is not None:
        flags["run"]["run_id"] = args.run_id
    if args.max_rounds is not None:
        flags["run"]["max_rounds"] = args.max_rounds
    if args.inner_steps is not None:
        flags["train"]["inner_steps"] = args.inner_steps
    if getattr(args, "data_seed", None) is not None:
        flags["data"]["seed"] = args.data_seed
    peers = getattr(args, "initial_peers", None)
    if peers is None and os.environ.get(ENV_INITIAL_PEERS, "").strip():
        peers = os.environ[ENV_INITIAL_PEERS].split()
    if peers is not None:
        flags["swarm"]["initial_peers"] = peers
    for name in ("identity_path", "client_mode", "use_relay", "use_auto_relay", "startup_timeout"):
        if getattr(args, name, None) is not None:
            flags["swarm"][name] = getattr(args, name)
    for name in ("host_maddrs", "announce_maddrs", "allowed_peers"):
        if getattr(args, name, None) is not None:
            flags["swarm"][name] = getattr(args, name)
    apply_overrides(cfg, flags)
    cfg.swarm.initial_peers = [validate_maddr(m, need_peer_id=True) for m in cfg.swarm.initial_peers]
    cfg.swarm.host_maddrs = [validate_maddr(m, need_peer_id=False) for m in cfg.swarm.host_maddrs]
    cfg.swarm.announce_maddrs = [validate_maddr(m, need_peer_id=False) for m in cfg.swarm.announce_maddrs]
    from ..swarm.allowlist import resolve_allowed_peers

    resolve_allowed_peers(cfg.swarm.allowed_peers)  # a bad entry is a one-line error now, not after the data is built
    if cfg.swarm.client_mode and not cfg.swarm.initial_peers:
        raise UsageError("--client-mode needs --initial-peers: a peer nobody can reach cannot start a swarm")
    return cfg


def write_json_atomic(path: str | Path, obj) -> None:
    """Write JSON via a temp file + rename, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _install_stop_handlers(stop: threading.Event, quiet: bool = False) -> None:
    """First SIGINT/SIGTERM: stop at the next safe point. Second: interrupt now (cleanup still runs).

    hivemind forks the DHT and averager processes from this one, and a fork inherits these handlers: in a child
    they re-raise the signal with the default action, so a signal sent to the whole group still ends the children.
    """
    main_pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if stop.is_set():
            raise KeyboardInterrupt
        if not quiet:
            logging.getLogger("p2p_diloco").warning("received %s: stopping after the current step",
                                                    signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def cmd_join(args: argparse.Namespace) -> int:
    from ..metrics.sinks import FanOut, TensorBoardSink, WandbSink, check_sinks

    check_sinks(args.metrics, args.log_dir)
    cfg = load_join_config(args)
    from ..local.cluster import Cluster
    from ..local.follower import follow

    cluster = Cluster.from_env(cfg)  # launched by torchrun with several local ranks
    if cluster and cluster.rank != 0:  # a follower: no swarm, no output; rank 0 is the peer
        try:
            follow(cfg, cluster)
        finally:
            cluster.close()
        return 0
    from ..metrics import EventLog
    from ..peer.build import build_peer
    from ..swarm.swarm import Swarm

    stop = threading.Event()
    _install_stop_handlers(stop)
    log = EventLog(None)
    metrics = FanOut([log])

    def on_started(swarm) -> None:
        _install_stop_handlers(stop)  # hivemind set SIGINT to SIG_IGN when the averager started
        _STDERR_HANDLER.setLevel(logging.INFO)  # until now only errors: bad input must give a one-line error
        # a client-mode peer is reachable at no address: it hands on the entry points it joined through
        maddrs = cfg.swarm.initial_peers if cfg.swarm.client_mode else swarm.visible_maddrs()
        print(f"p2p-diloco join --initial-peers {' '.join(maddrs)} --run-id {cfg.run.run_id}", flush=True)
        if cfg.swarm.client_mode:
            logging.getLogger("p2p_diloco").info("client mode: peer id %s, no inbound connections", swarm.peer_id)
        if args.log_dir:  # each sink under DIR/<peer id>/ (the peer id is known only now)
            peer_dir = Path(args.log_dir) / swarm.peer_id
            log.set_dir(peer_dir, events="jsonl" in args.metrics)
            if "tensorboard" in args.metrics:
                metrics.add(TensorBoardSink(peer_dir / "tensorboard"))
            if "wandb" in args.metrics:
                metrics.add(WandbSink(peer_dir, cfg.run.run_id, swarm.peer_id, cfg.to_dict()))

    try:
        try:
            peer = build_peer(cfg, metrics, Swarm, stop=stop, on_started=on_started, cluster=cluster)
        except BaseException:  # e.g. a checkpoint we cannot resume: the other ranks wait for our first command
            if cluster:
                cluster.stop_followers()
            raise
        summary = peer.run()
    finally:
        metrics.close()
        if cluster:
            cluster.close()
    if args.summary_json:
        write_json_atomic(args.summary_json, summary)
    logging.getLogger("p2p_diloco").info("summary: %s", json.dumps(summary))
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """Run a DHT-only node until SIGINT/SIGTERM; print the line others join with."""
    from ..swarm.bootstrap import BootstrapNode

    if args.startup_timeout <= 0:
        raise UsageError(f"--startup-timeout must be > 0, got {args.startup_timeout}")
    node = BootstrapNode([validate_maddr(m, need_peer_id=False) for m in args.host_maddrs],
                         [validate_maddr(m, need_peer_id=False) for m in args.announce_maddrs],
                         args.identity_path, args.startup_timeout,
                         [validate_maddr(m, need_peer_id=True) for m in args.initial_peers])
    stop = threading.Event()
    _install_stop_handlers(stop)
    node.start()
    try:
        _install_stop_handlers(stop)
        print(f"p2p-diloco join --initial-peers {' '.join(node.visible_maddrs())}", flush=True)
        logging.getLogger("p2p_diloco").info("bootstrap node %s up; Ctrl-C to stop", node.peer_id)
        while not stop.wait(1.0):
            if not node.dht.is_alive():
                raise SwarmError("the DHT process of the bootstrap node died")
    finally:
        node.shutdown()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print the run's live peers once, or every ``--watch`` seconds until SIGINT/SIGTERM."""
    from ..config import Config
    from ..swarm.status import StatusClient
    from .status_view import format_view, swarm_view

    peers = args.initial_peers or os.environ.get(ENV_INITIAL_PEERS, "").split()
    if not peers:
        raise UsageError(f"--initial-peers (or ${ENV_INITIAL_PEERS}) is required: the swarm to look at")
    peers = [validate_maddr(m, need_peer_id=True) for m in peers]
    if args.watch is not None and args.watch <= 0:
        raise UsageError(f"--watch must be > 0 seconds, got {args.watch}")
    if args.startup_timeout <= 0:
        raise UsageError(f"--startup-timeout must be > 0, got {args.startup_timeout}")
    run_id = args.run_id or Config().run.run_id
    stop = threading.Event()
    _install_stop_handlers(stop, quiet=True)
    client = StatusClient(peers, run_id, args.startup_timeout)
    try:
        _install_stop_handlers(stop, quiet=True)
        while True:
            view = swarm_view(run_id, client.read_live_records())
            print(json.dumps(view) if args.json else format_view(view), flush=True)
            if args.watch is None or stop.wait(args.watch):
                return 0
            if not args.json:
                print(flush=True)
    finally:
        client.shutdown()


def cmd_eval(args: argparse.Namespace) -> int:
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
    from ..export import export_trained, load_trained

    trained = load_trained(args.checkpoint, args.config, args.sets)
    out = export_trained(trained, args.out)
    print(f"exported round {trained.state.round} (global digest {trained.state.global_digest[:12]}) to {out}",
          flush=True)
    return 0


_STDERR_HANDLER = logging.StreamHandler(sys.stderr)


def _setup_logging(level: int) -> None:
    handler = _STDERR_HANDLER
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in ("datasets", "transformers", "filelock", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    # hivemind's own INFO lines (e.g. "Checking that identity ... is not used") would break the one-line error
    # rule; its warnings and errors still show. Read once, when hivemind is first imported.
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    args = build_parser().parse_args(argv)
    _setup_logging(logging.WARNING if args.command == "join" else logging.INFO)
    try:
        if args.command == "join":
            return cmd_join(args)
        commands = {"eval": cmd_eval, "export": cmd_export, "bootstrap": cmd_bootstrap, "status": cmd_status}
        if args.command in commands:
            return commands[args.command](args)
        from .launcher import cmd_swarm

        return cmd_swarm(args)
    except UsageError as e:
        print(f"p2p-diloco {args.command}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"p2p-diloco {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
