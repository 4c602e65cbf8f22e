"""Process-level settings of a peer."""

import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent("""
    import ctypes, sys
    from p2p_diloco.runtime.processes import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost")]

    if sys.argv[1] == "keep":
        assert keep_freed_memory() is True
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.mallinfo2.restype = MallInfo2
    block = libc.malloc(40_000_000)
    print(libc.mallinfo2().hblkhd >= 40_000_000)  # True: the block is its own mmap, unmapped again on free
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists only on Linux")
@pytest.mark.parametrize("mode, mmapped", [("default", "True"), ("keep", "False")])
def test_keep_freed_memory_serves_large_blocks_from_the_reusable_heap(mode, mmapped):
    # In a fresh interpreter: the setting is process-wide and must not leak into the test process.
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == mmapped


def test_reap_children_can_be_limited_to_the_processes_a_part_started():
    import subprocess
    import sys

    from p2p_diloco.runtime.processes import descendants, reap_children

    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # e.g. a W&B service
    try:
        assert {ours.pid, other.pid} <= descendants()
        reap_children(timeout=5.0, only={ours.pid})
        assert ours.wait(timeout=5) is not None
        assert other.poll() is None  # left alone
    finally:
        other.kill()
        other.wait()
