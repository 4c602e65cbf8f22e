"""One ExactAverager peer for test_averager.py, run as its own subprocess (process group).

Usage: averager_peer.py INDEX GROUP_SIZE OUT_PREFIX [--initial-from FILE] [--die-after-parts K] [--attempts A]
                       [--retry-only-matchmaking]
                       [--codec none|fp16|bf16|int8|int4|topk]
                       [--slow-answers SECONDS] [--trailing-error]
                       [--transport p2p|tcp] [--fd-headroom K] (and the other hooks: see main)
Prints ``MADDRS <addr>...`` once its DHT is up and writes them to OUT_PREFIX.maddrs (whole, or not there); writes
OUT_PREFIX.json (and OUT_PREFIX.pt on success).
"""

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

SHAPES = [(512, 1024), (333,)]


def make_tensors(i: int, codec: str = "none") -> list[torch.Tensor]:
    """Peer ``i``'s tensors. With ``topk`` what a peer's error feedback hands the averager: the codec's decoding
    of the concatenated tensors (outer/error_feedback.py)."""
    g = torch.Generator().manual_seed(i)
    tensors = [torch.randn(*s, generator=g) for s in SHAPES]
    if codec != "topk":
        return tensors
    from p2p_diloco.outer.codecs import get_codec

    # one flat tensor, as swarm/averagers.py averages for a chunked codec
    return [get_codec("topk").round_trip(torch.cat([t.reshape(-1) for t in tensors]))]


def die_mid_allreduce(after_parts: int) -> None:
    """Patch the sender so that the peer's whole process group is SIGKILLed after streaming ``after_parts`` parts."""
    from p2p_diloco.swarm.exact_averager import ExactAllReduceRunner

    original = ExactAllReduceRunner._generate_input_for_peer

    async def dying(self, peer_index):
        sent = 0
        async for msg in original(self, peer_index):
            if sent == after_parts:  # we run in the averager process; take the whole peer down with us
                os.killpg(os.getpgrp(), signal.SIGKILL)
            sent += 1
            yield msg

    ExactAllReduceRunner._generate_input_for_peer = dying

    from p2p_diloco.swarm.fastpath import FastAllReduce

    original_serve = FastAllReduce.serve

    async def dying_serve(self, conn, sender):  # data plane: die once a sender's part arrives
        os.killpg(os.getpgrp(), signal.SIGKILL)
        await original_serve(self, conn, sender)

    FastAllReduce.serve = dying_serve


def slow_answers(delay: float) -> None:
    """Patch the reducer so that it hands each averaged part to the transport ``delay`` s late: our own outputs
    are then complete well before our answers to the other senders are (the race behind a short bytes_sent)."""
    from p2p_diloco.swarm.exact_averager import ExactAllReduceRunner

    original = ExactAllReduceRunner.rpc_aggregate_part

    async def slow(self, stream, context):
        async for msg in original(self, stream, context):
            await asyncio.sleep(delay)
            yield msg

    ExactAllReduceRunner.rpc_aggregate_part = slow


def trailing_error() -> None:
    """Patch the reducer so that every answer stream carries an error right after its last averaged part: what
    hivemind's handler sends when something fails once all parts were answered (e.g. a sender's end of stream
    arrives after ``sender_timeout``). The senders then hold every part of our slice. (Patched where the answers
    are made, before runner.py's handler waits for the sender to hang up: after that wait no sender reads it.)"""
    from hivemind.proto import averaging_pb2

    from p2p_diloco.swarm.exact_averager import ExactAllReduceRunner

    original = ExactAllReduceRunner._accumulate_parts_streaming

    async def erring(self, stream, sender_index):
        async for msg in original(self, stream, sender_index):
            yield msg
        yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)

    ExactAllReduceRunner._accumulate_parts_streaming = erring


def impersonate(out: str) -> None:
    """Issue 18, point 1: an insider that, before its own honest run, sends every other reducer a part of -5.0 in
    the name of the third member, as well as an insider can: a header tagged with its own pair key with that
    reducer (it has no other). Writes ``out`` + ``.answered``: how many of those parts a reducer answered."""
    import torch as _torch

    from p2p_diloco.swarm import data_auth, fastpath

    original = fastpath.FastAllReduce.run

    async def send_as(self, reducer: int, victim: int, timeout: float) -> bool:
        sock = await fastpath.connect(self.addresses[reducer], timeout)
        try:
            nonce, pair_key = os.urandom(data_auth.NONCE), self._pair_key(self.index, reducer)
            payload = fastpath.view_of(self.codec.encode(_torch.full((self._numel(reducer),), -5.0)))
            layout = (self.bounds[reducer], self.bounds[reducer + 1], self.flat.numel())
            header = (fastpath.MAGIC + self.key + fastpath.INDICES.pack(victim, reducer, 1.0, len(payload), *layout)
                      + nonce)
            header += data_auth.tag(data_auth.subkey(pair_key, b"hdr", nonce), header)
            await fastpath.send_all(sock, memoryview(header), timeout)
            await data_auth.send_sealed(sock, payload, data_auth.subkey(pair_key, b"up", nonce), False, timeout)
            status = bytearray(1)
            await fastpath.recv_into(sock, memoryview(status), timeout)
            return True  # the reducer answered: it took our part as the victim's
        except OSError:  # it hung up on us
            return False
        finally:
            sock.close()

    async def run(self, connect_timeout, wait_timeout):
        answered = 0
        for reducer in range(self.n):
            if reducer != self.index:
                victim = next(k for k in range(self.n) if k not in (reducer, self.index))
                answered += await asyncio.wait_for(send_as(self, reducer, victim, 5.0), 10)
        Path(out + ".answered").write_text(str(answered))
        return await original(self, connect_timeout, wait_timeout)

    fastpath.FastAllReduce.run = run


def list_self_twice(out: str) -> None:
    """Issue 18 review: a leader that lists itself twice in the group it sends out, in place of its second
    follower (hivemind's follower checks only that it is in the list), to hold two of three members' slots.
    Writes ``out`` + ``.led`` if it led a group."""
    from hivemind.averaging.group_info import GroupInfo
    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.dht.routing import DHTID

    async def doubled(self):
        ordered = [next(iter(self.current_followers)), self.peer_id, self.peer_id]  # the size the members expect
        gathered = tuple(self.step_control.data_for_gather if p == self.peer_id else self.current_followers[p].gather
                         for p in ordered)
        group_info = GroupInfo(DHTID.generate().to_bytes(), tuple(ordered), gathered)
        self.assembled_group.set_result(group_info)  # (no key rotation: hivemind's assumes distinct members)
        Path(out + ".led").write_text("led")
        return group_info

    Matchmaking.leader_assemble_group = doubled


def connect_after(marker: str) -> None:
    """Open our data-plane connections only once ``marker`` exists (the impersonator writes it when its fake parts
    have all been sent and dropped), so that the fake parts are the first a reducer sees."""
    from p2p_diloco.swarm import fastpath

    original = fastpath.FastAllReduce._send_to

    async def after(self, j):
        deadline = time.monotonic() + 20
        while not Path(marker).exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return await original(self, j)

    fastpath.FastAllReduce._send_to = after


def low_fd_limit(headroom: int, out: str) -> None:
    """Start our data port's server as soon as the averager process is up (a peer's stays up from its first round
    on, so that is what an attacker meets), then allow that process only ``headroom`` more open files. Writes
    ``out`` + ``.port`` (our data port) once both are done, and ``out`` + ``.refused`` (the connections the server
    closed at accept: over a cap) after each all-reduce."""
    import resource

    from p2p_diloco.swarm.data_server import DataServer
    from p2p_diloco.swarm.exact_averager import ExactAverager

    original_handlers, original_allreduce = ExactAverager.add_p2p_handlers, ExactAverager._fast_allreduce

    async def serving_early(self, *args, **kwargs):  # runs once, in the averager process, before it is ready
        await original_handlers(self, *args, **kwargs)
        self._data_server = DataServer(self.data_socket, register_timeout=self._allreduce_timeout or 60.0)
        await self._data_server.start()
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + headroom, hard))
        Path(out + ".port.tmp").write_text(str(self.data_socket.getsockname()[1]))
        os.replace(out + ".port.tmp", out + ".port")  # (whole, or not there)

    async def counting(self, *args, **kwargs):
        try:
            return await original_allreduce(self, *args, **kwargs)
        finally:
            Path(out + ".refused").write_text(str(self._data_server.refused))

    ExactAverager.add_p2p_handlers, ExactAverager._fast_allreduce = serving_early, counting


def rewrite_addresses(rogue: str, out: str) -> None:
    """Issue 18, point 1: a leader that points every follower's data address at ``rogue`` (in the entries it
    relays) before it sends the group out. Writes ``out`` + ``.led`` if it led a group."""
    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.utils import MSGPackSerializer

    original = Matchmaking.leader_assemble_group

    async def rewriting(self):
        for request in self.current_followers.values():
            outer = list(MSGPackSerializer.loads(request.gather))
            user = MSGPackSerializer.loads(outer[2])
            user["data"]["addr"] = rogue
            outer[2] = MSGPackSerializer.dumps(user)
            request.gather = MSGPackSerializer.dumps(outer)
        Path(out + ".led").write_text("led")
        return await original(self)

    Matchmaking.leader_assemble_group = rewriting


def slow_accept(seconds: float) -> None:
    """Patch the follower so that it reads each leader's first answer (ACCEPTED) ``seconds`` after it arrived: the
    message in flight on a loaded machine, while the leader, which assembles the group the moment it has sent
    ACCEPTED to the member that fills it, already counts us in (CI, 2026-12-07)."""
    from p2p_diloco.swarm.exact_averager import ExactAverager

    get_stub = ExactAverager.get_stub.__func__

    class Late:
        def __init__(self, stream):
            self.stream, self.first = stream, True

        def __aiter__(self):
            return self

        async def __anext__(self):
            message = await self.stream.__anext__()
            if self.first:
                self.first = False
                await asyncio.sleep(seconds)
            return message

        async def aclose(self):
            await self.stream.aclose()

    def slow_stub(cls, p2p, peer, *, namespace=None):
        stub = get_stub(cls, p2p, peer, namespace=namespace)
        join = stub.rpc_join_group

        async def late_join(request, *args, **kwargs):
            return Late(await join(request, *args, **kwargs))
        stub.rpc_join_group = late_join
        return stub

    ExactAverager.get_stub = classmethod(slow_stub)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("index", type=int)
    p.add_argument("group_size", type=int)
    p.add_argument("out")
    p.add_argument("--initial-from", default=None, help="join the DHT at the addresses in this file (waits for it)")
    p.add_argument("--die-after-parts", type=int, default=None)
    p.add_argument("--attempts", type=int, default=1)
    p.add_argument("--retry-only-matchmaking", action="store_true",
                   help="retry only an attempt that found no group (an all-reduce failure ends the run)")
    p.add_argument("--slow-answers", type=float, default=0.0)
    p.add_argument("--trailing-error", action="store_true")
    p.add_argument("--no-wait", action="store_true", help="shut down at once after writing the result")
    p.add_argument("--codec", default="none")
    p.add_argument("--transport", choices=["p2p", "tcp"], default="p2p")
    p.add_argument("--impersonate", action="store_true", help="an insider sending parts in another's name")
    p.add_argument("--connect-after", default=None, help="connect once this file exists (the impersonator's)")
    p.add_argument("--list-self-twice", action="store_true", help="a leader holding two members' slots")
    p.add_argument("--led-by-0", action="store_true",
                   help="name peer 0 the leader of every attempt (led_matchmaking.py), as a Swarm names the round's")
    p.add_argument("--slow-accept", type=float, default=0.0,
                   help="a follower that reads its leader's ACCEPTED this many seconds after it arrived")
    p.add_argument("--rewrite-addresses", default=None, help="a leader pointing the followers' data at this address")
    p.add_argument("--fd-headroom", type=int, default=None,
                   help="--transport tcp: serve the data port at once, then allow only this many more open files")
    p.add_argument("--expect", type=int, default=None,
                   help="the group size this peer asks for (default: group_size, the number of peers)")
    p.add_argument("--first-expect", type=int, default=None,
                   help="the group size this peer asks for in its first attempt only (a view missing a round-mate)")
    p.add_argument("--regroup", action="store_true",
                   help="with --led-by-0: end an attempt once the leader answers that it expects another group")
    p.add_argument("--step-timeout", type=float, default=15.0, help="each attempt's step timeout")
    p.add_argument("--chunk-timeout", type=float, default=3.0,
                   help="next_chunk_timeout: how long a reducer waits without progress from any sender")
    p.add_argument("--in-place", action="store_true",
                   help="as swarm/averagers.py: one flat shared buffer, averaged in place, the input kept by the host")
    args = p.parse_args()
    import hivemind

    from p2p_diloco.outer.optimizer import digest
    from p2p_diloco.swarm.exact_averager import ExactAverager
    from p2p_diloco.swarm.compression import compression_for

    if args.die_after_parts is not None:
        die_mid_allreduce(args.die_after_parts)
    if args.slow_answers:
        slow_answers(args.slow_answers)
    if args.trailing_error:
        trailing_error()
    if args.impersonate:
        impersonate(args.out)
    if args.list_self_twice:
        list_self_twice(args.out)
    if args.connect_after:
        connect_after(args.connect_after)
    if args.slow_accept:
        slow_accept(args.slow_accept)
    if args.rewrite_addresses:
        rewrite_addresses(args.rewrite_addresses, args.out)
    if args.fd_headroom is not None:
        low_fd_limit(args.fd_headroom, args.out)
    from p2p_diloco.swarm.identity import Identity

    initial = None
    if args.initial_from:
        source, deadline = Path(args.initial_from), time.monotonic() + 60
        while not source.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        initial = source.read_text().split()
    identity = Identity()  # our libp2p identity: it signs our data-plane entry, as in a peer
    dht = hivemind.DHT(initial_peers=initial, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       identity_path=identity.path, check_if_identity_free=False)  # fresh: as a peer (swarm.py)
    identity.close()  # p2pd has read it
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    Path(args.out + ".maddrs.tmp").write_text(" ".join(maddrs))
    os.replace(args.out + ".maddrs.tmp", args.out + ".maddrs")
    print("MADDRS", *maddrs, flush=True)
    mine = make_tensors(args.index, args.codec)
    flat = [torch.cat([t.reshape(-1) for t in mine])] if args.in_place else mine
    av = ExactAverager(flat, dht, start=False, prefix="avgtest",
                       min_matchmaking_time=5.0, request_timeout=2.0, allreduce_timeout=30.0,
                       next_chunk_timeout=args.chunk_timeout, part_size_bytes=2**16,
                       compression=compression_for(args.codec, 2**16))
    from p2p_diloco.outer.aggregation import Policy

    av.policy = Policy(method="mean")  # the weighted mean: what the tests compute exactly
    gather = {"round": 3, "digest": "d3", "tokens": args.index + 1, "head": ""}  # what a peer's Syncer gathers
    if args.transport == "tcp":  # what Swarm does: a listening socket before the fork, its signed entry in the gather
        from p2p_diloco.outer.codecs import get_codec
        from p2p_diloco.swarm.data_auth import DataKey, DataPeer, advertise
        from p2p_diloco.swarm.fastpath import listen_socket

        av.codec, av.data_socket, av.data_key = get_codec(args.codec), listen_socket("127.0.0.1"), DataKey()
        me = DataPeer(identity.peer_id, f"127.0.0.1:{av.data_socket.getsockname()[1]}", av.data_key.public)
        gather["data"] = advertise(identity.sign, identity.public_key, av.prefix, me)
    if args.in_place:
        from p2p_diloco.swarm.source_channel import SourceChannel

        av.source_channel = SourceChannel()
    av.run_in_background(await_ready=True, timeout=30)
    if args.in_place:
        av.source_channel.serve()
        av.source_channel.set_inputs(mine)  # the host's copy, unchanged through every attempt
    leader = None
    if args.led_by_0:  # peer 0's id: ours, or the last part of the address it wrote (/p2p/<id>)
        leader = dht.peer_id.to_base58() if initial is None else initial[0].rsplit("/p2p/", 1)[1]
    t0 = time.monotonic()
    errors, result, attempt_seconds = [], None, []
    for attempt in range(args.attempts):
        # Like Swarm.all_reduce: every attempt starts from our own tensors and the round's group key, because a
        # failed attempt leaves garbage in the buffers and hivemind moves the group key once a group assembles.
        # A retry is needed in practice: hivemind's matchmaking can assemble a group that one follower never hears
        # of (its join stream is reset, or, with hivemind's election, it gave up on an ACCEPTED still in flight:
        # led_matchmaking.py), and then the others' all-reduce aborts for want of its parts.
        with av.get_tensors() as ts:
            torch.cat([t.reshape(-1) for t in mine], out=ts[0]) if args.in_place else [
                t.copy_(m) for t, m in zip(ts, mine)]
        size = args.first_expect if attempt == 0 and args.first_expect else args.expect or args.group_size
        av.set_round_params("0110", size, timeout=10, leader=leader, regroup=args.regroup)
        started = time.monotonic()
        try:
            result = av.step(weight=float(args.index + 1), timeout=args.step_timeout, allow_retries=False,
                             gather=gather)
            attempt_seconds.append(round(time.monotonic() - started, 2))
            break
        except Exception as e:
            attempt_seconds.append(round(time.monotonic() - started, 2))
            errors.append(repr(e)[:300])
            if args.retry_only_matchmaking and "could not find a group" not in repr(e):
                break
    if result is not None:
        with av.get_tensors() as ts:
            if args.in_place:  # (shaped as the tensors: what the tests compare with)
                ts = [piece.view_as(t) for piece, t in zip(ts[0].split([t.numel() for t in mine]), mine)]
            torch.save([t.clone() for t in ts], args.out + ".pt")
            out = {"ok": True, "digest": digest(ts), "group_size": result["group_size"], "attempts": len(errors) + 1,
                   "errors": errors, "attempt_seconds": attempt_seconds,
                   "bytes_sent": result["bytes_sent"], "bytes_received": result["bytes_received"],
                   "me": dht.peer_id.to_base58(),
                   "gathered": {pid.to_base58(): {k: v for k, v in data.items() if k != "data"}  # (bytes)
                                for pid, data in result["gathered"].items()}}
    else:
        out = {"ok": False, "error": errors[-1], "errors": errors, "seconds": time.monotonic() - t0,
               "attempt_seconds": attempt_seconds,
               "attempt_bytes": av.attempt_bytes(timeout=10)}  # (sent, received) by the last attempt
    with open(args.out + ".json", "w") as f:
        json.dump(out, f)
    # Stay up until every member has its result. Our last averaged part is "sent" once it is written to our
    # p2pd, not once the member has it: shutting p2pd down at once cut that part off (CI: two members applied
    # the round, and the third, 90 ms later, aborted with "reducer ... failed (1 parts missing)").
    # (--no-wait: one member is killed mid-way and never writes one.)
    others = [Path(args.out).with_name(f"p{k}.json") for k in range(args.group_size)]
    deadline = time.monotonic() + 60
    while not args.no_wait and time.monotonic() < deadline and not all(path.exists() for path in others):
        time.sleep(0.1)
    av.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
