"""``p2p-diloco``: one console entry with subcommands (``join``, ``swarm``, ``bootstrap``, ``status``,
``eval``, ``export``, ``plot``).

Every kind of bad input ends the same way: one line on stderr, exit code 2, no traceback, within seconds.
The parser and the flag -> config table are in :mod:`.parser`, the subcommands in :mod:`.commands` (``swarm`` in
:mod:`.launcher`, ``plot`` in :mod:`.plot`).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from typing import Sequence

from ..errors import RunError, UsageError
from ..runtime.processes import adopt_orphans
from ..runtime.signals import StopSignals, interrupted_exit_code
from .commands import cmd_bootstrap, cmd_eval, cmd_export, cmd_join, cmd_status
from .parser import build_parser, load_join_config, validate_maddr
from .util import EXIT_USAGE, setup_logging, write_json_atomic

__all__ = ["build_parser", "load_join_config", "main", "validate_maddr", "write_json_atomic"]

COMMANDS = {"join": cmd_join, "eval": cmd_eval, "export": cmd_export, "bootstrap": cmd_bootstrap,
            "status": cmd_status}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``p2p-diloco`` command line (:func:`run`); from the console (``argv`` None), spare the process's
    exit the garbage collector's pass over torch's and hivemind's objects (0.3 s of CPU alone, seconds when peers
    busy the cores; files and atexit handlers are unaffected)."""
    try:
        return run(argv)
    finally:
        if argv is None:
            gc.freeze()


def run(argv: Sequence[str] | None = None) -> int:
    """Run one ``p2p-diloco`` command line (the console entry point).

    Args:
        argv: The arguments after the program name; None = ``sys.argv[1:]``.

    Returns:
        The exit code: 0 on success, 2 for bad input (one line on stderr), 1 when the run could not go on (one
        line: e.g. a checkpoint could not be written), 128 + the signal's number when SIGINT or SIGTERM stopped it
        (130, 143: the shell's convention), after a clean shutdown; ``swarm`` returns 1 when a peer failed or the
        peers' weights differ.
    """
    StopSignals().install()  # until a command takes over: a signal aborts at once (runtime/signals.py)
    # A p2pd whose DHT process is killed mid-start comes back to us to be reaped. Only a console command's own
    # process becomes a subreaper (argv None): an in-process caller (a test worker) that never waits for adopted
    # orphans would keep them as zombies, and their process groups would never look gone.
    if argv is None:
        adopt_orphans()
    # hivemind's own INFO lines (e.g. "Checking that identity ... is not used") would break the one-line error
    # rule; its warnings and errors still show. Read once, when hivemind is first imported.
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    args = build_parser().parse_args(argv)
    setup_logging(logging.WARNING if args.command == "join" else logging.INFO)
    try:
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
        if args.command == "plot":  # matplotlib only when drawing
            from .plot import cmd_plot

            return cmd_plot(args)
        from .launcher import cmd_swarm  # launcher imports this package: it can only be imported once it is loaded

        return cmd_swarm(args)
    except UsageError as e:
        print(f"p2p-diloco {args.command}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except RunError as e:  # not bad input: the run could not go on (e.g. a checkpoint could not be written)
        print(f"p2p-diloco {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:  # Interrupted (a stop signal), or Python's own for SIGINT
        print(f"p2p-diloco {args.command}: interrupted", file=sys.stderr, flush=True)
        return interrupted_exit_code(getattr(e, "signum", signal.SIGINT))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
