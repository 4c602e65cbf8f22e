"""One bare real Swarm for test_probe.py, run as its own subprocess (process group).

Usage: probe_peer.py RUN_ID [INITIAL_MADDR...]. Prints one JSON line once started (its pid, peer id, multiaddrs,
and the pids of the processes it started), then serves until its stdin closes.
"""

import json
import os
import sys

import torch

from p2p_diloco.config import Config
from p2p_diloco.protocol.records import Phase
from p2p_diloco.swarm.swarm import Swarm


def main() -> None:
    cfg = Config()
    cfg.run.run_id = sys.argv[1]
    cfg.swarm.host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
    cfg.swarm.initial_peers = sys.argv[2:]
    swarm = Swarm(cfg, [torch.zeros(8)], lambda: ({}, []))
    swarm.start()
    try:
        swarm.publish(phase=Phase.TRAIN, round=1)
        print(json.dumps({"pid": os.getpid(), "peer_id": swarm.peer_id, "maddrs": swarm.visible_maddrs(),
                          "owned": sorted(swarm._owned)}), flush=True)
        sys.stdin.read()
    finally:
        swarm.shutdown()


if __name__ == "__main__":
    main()
