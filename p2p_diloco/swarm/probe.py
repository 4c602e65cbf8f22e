"""Direct probes: is nothing listening any more where a peer was reached? (``SwarmPort.probe``, issue 20).

A dead peer's host answers a TCP dial of its address with a refusal (RST) at once; a frozen, slow or far peer's
does not (a SIGSTOPped process's kernel still accepts connections; a far one times out). So a refusal of *our own*
dial, made *now*, is proof that the peer's process is gone, and nothing else is: a timeout proves nothing, and no
other peer's word is taken. The peer's processes all die with its main process (swarm/starting.py), so a
``kill -9`` of that process alone closes its listener too.

The rule, for each peer id asked about (:meth:`Prober.probe`): it is reported *refused* iff

1. our p2pd has no connection to it now (an open, authenticated libp2p connection is a live peer);
2. we know where it listens: the TCP addresses its own signed live record announces (``maddrs``, at most
   :data:`MAX_ADDRS`), else those of our last libp2p connection with it (our p2pd's view, read every ``refresh``
   seconds: a peer that announced nothing and was connected for less than that before it died is not known,
   hence never reported);
3. a TCP connect from this process, made in this call, to *every* such address (at most :data:`MAX_ADDRS`) ends in
   ``ECONNREFUSED`` or ``ECONNRESET`` before the call's deadline.

Limits (what callers must know): the address of a connection the peer opened is its listen address only because
its p2pd dials from its listening port (go-libp2p's TCP port reuse, on by default; measured on loopback: the
addresses recorded were the listen ports both ways). Behind a NAT that maps that port to another, and answers an
unsolicited connect with a reset, a live peer whose connection to us has closed would be reported: client-mode
peers (the usual NATed ones) are never probed (``Swarm.probe``), and the announced addresses come first. A peer
that restarted elsewhere with the same identity announces its new address in its new record. A record may
announce any address: the worst it does is make its own publisher a suspect, or send one connect per prober per
probe (every 0.5 s) to the address it names.

Our own p2pd is not asked to dial: after one failure libp2p answers "dial backoff" for seconds, from memory, and
on failure its routed host looks the peer up in its DHT (measured: a connect to a killed peer answered after 30 s
while another peer was frozen, and each call leaves a lookup running). A dial here is a plain TCP connect, closed
with a reset (nothing sent, no TIME_WAIT left here).
Everything runs on one event-loop thread of this process: the DHT process is never involved.

What a refusal means for a round is the protocol rules' decision, not this module's.

Introductions (:meth:`Prober.introduce`): before matchmaking, our p2pd is asked to connect to each expected
round-mate it has no connection to, at the addresses that round-mate's own signed record announces. Why: p2pd finds
a peer it never met only through its libp2p DHT, whose routing table can stay empty (measured: in 8 of 17 runs of a
4-peer swarm joined through one peer, every follower's join request failed in p2pd with "routing: not found" /
"failed to find any peer in table", and no group formed in 60 s). The connect is bounded (the call's timeout), made
only for the members of the group the round rules expect (at most the group size), and proves nothing: the
libp2p handshake checks that whoever answers at the address holds the peer id, so a false address only fails.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import socket
import struct
import threading
import time
from typing import Collection, Mapping, Sequence

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient, DaemonConnector
from multiaddr import Multiaddr

log = logging.getLogger(__name__)

MAX_ADDRS = 4  # addresses dialled per peer (a peer announces one or two per interface)
KNOWN_PEERS = 1024  # peers whose last addresses are remembered (least recently connected forgotten first)
MARGIN = 0.5  # seconds a call may take beyond its timeout (the loop thread's scheduling)
REFUSED = (errno.ECONNREFUSED, errno.ECONNRESET)

Address = tuple[int, str, int]  # (socket family, host, port)


def tcp_address(maddr: Multiaddr | str) -> Address | None:
    """``(family, host, port)`` of a direct TCP multiaddr (``/ip4|ip6/…/tcp/…``, optionally ``/p2p/…``); None for
    anything else (a relay circuit, DNS, QUIC): those cannot be dialled as a plain TCP connect."""
    parts = str(maddr).strip("/").split("/")
    if (len(parts) not in (4, 6) or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp"
            or len(parts) == 6 and parts[4] != "p2p"):
        return None
    try:
        port = int(parts[3])
    except ValueError:
        return None
    family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
    return (family, parts[1], port) if 0 < port < 65536 else None


def tcp_maddr(address: Address) -> Multiaddr:
    """The multiaddr of a :func:`tcp_address` (no ``/p2p/`` part: p2pd is given the peer id apart)."""
    family, host, port = address
    return Multiaddr(f"/{'ip4' if family == socket.AF_INET else 'ip6'}/{host}/tcp/{port}")


def _addresses(maddrs: Sequence[str]) -> tuple[Address, ...]:
    """The dialable TCP addresses among ``maddrs`` (a record's announcement: anything else is skipped)."""
    found = [a for a in map(tcp_address, maddrs[:MAX_ADDRS] if isinstance(maddrs, (list, tuple)) else ())
             if a is not None]
    return tuple(sorted(set(found)))


async def refused(address: Address, deadline: float) -> bool:
    """True iff a TCP connect to ``address`` is refused or reset before ``deadline`` (``time.monotonic()``)."""
    family, host, port = address
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)),
                               max(0.0, deadline - time.monotonic()))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        return False
    except OSError as e:  # TimeoutError is one: no proof
        return e.errno in REFUSED
    finally:
        sock.close()


async def _cancel_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Prober:
    """Probes peers directly from this process (module docstring), on a loop thread of its own.

    Args:
        daemon: the control multiaddr of our DHT's p2pd (``/unix/…``).
        refresh: seconds between two reads of our p2pd's connections (where each peer was last reached).
    """

    def __init__(self, daemon: Multiaddr, refresh: float = 1.0):
        self.daemon, self.refresh = daemon, refresh
        self._known: collections.OrderedDict[str, tuple[Address, ...]] = collections.OrderedDict()
        self._control: ControlClient | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="probe", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._watch_connections(), self._loop)

    def close(self) -> None:
        """Stop the loop thread (idempotent)."""
        if self._loop.is_closed():
            return
        try:  # the watch and any call in flight end before the loop stops
            asyncio.run_coroutine_threadsafe(_cancel_others(), self._loop).result(timeout=5.0)
        except Exception as e:  # noqa: BLE001 - the loop is stuck: stop it anyway
            log.debug("probe loop did not cancel its tasks: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def probe(self, peer_ids: Collection[str], timeout: float,
              announced: Mapping[str, Sequence[str]] | None = None) -> frozenset[str]:
        """The peers among ``peer_ids`` refused by the rule of the module docstring; returns within ``timeout`` +
        :data:`MARGIN` whatever happens (a call that runs out of time reports nothing). ``announced``: the
        multiaddrs each peer's live record announces (rule 2)."""
        if self._loop.is_closed():
            return frozenset()
        where = {pid: _addresses(maddrs) for pid, maddrs in (announced or {}).items()}
        future = asyncio.run_coroutine_threadsafe(self._probe(list(dict.fromkeys(peer_ids)), timeout, where),
                                                  self._loop)
        try:
            return future.result(timeout=timeout + MARGIN)
        except Exception as e:  # noqa: BLE001 - the loop is stuck or p2pd is gone: no proof of anything
            future.cancel()
            log.debug("probe gave no answer: %r", e)
            return frozenset()

    async def _probe(self, peer_ids: list[str], timeout: float, where: Mapping[str, tuple[Address, ...]]
                     ) -> frozenset[str]:
        deadline = time.monotonic() + timeout
        try:
            connected = await asyncio.wait_for(self._connections(), timeout)
        except Exception as e:  # noqa: BLE001 - p2pd is slow or gone: we cannot tell who is connected
            log.debug("probe could not list our connections: %r", e)
            return frozenset()
        checks = {pid: self._check(where.get(pid) or self._known.get(pid, ()), deadline) for pid in peer_ids
                  if pid not in connected}
        results = await asyncio.gather(*checks.values(), return_exceptions=True)
        return frozenset(pid for pid, result in zip(checks, results) if result is True)

    def introduce(self, announced: Mapping[str, Sequence[str]], timeout: float) -> int:
        """Connect our p2pd to each peer of ``announced`` (``{peer id: the multiaddrs its signed record announces}``)
        it has no connection to (module docstring: introductions); returns within ``timeout`` + :data:`MARGIN`, with
        the number of peers newly connected. A peer that does not answer in time is left to p2pd's own routing."""
        where = {pid: found for pid, maddrs in announced.items() if (found := _addresses(maddrs))}
        if not where or self._loop.is_closed():
            return 0
        future = asyncio.run_coroutine_threadsafe(self._introduce(where, timeout), self._loop)
        try:
            return future.result(timeout=timeout + MARGIN)
        except Exception as e:  # noqa: BLE001 - p2pd is slow or gone: matchmaking will say what fails
            future.cancel()
            log.debug("introductions gave no answer: %r", e)
            return 0

    async def _introduce(self, where: Mapping[str, tuple[Address, ...]], timeout: float) -> int:
        deadline = time.monotonic() + timeout
        connected = await asyncio.wait_for(self._connections(), timeout)
        client = await self._client()
        todo = [pid for pid in where if pid not in connected]

        async def connect(pid: str) -> None:
            await client.connect(PeerID.from_base58(pid), [tcp_maddr(a) for a in where[pid]])

        tasks = [asyncio.ensure_future(connect(pid)) for pid in todo]
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in tasks:
            task.cancel()  # p2pd may go on dialling: matchmaking's own dial then finds the connection
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = {pid: r for pid, r in zip(todo, results) if r is not None}
        if failed:
            log.debug("could not introduce our p2pd to %s", {pid[-8:]: repr(r)[:120] for pid, r in failed.items()})
        return len(todo) - len(failed)

    @staticmethod
    async def _check(addresses: tuple[Address, ...], deadline: float) -> bool:
        """Rule 3 for one peer not connected now (rule 1), with the addresses of rule 2."""
        return bool(addresses) and all(await asyncio.gather(*(refused(a, deadline) for a in addresses)))

    async def _client(self) -> ControlClient:
        if self._control is None:  # one-shot requests over p2pd's control socket: no persistent stream
            self._control = await ControlClient.create(DaemonConnector(self.daemon), use_persistent_conn=False)
        return self._control

    async def _connections(self) -> set[str]:
        """Who our p2pd is connected to now; remembers where (rule 2)."""
        by_peer: dict[str, set[Address]] = {}
        for info in await (await self._client()).list_peers():
            found = by_peer.setdefault(info.peer_id.to_base58(), set())
            found.update(a for a in map(tcp_address, info.addrs) if a is not None)
        for pid, addresses in by_peer.items():
            if addresses:
                self._known[pid] = tuple(sorted(addresses))[:MAX_ADDRS]
                self._known.move_to_end(pid)
        while len(self._known) > KNOWN_PEERS:
            self._known.popitem(last=False)
        return set(by_peer)

    async def _watch_connections(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._connections(), self.refresh)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - p2pd busy or gone: try again later
                log.debug("could not list our connections: %r", e)
            await asyncio.sleep(self.refresh)

