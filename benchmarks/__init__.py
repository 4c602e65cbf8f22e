"""Benchmarks of p2p-diloco, each run from the repository root as ``python -m benchmarks.<name> [args]``.

Every benchmark prints its figures and ends with one ``name=value`` line (README, "Benchmarks"). Shared code lives
in :mod:`benchmarks.common`; peer processes are started with :class:`p2p_diloco.runtime.peer_process.PeerProcess`.
"""
