"""Start-up without a swarm: stop signals and exit codes, SIGINT in forked children, hivemind's step-failure records,
the unreachable-peer message, orphaned p2pd processes, the checkpoint directory check, unreadable checkpoints."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from p2p_diloco.checkpoint import CheckpointError, CheckpointStore
from p2p_diloco.runtime.signals import Interrupted, StopSignals, children_ignore_sigint, interrupted_exit_code

pytestmark = pytest.mark.unit


@pytest.fixture
def restore_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook  # StopSignals.install() sets its own
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    sys.unraisablehook = hook


def test_during_start_up_the_first_signal_aborts_at_once():
    signals = StopSignals()
    with pytest.raises(Interrupted) as excinfo:
        signals._handle(signal.SIGTERM, None)
    assert excinfo.value.signum == signal.SIGTERM and isinstance(excinfo.value, KeyboardInterrupt)
    assert signals.exit_code == 143 and not signals.stop.is_set()
    signals._handle(signal.SIGINT, None)  # Ctrl-C again while the cleanup runs: ignored, the cleanup finishes
    assert signals.exit_code == 143


def test_once_running_the_first_signal_asks_to_stop_and_the_second_interrupts():
    stop = threading.Event()
    signals = StopSignals(stop)
    signals.running()
    signals._handle(signal.SIGINT, None)
    assert stop.is_set() and signals.exit_code == 130
    with pytest.raises(Interrupted) as excinfo:
        signals._handle(signal.SIGTERM, None)
    assert excinfo.value.signum == signal.SIGINT  # the exit code stays the first signal's
    signals._handle(signal.SIGINT, None)  # a third: the cleanup is running, ignored
    assert StopSignals().exit_code == 0 and interrupted_exit_code(signal.SIGTERM) == 143


def test_a_real_signal_reaches_the_installed_handler(restore_handlers):
    StopSignals().install()
    with pytest.raises(Interrupted):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.1)  # a blocking call the signal interrupts (Python runs the handler after it)


def test_an_interrupt_that_lands_in_a_callback_is_not_lost(restore_handlers):
    """A signal handled while Python runs a weakref callback (importlib's module locks use one: seen in a CI run,
    3 s into a peer's imports) raised Interrupted where Python can only print it and drop it: the peer trained on,
    deaf to later signals. It is raised again in the main thread's next bytecode."""
    import weakref

    signals = StopSignals().install()

    class Lock:
        pass

    lock = Lock()
    ref = weakref.ref(lock, lambda _: signal.raise_signal(signal.SIGTERM))  # handled inside the callback
    unraisable = []
    sys_hook, sys.unraisablehook = sys.unraisablehook, lambda u: (unraisable.append(u), sys_hook(u))
    try:
        with pytest.raises(Interrupted) as excinfo:
            del lock
            time.sleep(5)  # the interrupt comes again within milliseconds, out of the callback
    finally:
        sys.unraisablehook = sys_hook
    assert ref() is None and excinfo.value.signum == signal.SIGTERM and signals.exit_code == 143
    assert unraisable and isinstance(unraisable[0].exc_value, Interrupted)  # it did land in the callback first


def test_forks_inside_the_block_ignore_sigint_and_ours_is_back_after(restore_handlers):
    StopSignals().install()
    ours = signal.getsignal(signal.SIGINT)
    with children_ignore_sigint():
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if SIGINT is ignored here
            os._exit(0 if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert signal.getsignal(signal.SIGINT) == ours


def test_hivemind_step_failure_records_are_dropped_and_others_kept():
    from p2p_diloco.swarm.exact_averager import quiet_step_failures

    quiet_step_failures()
    quiet_step_failures()  # idempotent
    logger = logging.getLogger("hivemind.averaging.averager")
    assert len([f for f in logger.filters if type(f).__name__ == "_StepFailuresAreTheHosts"]) == 1

    def record(level, func):
        return logger.makeRecord(logger.name, level, __file__, 1, "Averaging step failed: could not find a group",
                                 (), None, func=func)

    assert not logger.filter(record(logging.ERROR, "_step"))  # the host reports it (allreduce_failed event)
    assert logger.filter(record(logging.WARNING, "_step"))
    assert logger.filter(record(logging.ERROR, "_load_state_from_peers"))


def test_an_unreachable_initial_peer_is_named_with_what_to_check():
    from p2p_diloco.swarm.starting import start_failure

    peer = "/ip4/10.1.2.3/tcp/4000/p2p/12D3KooWAJ6LLP9vy8TfHi4hdDVvYT81fFM7YibrdRCRvaUyi1X8"
    text = start_failure(RuntimeError("Daemon failed to start: failed to connect to bootstrap peers"), [peer],
                         "could not start or join the swarm")
    assert text.startswith("could not start or join the swarm: no initial peer answered") and peer in text
    assert "firewall" in text and "/p2p/ id" in text and "\n" not in text
    other = start_failure(RuntimeError("Daemon failed to start in 30.0 seconds"), [peer], "could not start")
    assert other == "could not start: Daemon failed to start in 30.0 seconds"


def test_a_dht_that_failed_to_start_ends_by_itself_and_the_next_start_is_not_blocked():
    """A DHT process that reported its failure is let end before anything is reaped: killed right after its report,
    it could still hold hivemind's lock for reports (MPFuture._update_lock, shared by every process forked from ours),
    and the next DHT process (``swarm.initial_peers_wait`` tries again) blocked on it for good."""
    script = textwrap.dedent("""
        import multiprocessing
        import hivemind
        from p2p_diloco.swarm import starting
        alive_at_reap = []
        real_reap = starting.reap_children
        def spy(*args, **kwargs):
            alive_at_reap.append([c.pid for c in multiprocessing.active_children() if isinstance(c, hivemind.DHT)])
            real_reap(*args, **kwargs)
        starting.reap_children = spy
        nobody = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWAJ6LLP9vy8TfHi4hdDVvYT81fFM7YibrdRCRvaUyi1X8"
        for _ in range(3):
            try:
                starting.start_dht(initial_peers=[nobody], host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=20)
            except Exception as e:
                assert "bootstrap peers" in str(e), e
        assert alive_at_reap == [[], [], []], alive_at_reap
        dht = starting.start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=20)
        dht.shutdown()
        print("started")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and "started" in r.stdout, r.stderr[-3000:]


def test_a_p2pd_orphaned_by_its_killed_parent_is_still_reaped():
    """The p2pd of a DHT process killed mid-start is re-parented to us (adopt_orphans), and reaped."""
    script = textwrap.dedent("""
        import os, signal, subprocess, sys, time
        import psutil
        from p2p_diloco.runtime.processes import adopt_orphans, reap_children
        assert adopt_orphans()
        parent = subprocess.Popen([sys.executable, "-c",
            "import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); "
            "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
        grandchild = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        time.sleep(0.2)
        assert psutil.Process(grandchild).ppid() == os.getpid()
        reap_children(timeout=5.0)
        assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
        print("reaped")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "reaped" in r.stdout, r.stderr


def test_the_checkpoint_directory_is_created_or_refused_in_one_line(tmp_path):
    store = CheckpointStore(tmp_path / "new" / "ckpt")
    store.check_usable()
    assert store.directory.is_dir() and list(store.directory.iterdir()) == []  # the probe file is gone
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for path, needle in [(a_file, "is a file, not a directory"), (a_file / "sub", "Not a directory"),
                         ("/sys", "not usable")]:  # /sys: unwritable even for root
        with pytest.raises(CheckpointError) as excinfo:
            CheckpointStore(path).check_usable()
        assert needle in str(excinfo.value) and str(path) in str(excinfo.value) and "\n" not in str(excinfo.value)


@pytest.mark.parametrize("damage, needle", [
    (lambda data: b"\xe8" + os.urandom(len(data)), "not a p2p-diloco checkpoint"),
    (lambda data: data[: len(data) // 2], "truncated or corrupt"),
    (lambda data: b"", "the file is empty"),
])
def test_a_garbage_or_truncated_checkpoint_is_one_line_naming_the_file(tmp_path, damage, needle):
    from tests.unit.test_checkpoint import make_state

    path = CheckpointStore(tmp_path).save(make_state(round_=1))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError) as excinfo:
        CheckpointStore(tmp_path).load(path)
    message = str(excinfo.value)
    assert message == f"cannot read checkpoint {path}: {message.split(': ', 1)[1]}" and needle in message, message
    assert "\n" not in message and "weights_only" not in message and "invalid load key" not in message


def test_a_checkpoint_that_kept_no_config_asks_for_the_runs_config(tmp_path):
    from p2p_diloco.config import ConfigError
    from p2p_diloco.export import load_trained
    from tests.unit.test_export import _save_run

    path, _ = _save_run(tmp_path, num_layers=1, hidden_size=64)
    store = CheckpointStore(tmp_path)
    state = store.load(path)
    state.extra.pop("config")  # an old checkpoint: the run's config was not kept
    store.save(state)
    with pytest.raises(ConfigError, match="keeps no config of its run: pass that run's --config"):
        load_trained(path)
