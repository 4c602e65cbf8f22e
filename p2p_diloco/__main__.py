"""``python -m p2p_diloco`` == ``p2p-diloco`` (also what ``torchrun -m p2p_diloco`` will run)."""

import sys

from .cli import main

sys.exit(main())
