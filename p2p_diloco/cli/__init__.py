"""``p2p-diloco``: one console entry with subcommands (``join``, ``swarm``, ``bootstrap``, ``status``,
``eval``, ``export``).

Every kind of bad input ends the same way: one line on stderr, exit code 2, no traceback, within seconds.
The parser and the flag -> config table are in :mod:`.parser`, the subcommands in :mod:`.commands` (``swarm`` in
:mod:`.launcher`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from ..errors import UsageError
from .commands import cmd_bootstrap, cmd_eval, cmd_export, cmd_join, cmd_status
from .parser import build_parser, load_join_config, validate_maddr
from .util import EXIT_USAGE, setup_logging, write_json_atomic

__all__ = ["build_parser", "load_join_config", "main", "validate_maddr", "write_json_atomic"]

COMMANDS = {"join": cmd_join, "eval": cmd_eval, "export": cmd_export, "bootstrap": cmd_bootstrap,
            "status": cmd_status}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``p2p-diloco`` command line (the console entry point).

    Args:
        argv: The arguments after the program name; None = ``sys.argv[1:]``.

    Returns:
        The exit code: 0 on success, 2 for bad input (one line on stderr), 130 when interrupted; ``swarm`` returns
        1 when a peer failed or the peers' weights differ.
    """
    # hivemind's own INFO lines (e.g. "Checking that identity ... is not used") would break the one-line error
    # rule; its warnings and errors still show. Read once, when hivemind is first imported.
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    args = build_parser().parse_args(argv)
    setup_logging(logging.WARNING if args.command == "join" else logging.INFO)
    try:
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
        from .launcher import cmd_swarm  # launcher imports this package: it can only be imported once it is loaded

        return cmd_swarm(args)
    except UsageError as e:
        print(f"p2p-diloco {args.command}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"p2p-diloco {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
