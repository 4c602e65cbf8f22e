#!/usr/bin/env bash
# A bootstrap node: a DHT-only entry point (no training) with a stable peer id, for a public or private swarm.
#   peers/bootstrap.sh                                   # listens on every interface, port 31337
#   PORT=4001 PUBLIC_IP=203.0.113.7 peers/bootstrap.sh   # behind port forwarding: advertise the public address
# It prints the `p2p-diloco join --initial-peers ...` line to hand to peers. The identity file (bootstrap.key by
# default) keeps the peer id, and so that line, the same across restarts: keep it private and backed up.
set -euo pipefail
port="${PORT:-31337}"
args=(--host-maddrs "/ip4/0.0.0.0/tcp/$port" --identity-path "${IDENTITY:-bootstrap.key}")
if [[ -n "${PUBLIC_IP:-}" ]]; then
  args+=(--announce-maddrs "/ip4/$PUBLIC_IP/tcp/$port")
fi
exec p2p-diloco bootstrap "${args[@]}" "$@"
