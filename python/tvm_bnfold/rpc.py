"""Measure MetaSchedule candidates on a fleet of machines through TVM's RPC tracker.

    runner = rpc.make_runner("10.0.0.5:9190", "avx2-box")   # ms.runner.RPCRunner
    with rpc.LocalFleet(n_servers=2) as fleet:               # loopback tracker + servers
        runner = rpc.make_runner(fleet.tracker, fleet.key)

Fleet machines run ``python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY``; the tracker is
``python -m tvm.exec.rpc_tracker``. The runner opens one session per candidate (upload, random
inputs, time) and keeps ``max_workers`` sessions in flight (default: one per registered server).

What happens when a server fails (TVM 0.27; tests/test_rpc.py checks the first four points, all
but the retry; the rest comes from TVM's code and runs by hand):

- Killed while measuring: the session's socket is reset, the candidate's RunnerResult is an error
  (``RPCRunner: An exception occurred ... kShutdown`` or ``Connection reset by peer``) and
  MetaSchedule commits it as a failed run (``run_secs`` 1e10). It is not retried elsewhere; the
  rest of the batch and later batches are measured by the servers still registered.
- Killed while idle: its tracker connection closes, the tracker drops it, later requests go to
  the others. A request that got its address before that fails to connect, and
  ``TrackerSession.request`` asks the tracker again (5 tries): measured elsewhere.
- Hung (machine frozen, cable pulled: no TCP reset): TVM's RPCRunner has no client-side limit (a
  SIGSTOPped server kept it waiting past 45 s with a 2 s session timeout). ``make_runner`` bounds
  each measurement (``timeout_s``, tracker queue wait included); past it the worker is killed
  and the candidate fails (``RPCRunner: Timeout, killed after <session timeout> seconds``).
- Every server gone: requests queue at the tracker and fail after ``timeout_s`` each, so the run
  ends with failed records instead of hanging.
- A session longer than ``session_timeout_s`` is ended by the server and the candidate fails
  (``RPCSessionTimeoutError``): keep it above upload + the longest kernel's measurement.
- Seen once, after a kill during session setup: a session on a surviving server stayed open
  after its measurement until the server's session timeout, idling that server that long.

Nothing committed is lost: MetaSchedule commits each batch's records once the batch is measured
and JSONDatabase appends them to its file; a failing server costs only the candidates in flight
on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from tvm.rpc import base
from tvm.s_tir import meta_schedule as ms

from .errors import BNFoldError


class RPCFleetError(BNFoldError):
    """The tracker address is malformed, the tracker unreachable, or no server has the key."""


def parse_tracker(tracker: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; ``"[::1]:9190"`` for IPv6 hosts."""
    if not isinstance(tracker, str) or ":" not in tracker:
        raise RPCFleetError(f"RPC tracker address {tracker!r} is not of the form HOST:PORT")
    host, _, port_text = tracker.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or any(c.isspace() for c in host):
        raise RPCFleetError(f"RPC tracker address {tracker!r} has no valid host")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RPCFleetError(
            f"RPC tracker address {tracker!r}: port {port_text!r} is not in 1..65535")
    return host, int(port_text)


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key or any(c.isspace() or c == ":" for c in key):
        raise RPCFleetError(f"RPC key {key!r} must be a non-empty string without spaces or ':'")
    return key


def tracker_summary(tracker: str, timeout_s: float = 5.0) -> dict:
    """The tracker's summary (``server_info``, ``queue_info``), read with a bounded wait."""
    host, port = parse_tracker(tracker)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            magic = struct.unpack("<i", base.recvall(sock, 4))[0]
            if magic != base.RPC_TRACKER_MAGIC:
                raise RPCFleetError(f"{host}:{port} answered, but it is not a TVM RPC tracker")
            base.sendjson(sock, [base.TrackerCode.SUMMARY])
            code, summary = base.recvjson(sock)
    except (OSError, RuntimeError, struct.error) as err:
        raise RPCFleetError(f"no RPC tracker reachable at {host}:{port}: {err}") from err
    if code != base.TrackerCode.SUCCESS:
        raise RPCFleetError(f"RPC tracker at {host}:{port} refused the summary request")
    return summary


def count_servers(tracker: str, key: str, timeout_s: float = 5.0) -> int:
    """How many servers are registered at ``tracker`` under ``key`` (busy ones included)."""
    return _server_keys(tracker, timeout_s).count(_check_key(key))


def _server_keys(tracker: str, timeout_s: float = 5.0) -> list[str]:
    infos = tracker_summary(tracker, timeout_s)["server_info"]
    return [info["key"].removeprefix("server:") for info in infos if "key" in info]


def make_runner(
    tracker: str,
    key: str,
    *,
    session_timeout_s: float = 30.0,
    timeout_s: float | None = None,
    max_workers: int | None = None,
    evaluator_config: ms.runner.EvaluatorConfig | None = None,
) -> ms.runner.RPCRunner:
    """An RPCRunner measuring on the servers registered at ``tracker`` (``"HOST:PORT"``) as ``key``.

    Checks first that the tracker answers and has at least one server for ``key``
    (RPCFleetError otherwise). ``session_timeout_s``: the server ends a session after this long.
    ``timeout_s``: the client gives up on one measurement (tracker queue wait included) after this
    long, default twice the session timeout. ``max_workers``: sessions in flight, default the
    number of servers registered now.
    """
    host, port = parse_tracker(tracker)
    _check_key(key)
    if session_timeout_s <= 0 or (timeout_s is not None and timeout_s <= 0):
        raise RPCFleetError("RPC session_timeout_s and timeout_s must be positive")
    if max_workers is not None and max_workers < 1:
        raise RPCFleetError(f"RPC max_workers must be >= 1, got {max_workers}")
    keys = _server_keys(tracker)
    if key not in keys:
        others = ", ".join(sorted(set(keys))) or "none"
        raise RPCFleetError(f"no RPC server registered under key {key!r} at {host}:{port} "
                            f"(keys registered there: {others})")
    workers = max_workers or keys.count(key)
    config = ms.runner.RPCConfig(
        tracker_host=host,
        tracker_port=port,
        tracker_key=key,
        session_timeout_sec=max(1, round(session_timeout_s)),
    )
    runner = ms.runner.RPCRunner(config, evaluator_config, max_workers=workers)
    # TVM 0.27's RPCRunner gives its pool no timeout, so a hung server would block tuning forever.
    # Set the pool's per-call limit (its worker, started by RPCRunner's check, is reused).
    runner.pool._timeout = timeout_s if timeout_s is not None else 2 * session_timeout_s
    return runner


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalFleet:
    """A loopback RPC tracker and ``n_servers`` servers, each a subprocess in its own process group.

    Use as a context manager; ``tracker`` is ``"127.0.0.1:PORT"``, ``key`` the servers' key.
    ``kill(i)`` SIGKILLs server ``i`` (its forked session workers too); ``close()``, or a normal
    interpreter exit, kills all (a SIGKILLed parent leaves them running). Logs go to ``log_dir``
    (``tracker.log``, ``server0.log``, ...; rewritten by each fleet).
    """

    def __init__(self, n_servers: int = 2, key: str = "bnfold-local",
                 log_dir: str | os.PathLike | None = None, start_timeout_s: float = 120.0):
        if n_servers < 1:
            raise RPCFleetError(f"LocalFleet needs at least one server, got {n_servers}")
        self.key = _check_key(key)
        self.n_servers = n_servers
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="bnfold-rpc-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = start_timeout_s
        self.tracker = ""
        self.tracker_proc: subprocess.Popen | None = None
        self.servers: list[subprocess.Popen] = []
        self._procs: list[subprocess.Popen] = []  # everything started, killed at close or exit
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    def __enter__(self) -> LocalFleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    def _wait(self, what: str, ready, procs: list[subprocess.Popen]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not ready():
            for proc in procs:
                if proc.poll() is not None:
                    raise RPCFleetError(f"{what}: a process exited with code {proc.returncode}; "
                                        f"see logs in {self.log_dir}")
            if time.monotonic() > deadline:
                raise RPCFleetError(f"{what}: not ready after {self.start_timeout_s:.0f} s; "
                                    f"see logs in {self.log_dir}")
            time.sleep(0.1)

    def start(self) -> None:
        """Start the tracker, then the servers; return once all servers are registered."""
        port = _free_port()  # a hint: the tracker takes the first free port from there
        self.tracker_proc = self._spawn(
            "tracker", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
            "--port", str(port), "--port-end", str(port + 100))

        def tracker_up() -> bool:
            bound = re.search(r"bind to 127\.0\.0\.1:(\d+)",
                              (self.log_dir / "tracker.log").read_text(errors="replace"))
            if not bound:
                return False
            self.tracker = f"127.0.0.1:{bound.group(1)}"
            try:  # it logs the port before it listens
                tracker_summary(self.tracker, timeout_s=2.0)
            except RPCFleetError:
                return False
            return True

        self._wait("RPC tracker", tracker_up, [self.tracker_proc])
        for _ in range(self.n_servers):
            self.add_server(wait=False)
        self.wait_for_servers(self.n_servers)

    def add_server(self, wait: bool = True) -> subprocess.Popen:
        """Start server ``len(servers)`` under ``key``; with ``wait``, return once registered."""
        before = sum(p.poll() is None for p in self.servers)
        port = _free_port()
        proc = self._spawn(
            f"server{len(self.servers)}", "tvm.exec.rpc_server", "--host", "127.0.0.1",
            "--port", str(port), "--port-end", str(port + 100),
            "--tracker", self.tracker, "--key", self.key)
        self.servers.append(proc)
        if wait:
            self.wait_for_servers(before + 1)
        return proc

    def wait_for_servers(self, n: int) -> None:
        """Block until exactly ``n`` servers are registered under ``key``."""
        live = [p for p in self.servers if p.poll() is None]
        self._wait(f"{n} RPC servers under key {self.key!r} at {self.tracker}",
                   lambda: count_servers(self.tracker, self.key) == n, live)

    def log(self, i: int) -> str:
        """Server ``i``'s log so far."""
        return (self.log_dir / f"server{i}.log").read_text(errors="replace")

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` and everything it forked."""
        _kill_group(self.servers[i], signal.SIGKILL)

    def close(self) -> None:
        """SIGKILL every process this fleet started (they hold no state worth a clean exit)."""
        self._finalizer()


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        _kill_group(proc, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal ``proc``'s process group (its own session, so only what it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    if sig == signal.SIGKILL:
        proc.wait()
