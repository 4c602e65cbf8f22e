#!/usr/bin/env bash
# Install p2p-diloco and everything it needs into ./.venv, with the exact versions it is tested with.
# Works offline except for the package registry; torch 2.13.0 is the CPU build (pinned: an unpinned torch
# would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q -c constraints.txt -e '.[test,bench,plot,tensorboard,wandb]'
echo "installed: $(.venv/bin/p2p-diloco --help >/dev/null && echo .venv/bin/p2p-diloco)"
