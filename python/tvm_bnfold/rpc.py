"""Measure MetaSchedule candidates on a fleet of machines through TVM's RPC tracker.

    runner = rpc.make_runner("10.0.0.5:9190", "avx2-box")   # ms.runner.RPCRunner
    with rpc.LocalFleet(n_servers=2) as fleet:               # loopback tracker + servers
        runner = rpc.make_runner(fleet.tracker, fleet.key)

Fleet machines run ``python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY``; the tracker is
``python -m tvm.exec.rpc_tracker``. The runner opens one session per candidate (upload, random
inputs, time) and keeps ``max_workers`` sessions in flight (default: one per registered server).

What happens when a server dies (TVM 0.27, checked by tests/test_rpc.py):

- Killed while measuring: the client's session socket is reset, the candidate's RunnerResult
  carries ``RPCRunner: An exception occurred ...`` and MetaSchedule commits it as a failed run
  (``run_secs`` = 1e10 s) - it is not retried on another server. Every other candidate goes on.
- Killed while idle: its tracker connection closes and the tracker drops it, so later requests
  go to the servers still registered. A request that races the kill and gets the dead address is
  retried by ``TrackerSession.request`` (5 tries).
- Hung (machine frozen, cable pulled, no TCP reset): TVM's own RPCRunner waits forever for the
  session. ``make_runner`` therefore bounds each measurement on the client (``timeout_s``); past
  it the worker is killed and the candidate becomes a failed run
  (``RPCRunner: Timeout, killed after ...``). ``session_timeout_s`` is the server-side limit.
- No server left: requests queue at the tracker until ``timeout_s``, then fail; the run finishes
  with failed records instead of hanging.

Records committed before a failure stay in the database: MetaSchedule commits a batch's records
as soon as the batch is measured and JSONDatabase appends them to its file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tvm.rpc import base
from tvm.s_tir import meta_schedule as ms
from tvm.support.popen_pool import PopenPoolExecutor

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
    _check_key(key)
    infos = tracker_summary(tracker, timeout_s)["server_info"]
    return sum(info.get("key") == f"server:{key}" for info in infos)


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
    n_servers = count_servers(tracker, key)
    if n_servers == 0:
        raise RPCFleetError(f"no RPC server registered under key {key!r} at {host}:{port}")
    if session_timeout_s <= 0 or (timeout_s is not None and timeout_s <= 0):
        raise RPCFleetError("RPC session_timeout_s and timeout_s must be positive")
    workers = max_workers or n_servers
    config = ms.runner.RPCConfig(
        tracker_host=host,
        tracker_port=port,
        tracker_key=key,
        session_timeout_sec=max(1, round(session_timeout_s)),
    )
    runner = ms.runner.RPCRunner(config, evaluator_config, max_workers=workers)
    # TVM 0.27's RPCRunner pool has no timeout: a hung server would block tuning forever.
    runner.pool.shutdown()
    runner.pool = PopenPoolExecutor(
        max_workers=workers,
        timeout=timeout_s if timeout_s is not None else 2 * session_timeout_s,
    )
    return runner


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalFleet:
    """A loopback RPC tracker and ``n_servers`` servers, each a subprocess in its own process group.

    Use as a context manager; ``tracker`` is ``"127.0.0.1:PORT"``, ``key`` the servers' key.
    ``kill(i)`` SIGKILLs server ``i`` (its forked session workers too); ``close()`` stops all.
    Logs go to ``log_dir`` (``tracker.log``, ``server0.log``, ...).
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
        with open(self.log_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )

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
        port = _free_port()
        self.tracker = f"127.0.0.1:{port}"
        self.tracker_proc = self._spawn(
            "tracker", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
            "--port", str(port), "--port-end", str(port + 1))

        def tracker_up() -> bool:
            try:
                tracker_summary(self.tracker, timeout_s=2.0)
                return True
            except RPCFleetError:
                return False

        self._wait(f"RPC tracker at {self.tracker}", tracker_up, [self.tracker_proc])
        for i in range(self.n_servers):
            self.add_server(name=f"server{i}", wait=False)
        self.wait_for_servers(self.n_servers)

    def add_server(self, name: str | None = None, wait: bool = True) -> subprocess.Popen:
        """Start one more server under ``key``; with ``wait``, return once it is registered."""
        before = len([p for p in self.servers if p.poll() is None])
        port = _free_port()
        proc = self._spawn(
            name or f"server{len(self.servers)}", "tvm.exec.rpc_server", "--host", "127.0.0.1",
            "--port", str(port), "--port-end", str(port + 1),
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
        for proc in [*self.servers, self.tracker_proc]:
            if proc is not None:
                _kill_group(proc, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal ``proc``'s process group (its own session, so only what it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    if sig == signal.SIGKILL:
        proc.wait()
