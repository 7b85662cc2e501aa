"""A real `ray start --head` cluster that a test owns, stops by process id, and checks is gone.

Other tests and other people run Ray on the same machine, so nothing here may touch a
cluster it did not start: no `ray stop` (it kills every Ray process of the user), no default
ports, no default temp dir (/tmp/ray, whose `ray_current_cluster` file `address="auto"`
reads).

How the cluster is isolated and stopped:

* `ray start --head --block` runs in its own session (``start_new_session=True``). Every Ray
  process it starts (gcs_server, raylet, dashboard, agents, the workers, which put themselves
  in their own process groups but keep the session) has that session id.
* Jobs are the exception: the job supervisor starts the entrypoint with
  ``start_new_session=True``. So at stop time the test also takes every descendant of the
  head process (walking /proc parent links), and a job's driver is one of them.
* Stop: SIGTERM to the head process (it shuts its node down, ~3 s when idle), then, after a
  grace period, SIGKILL to whatever of the session or of the descendants recorded is still
  alive, then check by /proc that none is left. Processes are identified by (pid, start time), so a reused pid is never hit.
* Ports: every port `ray start` opens is given explicitly: GCS, dashboard, client server,
  node manager, object manager, dashboard agent (http and grpc), runtime-env agent, metrics,
  and a worker port range outside the kernel's ephemeral range.
* A dedicated short --temp-dir (unix socket paths are limited to 107 bytes).
* Token auth on, with a token of its own passed by environment (RAY_AUTH_MODE=token,
  RAY_AUTH_TOKEN), so neither ~/.ray/auth_token nor anyone's settings matter. Clients (``ray
  job submit``) get the same two variables from :meth:`HeadNode.client_env`.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

VENV_BIN = os.path.dirname(sys.executable)
RAY_BIN = os.path.join(VENV_BIN, "ray")

# Variables that would point a client or the cluster at something else than ours.
_SCRUB = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN",
          "RAY_AUTH_MODE", "RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES",
          "RAY_RUNTIME_ENV_IGNORE_GITIGNORE")


# --- ports -----------------------------------------------------------------------------------

def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now (kernel-chosen)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port_range(size: int, low: int = 20000, high: int = 32000) -> tuple[int, int]:
    """A range of ``size`` free ports below the ephemeral range (32768+ here)."""
    for _ in range(200):
        start = random.randrange(low, high - size)
        if all(_bindable(p) for p in range(start, start + size)):
            return start, start + size - 1
    raise RuntimeError(f"no free range of {size} ports in {low}..{high}")


# --- processes -------------------------------------------------------------------------------

def _stat(pid: int):
    """(ppid, session id, start time) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = data[data.rindex(")") + 2:].split()
    state = fields[0]
    if state in ("Z", "X"):  # zombie / dead: nothing left to stop
        return None
    return int(fields[1]), int(fields[3]), int(fields[19])  # ppid, session, starttime


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class HeadNode:
    """One-node Ray cluster from `ray start --head --block`, owned and stopped by this object.

    Use as a context manager; ``stop()`` returns the processes that survived (none, unless
    something is wrong) and the ``with`` block fails if any did.
    """

    def __init__(self, num_cpus: int = 2, extra_env: dict | None = None,
                 start_timeout_s: float = 90.0, autoscaling_config: dict | None = None):
        self.num_cpus = num_cpus
        self.extra_env = dict(extra_env or {})
        # An autoscaler config with Ray's fake multi-node provider: the head runs the
        # autoscaler, which launches nodes (raylets on this machine) as demand asks.
        self.autoscaling_config = autoscaling_config
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.temp_dir: str | None = None
        self.log_path: str | None = None
        self.token = secrets.token_hex(24)
        self.ports: dict[str, int] = {}
        self._seen: dict[int, int] = {}  # pid -> start time of every process of ours seen

    # -- environment ---------------------------------------------------------------------------
    def _base_env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        # `python` in a job's entrypoint must be this venv's (the job inherits the cluster's
        # PATH), and so must the workers (they use the head process's sys.executable).
        env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = self.token
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        return env

    def client_env(self) -> dict:
        """Environment for a client of this cluster (``ray job submit`` and friends)."""
        return self._base_env()

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['dashboard']}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.ports['gcs']}"

    # -- start -----------------------------------------------------------------------------------
    def start(self) -> "HeadNode":
        last_error = None
        for _attempt in range(2):  # a port taken between choosing and binding: try new ones
            try:
                self._start_once()
                return self
            except RuntimeError as e:
                last_error = e
                self.stop()
                self.cleanup_files()
        raise last_error

    def _start_once(self) -> None:
        names = ("gcs", "dashboard", "client", "node_manager", "object_manager",
                 "agent_http", "agent_grpc", "runtime_env_agent", "metrics")
        self.ports = dict(zip(names, free_ports(len(names))))
        wmin, wmax = free_port_range(100)
        self.ports.update(worker_min=wmin, worker_max=wmax)
        self.temp_dir = tempfile.mkdtemp(prefix="rlt-", dir="/tmp")
        self.log_path = self.temp_dir + ".log"
        p = self.ports
        cmd = [RAY_BIN, "start", "--head", "--block", "--disable-usage-stats",
               f"--num-cpus={self.num_cpus}", f"--temp-dir={self.temp_dir}",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               f"--port={p['gcs']}", f"--dashboard-port={p['dashboard']}",
               f"--ray-client-server-port={p['client']}",
               f"--node-manager-port={p['node_manager']}",
               f"--object-manager-port={p['object_manager']}",
               f"--dashboard-agent-listen-port={p['agent_http']}",
               f"--dashboard-agent-grpc-port={p['agent_grpc']}",
               f"--runtime-env-agent-port={p['runtime_env_agent']}",
               f"--metrics-export-port={p['metrics']}",
               f"--min-worker-port={wmin}", f"--max-worker-port={wmax}"]
        env = self._base_env()
        env.update(self.extra_env)
        if self.autoscaling_config is not None:
            cmd.append(f"--autoscaling-config={self._write_autoscaling_config()}")
            env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=self.temp_dir)
        self._wait_ready()

    def _write_autoscaling_config(self) -> str:
        """The config with the provider pointed at this head's GCS (without it the fake
        nodes dial port 6379 and never join)."""
        import copy

        import yaml

        config = copy.deepcopy(self.autoscaling_config)
        config["provider"]["gcs_address"] = self.gcs_address
        path = os.path.join(self.temp_dir, "autoscaler.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        return path

    def _wait_ready(self) -> None:
        """Up when the dashboard answers an authenticated request and the node is alive."""
        deadline = time.time() + self.start_timeout_s
        req = urllib.request.Request(self.dashboard_url + "/nodes?view=summary",
                                     headers={"Authorization": f"Bearer {self.token}"})
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            self._remember()
            try:
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200 and b'"raylet"' in r.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"Ray head not ready in {self.start_timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except (OSError, TypeError):
            return "(no log)"

    def session_log_tail(self, pattern: str = "monitor.*", n: int = 60) -> str:
        """The tails of the cluster's own log files matching ``pattern`` (the autoscaler's
        monitor.log by default), for a failing test's message."""
        import glob

        out = []
        logs = os.path.join(self.temp_dir or "", "session_latest", "logs")
        for path in sorted(glob.glob(os.path.join(logs, pattern))):
            lines = Path(path).read_text(errors="replace").splitlines()[-n:]
            out.append(f"== {os.path.basename(path)}\n" + "\n".join(lines))
        return "\n".join(out) or f"(no {pattern} in {logs})"

    # -- processes ---------------------------------------------------------------------------------
    def _remember(self) -> dict[int, int]:
        """Record (and return) the live processes of this cluster: its session, and every
        descendant of the head process (a job's entrypoint has a session of its own)."""
        if self.proc is None:
            return {}
        root = self.proc.pid
        stats = {pid: st for pid in _all_pids() if (st := _stat(pid)) is not None}
        mine = {pid for pid, (_, sid, _) in stats.items() if sid == root}
        if root in stats:
            mine.add(root)
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        stack = list(mine)
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in mine:
                    mine.add(child)
                    stack.append(child)
        live = {pid: stats[pid][2] for pid in mine}
        self._seen.update(live)
        return live

    def alive(self) -> dict[int, str]:
        """Processes of this cluster still running: pid -> command line."""
        self._remember()
        out = {}
        for pid, start in self._seen.items():
            st = _stat(pid)
            if st is not None and st[2] == start:
                out[pid] = _cmdline(pid)
        return out

    def _signal_all(self, sig: int) -> None:
        for pid in self.alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # -- stop ------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 8.0) -> dict[int, str]:
        """Stop exactly this cluster; returns what survived (should be empty).

        SIGTERM to the head process first (it stops its node: ~3 s for an idle cluster).
        After a job that used Ray Data, the raylet waits ~30 s on Ray Data's helper actors
        before exiting; a test cluster holds nothing worth that wait, so whatever is still
        up after ``grace_s`` gets SIGKILL, by pid.
        """
        if self.proc is None:
            return {}
        self._remember()
        deadline = time.time() + grace_s
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        while self.alive() and time.time() < deadline:
            time.sleep(0.25)
        for _ in range(5):
            if not self.alive():
                break
            self._signal_all(signal.SIGKILL)
            time.sleep(0.5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        left = self.alive()
        self.proc = None
        return left

    def cleanup_files(self) -> None:
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self.log_path and os.path.exists(self.log_path):
            os.remove(self.log_path)

    def __enter__(self) -> "HeadNode":
        return self.start()

    def __exit__(self, *exc) -> None:
        left = self.stop()
        if not left:
            self.cleanup_files()
        if left and exc[0] is None:
            raise AssertionError(f"processes of the test cluster survived its stop: {left}")
