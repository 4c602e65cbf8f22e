"""A p2p-diloco peer with the fault hooks the product does not have, for the real-process fault tests:

    python -m tests.swarm.faulty_peer [--part-delay S] [--state-delay S] join ...

``--part-delay`` sleeps before sending each all-reduce part (so that a signal lands mid-transfer), ``--state-delay``
before each chunk of a state download it serves. They are class attributes of the averager, which its process
inherits when it forks; everything else is the real ``p2p-diloco`` command.
"""

from __future__ import annotations

import argparse
import sys

from p2p_diloco.cli import main as cli_main
from p2p_diloco.swarm.exact_averager import ExactAverager


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="faulty_peer", add_help=False)
    parser.add_argument("--part-delay", type=float, default=0.0)
    parser.add_argument("--state-delay", type=float, default=0.0)
    hooks, rest = parser.parse_known_args(argv)
    ExactAverager.part_delay, ExactAverager.state_delay = hooks.part_delay, hooks.state_delay
    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main())
