"""The demo's chaos proxy runs in a process of its own (retrysafe.demo._proxy.ProxyProcess):
its control lines, its end with the demo however the demo ends, and a proxy that dies
mid-run."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from retrysafe import ConfigurationError, RetrysafeError
from retrysafe._serving import stop_processes
from retrysafe.chaos import FaultRates
from retrysafe.demo import DemoOptions, Progress, run_demo
from retrysafe.demo._proxy import ProxyProcess

from .test_service_process import _gone, _proxy_children, _service


def test_the_control_lines_change_the_rates_heal_and_count(tmp_path: Path) -> None:
    """Requests through the child are counted in its stats; rates it refuses leave the old
    ones in force; heal stops the faults; stop ends the child."""
    with _service(tmp_path) as service:
        proxy = ProxyProcess(
            service.url, rates=FaultRates(error_before_forward=1.0), seed=1, log=tmp_path / "p"
        )
        with proxy:
            assert proxy.proc is not None and proxy.proc.pid != os.getpid()
            url = proxy.url + "/posts"
            assert httpx.post(url, json={"operation": "a"}, timeout=10).status_code == 503
            # Rates this side would refuse too, sent as the line: the child refuses them.
            bad = {"error_before_forward": 0.9, "error_after_commit": 0.6}
            with pytest.raises(RetrysafeError, match=r"refused rates: .*sum to 1\.5"):
                proxy._ask({"op": "rates", "rates": bad})
            with pytest.raises(RetrysafeError, match=r"refused rates: .*unexpected keyword"):
                proxy._ask({"op": "rates", "rates": {"nonsense": 1}})
            with pytest.raises(RetrysafeError, match="refused explode: unknown command"):
                proxy._ask({"op": "explode"})
            assert httpx.post(url, json={"operation": "b"}, timeout=10).status_code == 503
            proxy.heal()
            assert httpx.post(url, json={"operation": "c"}, timeout=10).status_code == 201
            proxy.set_rates(FaultRates(error_before_forward=1.0))
            assert httpx.post(url, json={"operation": "d"}, timeout=10).status_code == 503
            stats = proxy.stats()
            assert stats["requests"] == 4
            assert stats["faults"]["error_before_forward"] == 3
            pid = proxy.proc.pid
        assert _gone(pid, 0.1)
        proxy.stop()  # idempotent


def test_a_proxy_that_cannot_start_names_its_last_output(tmp_path: Path) -> None:
    """A child that exits before it listens (an upstream that is no URL of http(s)) is a
    ConfigurationError quoting its last line; nothing is left running."""
    proxy = ProxyProcess("ftp://example.com", rates=FaultRates(), seed=1, log=tmp_path / "p")
    with pytest.raises(ConfigurationError, match=r"chaos proxy exited .*: .*ftp"):
        proxy.start()
    assert proxy.proc is not None and proxy.proc.poll() is not None


def test_commands_to_a_dead_proxy_say_so(tmp_path: Path) -> None:
    """The child killed: a command raises a RetrysafeError naming the signal, not a broken
    pipe or a hang."""
    with _service(tmp_path) as service, ProxyProcess(service.url, rates=FaultRates(), seed=1) as p:
        assert p.proc is not None
        p.proc.send_signal(signal.SIGKILL)
        p.proc.wait()
        with pytest.raises(RetrysafeError, match=r"chaos proxy exited \(signal 9\)"):
            p.heal()


def test_stop_processes_kills_the_proxy_too(tmp_path: Path) -> None:
    """The forced exit's clean-up reaches the proxy process as well."""
    with _service(tmp_path) as service:
        proxy = ProxyProcess(service.url, rates=FaultRates(), seed=1).start()
        assert proxy.proc is not None
        stop_processes()
        assert proxy.proc.poll() is not None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_proxy_that_dies_mid_run_ends_the_demo_at_once(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The proxy process killed during the naive pass: the demo fails within seconds, naming
    it and the signal, and leaves no proxy behind."""

    class KillOnStart(Progress):
        def start(self, phase: str, total: int) -> None:
            for pid in _proxy_children(os.getpid()):
                os.kill(pid, sig)

    options = DemoOptions(jobs=2000, loss_rate=0.0, concurrency=8, timeout=5.0)
    started = time.monotonic()
    with pytest.raises(RetrysafeError, match=rf"chaos proxy exited \(signal {int(sig)}\)"):
        run_demo(options, KillOnStart(), workdir=tmp_path)
    assert time.monotonic() - started < 10
    assert _proxy_children(os.getpid()) == []


def test_every_pass_runs_through_the_proxy_process(tmp_path: Path) -> None:
    """The report's fault counts are the child's: both passes' requests, counted there."""
    result = run_demo(DemoOptions(jobs=30, loss_rate=0.2, seed=3, concurrency=4, timeout=1.0))
    assert result.naive is not None
    assert result.faults["requests"] >= 60
    assert result.faults["faults"]["lose_after_commit"] > 0
    assert result.protected.report.duplicates == 0
