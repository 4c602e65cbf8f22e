"""One ExactAverager peer for test_averager.py, run as its own subprocess (process group).

Usage: averager_peer.py INDEX GROUP_SIZE OUT_PREFIX [--initial MADDR] [--die-after-parts K] [--attempts A]
                       [--retry-only-matchmaking]
                       [--codec none|fp16|bf16|int8|int4]
                       [--slow-answers SECONDS] [--trailing-error]
Prints ``MADDRS <addr>...`` once its DHT is up; writes OUT_PREFIX.json (and OUT_PREFIX.pt on success).
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


def make_tensors(i: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return [torch.randn(*s, generator=g) for s in SHAPES]


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

    async def dying_serve(self, conn, sender, weight):  # data plane: die once a sender's part arrives
        os.killpg(os.getpgrp(), signal.SIGKILL)
        await original_serve(self, conn, sender, weight)

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
    """Patch the reducer so that it ends every answer stream with an error after its last averaged part: what
    hivemind's handler sends when something fails once all parts were answered (e.g. a sender's end of stream
    arrives after ``sender_timeout``). The senders then hold every part of our slice."""
    from hivemind.proto import averaging_pb2

    from p2p_diloco.swarm.exact_averager import ExactAllReduceRunner

    original = ExactAllReduceRunner.rpc_aggregate_part

    async def erring(self, stream, context):
        async for msg in original(self, stream, context):
            yield msg
        yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)

    ExactAllReduceRunner.rpc_aggregate_part = erring


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("index", type=int)
    p.add_argument("group_size", type=int)
    p.add_argument("out")
    p.add_argument("--initial", nargs="*", default=None)
    p.add_argument("--die-after-parts", type=int, default=None)
    p.add_argument("--attempts", type=int, default=1)
    p.add_argument("--retry-only-matchmaking", action="store_true",
                   help="retry only an attempt that found no group (an all-reduce failure ends the run)")
    p.add_argument("--slow-answers", type=float, default=0.0)
    p.add_argument("--trailing-error", action="store_true")
    p.add_argument("--no-wait", action="store_true", help="shut down at once after writing the result")
    p.add_argument("--codec", default="none")
    p.add_argument("--transport", choices=["p2p", "tcp"], default="p2p")
    p.add_argument("--expect", type=int, default=None,
                   help="the group size this peer asks for (default: group_size, the number of peers)")
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
    dht = hivemind.DHT(initial_peers=args.initial or None, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    print("MADDRS", *[str(m) for m in dht.get_visible_maddrs()], flush=True)
    av = ExactAverager(make_tensors(args.index), dht, start=False, prefix="avgtest", min_matchmaking_time=5.0,
                       request_timeout=2.0, allreduce_timeout=30.0, next_chunk_timeout=3.0, part_size_bytes=2**16,
                       compression=compression_for(args.codec))
    gather = {"round": 3, "digest": "d3", "tokens": args.index + 1, "head": ""}  # what a peer's Syncer gathers
    if args.transport == "tcp":  # what Swarm does: a listening socket before the fork, its address in the gather
        from p2p_diloco.outer.codecs import get_codec
        from p2p_diloco.swarm.fastpath import listen_socket

        av.codec, av.data_socket = get_codec(args.codec), listen_socket("127.0.0.1")
        gather["data"] = f"127.0.0.1:{av.data_socket.getsockname()[1]}"
    av.run_in_background(await_ready=True, timeout=30)
    t0 = time.monotonic()
    errors = []
    for _ in range(args.attempts):
        # Like Swarm.all_reduce: every attempt starts from our own tensors and the round's group key, because a
        # failed attempt leaves garbage in the buffers and hivemind moves the group key once a group assembles.
        # A retry is needed in practice: hivemind's matchmaking can assemble a group that one follower never hears
        # of (its join stream is reset), and then the others' all-reduce aborts for want of its parts.
        with av.get_tensors() as ts:
            for t, mine in zip(ts, make_tensors(args.index)):
                t.copy_(mine)
        av.set_round_params("0110", args.expect or args.group_size, timeout=10)
        try:
            result = av.step(weight=float(args.index + 1), timeout=15, allow_retries=False, gather=gather)
            break
        except Exception as e:
            errors.append(repr(e)[:300])
            if args.retry_only_matchmaking and "could not find a group" not in repr(e):
                break
    else:
        result = None
    if result is not None:
        with av.get_tensors() as ts:
            torch.save([t.clone() for t in ts], args.out + ".pt")
            out = {"ok": True, "digest": digest(ts), "group_size": result["group_size"], "attempts": len(errors) + 1,
                   "bytes_sent": result["bytes_sent"], "bytes_received": result["bytes_received"],
                   "me": dht.peer_id.to_base58(),
                   "gathered": {pid.to_base58(): data for pid, data in result["gathered"].items()}}
    else:
        out = {"ok": False, "error": errors[-1], "errors": errors, "seconds": time.monotonic() - t0}
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
