"""HostProfile's accounting: the phases plus ``other`` make up the whole engine step, on the engine thread."""

import time

import pytest

from jaxmamba.host_profile import HOST_PHASES, PHASES, HostProfile, maybe_phase, maybe_step


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU (not sleep: CPU time is what the profile's figures count)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_step_s_time_outside_its_phases_is_counted_as_other():
    prof = HostProfile()
    for _ in range(2):
        with maybe_step(prof):
            _burn(0.02)  # outside every phase: the loop's own bookkeeping
            with maybe_phase(prof, "schedule"):
                _burn(0.03)
            with maybe_phase(prof, "wait"):
                time.sleep(0.02)  # waiting: wall time, next to no CPU
            _burn(0.01)
    prof.num_steps = 2
    assert prof.cpu_seconds["schedule"] == pytest.approx(0.06, abs=0.01)
    assert prof.cpu_seconds["other"] == pytest.approx(0.06, abs=0.01)
    assert prof.seconds["other"] >= prof.cpu_seconds["other"] - 1e-3
    assert prof.seconds["wait"] >= 0.04 and prof.cpu_seconds["wait"] < 0.01
    summary = prof.summary()
    # Host CPU counts the unphased part too; the wait (device time the host did not hide) stays out of it.
    assert summary["other_cpu_ms_per_step"] == pytest.approx(30, abs=5)
    assert 1e3 * prof.host_cpu_seconds == pytest.approx(120, abs=15)
    assert "other" in HOST_PHASES and "other" in PHASES and "wait" not in HOST_PHASES


def test_phases_outside_a_step_are_not_taken_from_other():
    """Only the phases entered inside a step come off its ``other`` (detokenize runs after EngineCore.step)."""
    prof = HostProfile()
    with maybe_phase(prof, "detokenize"):
        _burn(0.02)
    with maybe_step(prof):
        _burn(0.02)
    assert prof.cpu_seconds["other"] == pytest.approx(0.02, abs=0.006)
    assert prof.cpu_seconds["detokenize"] == pytest.approx(0.02, abs=0.006)


def test_profiling_off_costs_no_profile():
    with maybe_step(None), maybe_phase(None, "schedule"):
        pass


def test_a_profile_without_device_time_starts_no_watcher_and_reports_none():
    """``device_time=False`` (bench host-path): no watcher thread, whose wake-ups at each step would take the GIL
    from the engine thread it measures; the device figures read None, the host's are counted as before."""
    import threading

    import numpy as np

    prof = HostProfile(device_time=False)
    before = {t.ident for t in threading.enumerate()}
    prof.track_device(np.zeros(3), time.perf_counter())
    assert {t.ident for t in threading.enumerate()} == before and prof._pending is None
    with maybe_step(prof), maybe_phase(prof, "record"):
        _burn(0.01)
    prof.num_steps = prof.num_output_tokens = 1
    summary = prof.summary()
    assert summary["device_ms_per_step"] is None and summary["hidden_share"] is None
    assert summary["record_cpu_ms_per_step"] == pytest.approx(10, abs=4)
    # The default still watches each tracked step's outputs.
    watched = HostProfile()
    watched.track_device(np.zeros(3), time.perf_counter())
    watched.settle()
    assert watched._pending is not None and watched.summary()["device_ms_per_step"] >= 0
