"""CPU time of one read of the commit step (issue 17): a member polls the round's signatures every 25 ms at first.

    python -m benchmarks.commit_poll [--members 8 16 64] [--repeats 5]

Method: N real RSA identities (:class:`~p2p_diloco.swarm.identity.Identity`, as peers have) sign one round's
statement; every member's ``sig`` blob holds its signature and every ``cert`` blob the previous round's complete
certificate (what the DHT holds while a round commits). One read is what :class:`~p2p_diloco.peer.certifier.
Certifier` does per poll: :func:`~p2p_diloco.protocol.commit.signatures_for` over every blob, then
:func:`~p2p_diloco.protocol.commit.decide_commit`. Two cases, the median of ``--repeats`` each, in this process:

* ``first``: every signature is new (it is checked);
* ``later``: one member is late and the others' signatures were checked by an earlier poll (what a member pays
  every poll while it waits, up to the commit window).

No DHT and no network: the DHT's own cost is in ``benchmarks.allreduce`` (``commit_s``). The last line is
``poll_ms_n<N>=<later> ...`` for every N.
"""

from __future__ import annotations

import argparse
import statistics
import time


def measure(n: int, repeats: int) -> tuple[float, float]:
    """``(first, later)`` median seconds of one read at ``n`` members."""
    from p2p_diloco.protocol import commit
    from p2p_diloco.protocol.certificate import Certificate, Statement, sign
    from p2p_diloco.swarm.identity import Identity, RSAKeyBook

    ids = [Identity() for _ in range(n)]
    try:
        members = tuple(sorted(i.peer_id for i in ids))
        by_id = {i.peer_id: i for i in ids}

        def statement(round_: int, before: str, after: str) -> Statement:
            return Statement(run_id="bench", fingerprint="0" * 16, round=round_, members=members,
                             weights=(1.0,) * n, before=before, after=after, prev="")

        previous, s = statement(2, "c" * 64, "a" * 64), statement(3, "a" * 64, "b" * 64)
        head = Certificate(previous, {pid: sign(previous, by_id[pid]) for pid in members}).to_bytes()
        certs = dict.fromkeys(members, head)
        blobs = {pid: commit.encode_signature(s, *sign(s, by_id[pid])) for pid in members}
        late = dict(list(blobs.items())[1:])
        keys = RSAKeyBook()

        def once(sig_blobs: dict, verified: frozenset) -> float:
            t0 = time.perf_counter()
            found = commit.signatures_for(s, sig_blobs, certs)
            commit.decide_commit(s, found, keys, 0.0, 1.0, 0.1, verified)
            return time.perf_counter() - t0

        first = statistics.median(once(blobs, frozenset()) for _ in range(repeats))
        later = statistics.median(once(late, frozenset(late)) for _ in range(repeats))
        return first, later
    finally:
        for i in ids:
            i.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    last = []
    print(f"{'N':>4} {'first ms':>9} {'later ms':>9}")
    for n in args.members:
        first, later = measure(n, args.repeats)
        print(f"{n:>4} {1000 * first:>9.2f} {1000 * later:>9.2f}")
        last.append(f"poll_ms_n{n}={1000 * later:.2f}")
    print(" ".join(last))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
