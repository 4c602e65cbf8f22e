#!/usr/bin/env bash
# Issue 22's GPU check, sized for its 8 minutes on one GPU (not yet timed on one); nothing downloaded (byte
# tokenizer, built-in corpus).
#
#   scripts/gpu-check.sh         on a CUDA machine: a ~150M-parameter Llama (12 x 1024, bf16 autocast)
#   scripts/gpu-check.sh --cpu   the same steps on this CPU with the tiny model and a nominal peak of 0.3 TFLOP/s
#                                (about 2 AVX-512 cores' fp32 peak, not measured: a dry run of the script)
#
# 1. the bare loop (transformers + fused AdamW, bf16) against a lone peer's inner loop on the same model, batch and
#    device: tokens/s and MFU (benchmarks/inner.py, one pair; no memory pair: it would take a third of the budget);
# 2. a 2-peer swarm sharing the one GPU, 2 rounds: both peers must end with one digest.
# (A 1-rank torchrun peer is the plain peer: local/cluster.py starts local ranks only for WORLD_SIZE > 1, and
# NCCL cannot put two ranks on one GPU; FSDP2 is covered on CPU by tests/swarm/test_cluster.py.)
#
# Last line: mfu_peer=<x> mfu_bare=<y> peer_over_bare=<z> (goal: z >= 0.97). Exit status 1 if a step failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-$(mktemp -d)}
if [ "${1:-}" = "--cpu" ]; then
  SETS=(--set train.device=cpu --set train.peak_tflops=0.3)
  THREADS=2 ROUNDS=3 H=10
else
  SETS=(--set train.device=cuda --set model.num_layers=12 --set model.hidden_size=1024 --set model.num_heads=16
        --set model.num_kv_heads=16 --set model.intermediate_size=2816 --set model.max_seq_len=1024
        --set data.seq_len=1024 --set data.batch_size=8)
  THREADS=8 ROUNDS=4 H=20
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
fi
echo "== 1. bare loop against a lone peer (benchmarks/inner.py)"
"$PY" -m benchmarks.inner --pairs 1 --memory-pairs 0 --rounds "$ROUNDS" --inner-steps "$H" --threads "$THREADS" "${SETS[@]}" \
  | tee "$OUT/inner.txt"
echo "== 2. two peers sharing the device, 2 rounds"
"$PY" -m p2p_diloco swarm --peers 2 --max-rounds 2 --inner-steps "$H" --run-id gpu-check \
  --log-dir "$OUT/swarm" --summary-json "$OUT/swarm.json" --set eval.batches=2 --set "train.threads=$THREADS" \
  "${SETS[@]}" | tail -5
"$PY" - "$OUT/swarm.json" "$OUT/inner.txt" <<'PY'
import json, sys
swarm = json.load(open(sys.argv[1]))
digests = {p["global_digest"] for p in swarm["peers"]}
print(f"2-peer swarm: {len(swarm['peers'])} peers, rounds {[p['rounds_completed'] for p in swarm['peers']]}, "
      f"one digest: {'yes' if swarm['all_digests_equal'] and len(digests) == 1 else 'NO'}")
values = dict(kv.split("=") for line in open(sys.argv[2]) for kv in line.split() if "=" in kv)
peer, bare = float(values["mfu_peer"]), float(values["mfu_bare"])
print(f"mfu_peer={peer:.4f} mfu_bare={bare:.4f} peer_over_bare={peer / bare:.3f}")
sys.exit(0 if swarm["all_digests_equal"] and len(digests) == 1 else 1)
PY
