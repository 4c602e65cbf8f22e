#!/usr/bin/env bash
# An 8-GPU server as ONE peer: torchrun starts 8 local ranks that train one replica with DDP (NCCL, bf16
# autocast); rank 0 alone joins the swarm, averages with the other peers and broadcasts the new global weights
# (outer.sharding = rank0; see p2p_diloco/cluster.py and docs/scale.md for what holds at which size).
#   new swarm:   peers/8xh100.sh
#   join one:    P2P_DILOCO_INITIAL_PEERS=/ip4/.../tcp/.../p2p/... peers/8xh100.sh
# Environment: CONFIG (default configs/llama-1b-c4.toml; data.batch_size must divide by GPUS), GPUS (default 8),
# PORT (the swarm's TCP port, default 31338: open it inbound, or add --client-mode behind NAT).
# Extra arguments go to `p2p-diloco join` (e.g. --identity-path peer.key --checkpoint-dir ckpt --log-dir runs).
# Tested here on CPU with gloo (tests/swarm/test_cluster.py); not yet run on GPUs.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec torchrun --standalone --nproc-per-node "${GPUS:-8}" -m p2p_diloco join \
  --config "${CONFIG:-$here/configs/llama-1b-c4.toml}" --set train.device=cuda \
  --host-maddrs "/ip4/0.0.0.0/tcp/${PORT:-31338}" "$@"
