"""Ctrl-C in the command line's long builds (``python -m jaxmamba plan``, ``serve-prefill``): the first one ends the
process at once, whichever thread sees it, and a subprocess's build gets it passed on."""

from __future__ import annotations

import sys
import threading

_EXITING = threading.Lock()  # taken by the first thread that ends the process after a Ctrl-C


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def exit_at_sigint_from_any_thread(progress):
    """Make the first Ctrl-C end the process even when the main thread does not run Python's handler.

    Python raises ``KeyboardInterrupt`` only when the main thread next runs bytecode, and one raised inside a
    finaliser or a C++ callback is swallowed: on a loaded machine a Ctrl-C during the build was lost that way
    (the plan compiled on for minutes). The interpreter also writes each signal's number to a wake-up pipe
    the moment it arrives; a daemon thread blocked on that pipe exits at once. Returns the function that puts
    the previous wake-up descriptor back and ends the watcher (``plan`` called in-process, e.g. from a test)."""
    import os
    import signal

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch() -> None:
        while data := os.read(read_end, 64):  # b"": the write end was closed (stop)
            if signal.SIGINT in data:
                # The progress bar is left alone: the main thread may hold its lock.
                exit_interrupted(None)
        os.close(read_end)

    def stop() -> None:
        signal.set_wakeup_fd(previous)
        os.close(write_end)

    threading.Thread(target=watch, name="jaxmamba-sigint-watch", daemon=True).start()
    return stop


def exit_interrupted(progress=None) -> None:
    """End the process at once with status 130 after a Ctrl-C during compilation. Compiles already inside XLA
    run on their threads until they finish (minutes for a GPU target) and cannot be stopped; leaving without
    joining them, and without tearing the interpreter down under them, is what makes the first Ctrl-C stop
    the plan promptly (it crashed with SIGSEGV on the way out before)."""
    import os
    import signal

    if not _EXITING.acquire(blocking=False):  # the other thread that saw the Ctrl-C is already ending the process
        threading.Event().wait()
    if on_main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit itself
    if progress is not None:
        progress.close()
    print("\ninterrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def run_forwarding_sigint(command: list[str], env: dict) -> int:
    """Run ``command`` and return its status; a Ctrl-C here is passed on to it (a terminal's reaches both
    processes, a signal sent to this one alone would not) and its exit is awaited: 130 if it was interrupted."""
    import signal
    import subprocess

    proc = subprocess.Popen(command, env=env)
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
    return 130 if rc == -signal.SIGINT else rc
