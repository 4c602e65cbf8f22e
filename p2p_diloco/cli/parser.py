"""The ``p2p-diloco`` argument parser, and how a ``join`` (or ``swarm``) command line becomes a :class:`Config`."""

from __future__ import annotations

import argparse
import os
from typing import Any

from multiaddr import Multiaddr

from ..config import Config, apply_overrides, load_config
from ..errors import UsageError
from .util import ENV_INITIAL_PEERS, EXIT_USAGE


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block), with exit code 2 like every bad input."""

    def error(self, message: str):  # one line instead of usage + error
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def validate_maddr(text: str, need_peer_id: bool) -> str:
    """Check a multiaddr with the multiaddr package.

    Args:
        text: The address, e.g. ``/ip4/10.0.0.2/tcp/4001/p2p/<peer id>``.
        need_peer_id: True for an initial peer, which must name the peer (``/p2p/<peer id>``).

    Returns:
        The address in its canonical form.

    Raises:
        UsageError: ``text`` does not parse, or lacks the peer id it needs (one line).
    """
    try:
        maddr = Multiaddr(text)
        protocols = [p.name for p in maddr.protocols()]
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"invalid multiaddr {text!r}: {reason}") from None
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
    join.add_argument("--initial-peers-wait", type=float, metavar="SECONDS",
                      help="keep trying the initial peers this long if none answers, for peers started together "
                           "with them (default 0: fail at once)")
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
    join.add_argument("--debug-corrupt-pseudo-gradient", metavar="nan|scale:<k>|inverse:<k>|random",
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
    """The parser of every subcommand: ``join``, ``swarm``, ``bootstrap``, ``status``, ``eval``, ``export``,
    ``plot``.

    Returns:
        The parser; its ``command`` attribute names the subcommand.
    """
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
    plot = sub.add_parser("plot", help="draw a run's eval loss, round time, bytes and group size into a PNG")
    plot.add_argument("--log-dir", required=True, metavar="DIR",
                      help="the --log-dir of a join or swarm run (its <peer id>/events.jsonl files)")
    plot.add_argument("--out", metavar="FILE.png", help="the PNG to write (default: DIR/plot.png)")
    return parser


# How the flags of `join` (and of `swarm`, which has some of them) override the config: (argparse dest, config key).
# A flag given on the command line is not None (none of them has another default); the exceptions are in
# _given_flags. Explicit flags are applied last, so they beat the --config file and --set.
FLAGS: tuple[tuple[str, str], ...] = (
    ("run_id", "run.run_id"),
    ("max_rounds", "run.max_rounds"),
    ("inner_steps", "train.inner_steps"),
    ("data_seed", "data.seed"),
    ("checkpoint_dir", "checkpoint.dir"),
    ("resume", "checkpoint.resume"),
    ("initial_peers", "swarm.initial_peers"),
    ("host_maddrs", "swarm.host_maddrs"),
    ("announce_maddrs", "swarm.announce_maddrs"),
    ("allowed_peers", "swarm.allowed_peers"),
    ("identity_path", "swarm.identity_path"),
    ("client_mode", "swarm.client_mode"),
    ("use_relay", "swarm.use_relay"),
    ("use_auto_relay", "swarm.use_auto_relay"),
    ("startup_timeout", "swarm.startup_timeout"),
    ("initial_peers_wait", "swarm.initial_peers_wait"),
    ("debug_step_delay", "debug.step_delay"),
    ("debug_corrupt_pseudo_gradient", "debug.corrupt_pseudo_gradient"),
)
# The swarm's addresses, checked once the flags are in: (swarm.<key>, whether each must end with /p2p/<peer id>).
MADDR_KEYS = (("initial_peers", True), ("host_maddrs", False), ("announce_maddrs", False))


def _given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``{config key: value}`` of the :data:`FLAGS` given in ``args``."""
    values = {dest: getattr(args, dest, None) for dest, _ in FLAGS}  # `swarm` has only some of them
    if values["initial_peers"] is None and os.environ.get(ENV_INITIAL_PEERS, "").strip():
        values["initial_peers"] = os.environ[ENV_INITIAL_PEERS].split()
    # --resume is store_true: False only means "not given", which must not undo `resume = true` in a config file
    values["resume"] = True if values["resume"] else None
    # `swarm --debug-step-delay` is a list, one delay per peer: the launcher passes each peer its own
    if isinstance(values["debug_step_delay"], list):
        values["debug_step_delay"] = None
    return {key: values[dest] for dest, key in FLAGS if values[dest] is not None}


def load_join_config(args: argparse.Namespace) -> Config:
    """The config of a ``join`` (or ``swarm``) command line: defaults < --config file < --set < explicit flags.

    Args:
        args: The parsed command line; the flags of :data:`FLAGS` it lacks count as not given.

    Returns:
        The checked configuration, with the swarm's multiaddrs in their canonical form.

    Raises:
        UsageError: Bad config, a bad multiaddr or allowed peer, or ``--client-mode`` without initial peers.
    """
    cfg = load_config(args.config, args.sets)
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in _given_flags(args).items():
        section, name = key.split(".")
        overrides.setdefault(section, {})[name] = value
    apply_overrides(cfg, overrides)
    for name, need_peer_id in MADDR_KEYS:
        setattr(cfg.swarm, name, [validate_maddr(m, need_peer_id=need_peer_id) for m in getattr(cfg.swarm, name)])
    if cfg.swarm.client_mode and not cfg.swarm.initial_peers:
        raise UsageError("--client-mode needs --initial-peers: a peer nobody can reach cannot start a swarm")
    check_identity_path(cfg.swarm.identity_path)
    # Imported here: swarm.allowlist imports hivemind (over a second), which --help and most bad input never need.
    from ..swarm.allowlist import resolve_allowed_peers

    resolve_allowed_peers(cfg.swarm.allowed_peers)  # a bad entry is a one-line error now, not after the data is built
    return cfg


def check_identity_path(path: str | None) -> None:
    """Refuse an identity file that could not be created, before the seconds of imports and model building that
    come before the swarm starts (the same message as :class:`~p2p_diloco.swarm.identity.Identity`'s, which still
    catches what changes in between, and what this cannot see: a read-only file system, say).

    Raises:
        UsageError: ``path`` does not exist and its directory does not either, or is not a directory.
    """
    if not path or os.path.exists(os.path.expanduser(path)):
        return
    parent = os.path.dirname(os.path.expanduser(path)) or "."
    if not os.path.isdir(parent):
        why = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise UsageError(f"cannot create identity file {path}: {parent} {why}")
