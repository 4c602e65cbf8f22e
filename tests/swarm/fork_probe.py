"""A process for tests/swarm/test_zygote.py: prints what it runs with (one JSON line), then does what its arguments
say: ``fork`` leaves a child behind, ``hold-lock``/``take-lock`` use hivemind's process-shared lock, ``sleep``
waits to be killed, a number is its exit code."""

import json
import os
import sys
import time

from hivemind.utils.mpfuture import MPFuture


def main(args: list[str]) -> int:
    info = {"cwd": os.getcwd(), "tag": os.environ.get("P2P_DILOCO_TEST_TAG"), "pid": os.getpid(),
            "sid": os.getsid(0), "argv": sys.argv[1:], "netns": os.readlink("/proc/self/ns/net")}
    if "hold-lock" in args:
        info["held"] = MPFuture._update_lock.acquire(timeout=2)
    if "take-lock" in args:
        info["took"] = MPFuture._update_lock.acquire(timeout=2)
    if "fork" in args and os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    print(json.dumps(info), flush=True)
    if "sleep" in args:
        time.sleep(120)
    return int(args[0]) if args and args[0].isdigit() else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
