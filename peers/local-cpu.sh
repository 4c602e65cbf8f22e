#!/usr/bin/env bash
# A CPU laptop/desktop peer on the tiny default config.
#   new swarm:   peers/local-cpu.sh
#   join one:    P2P_DILOCO_INITIAL_PEERS=/ip4/.../tcp/.../p2p/... peers/local-cpu.sh
# Extra arguments go to `p2p-diloco join` (e.g. --max-rounds 10 --log-dir runs/me).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec p2p-diloco join --config "$here/configs/tiny.toml" "$@"
