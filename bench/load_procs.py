"""The processes bench/load.py measures: /proc readings, the emulated backends, the proxy.

Three kinds of process, so none steals the others' measurements: emulated
backends (``python -m lowproxy.demo``), the proxy under test (a fresh process
per scenario, configured through PD_PROXY_* only) and the load client.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time

from common import ROOT, free_port

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (a --workers parent measures its workers too)."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        parents.setdefault(ppid, []).append(int(name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, ()))
    return tree


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of pid and its descendants, in seconds."""
    user = system = 0
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        user += int(fields[11])  # utime (field 14)
        system += int(fields[12])  # stime (field 15)
    return user / CLOCK_TICKS, system / CLOCK_TICKS


def _run_ns(pid: int) -> int | None:
    """Nanoseconds on CPU of pid's live threads (/proc/<pid>/task/*/schedstat, field 1)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0  # gone: it costs nothing any more
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            continue  # a thread that just ended
        except (OSError, ValueError, IndexError):
            return None  # no schedstat in this kernel
    return total


def cpu_sample(pid: int) -> tuple[float, float, float | None]:
    """(utime, stime, exact on-CPU time) of pid and its descendants, in seconds.

    utime and stime count in clock ticks (10 ms at 100 Hz), too coarse for a short
    run; the scheduler's nanosecond figure gives the total, the ticks only the split.
    """
    user, system = cpu_times(pid)
    exact = 0
    for member in process_tree(pid):
        ns = _run_ns(member)
        if ns is None:
            return user, system, None
        exact += ns
    return user, system, exact / 1e9


def cpu_delta(before: tuple[float, float, float | None],
              after: tuple[float, float, float | None]) -> tuple[float, float]:
    """(user, system) seconds spent between two samples."""
    user, system = after[0] - before[0], after[1] - before[1]
    if before[2] is None or after[2] is None:
        return user, system
    total = max(0.0, after[2] - before[2])
    share = system / (user + system) if user + system > 0 else 0.0
    return total * (1 - share), total * share


def memory_kb(pid: int, key: str) -> int:
    """A /proc/<pid>/status figure (VmRSS, VmHWM) summed over the tree, in KiB."""
    total = 0
    prefix = key.encode() + b":"
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/status", "rb") as f:
                for line in f:
                    if line.startswith(prefix):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; children (proxy, backends) inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_PROXY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


class Backends:
    """``python -m lowproxy.demo`` in its own process."""

    def __init__(self, stream_chunks: int, chunk_delay: float, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lowproxy.demo", "--stream-chunks", str(stream_chunks),
             "--chunk-delay", str(chunk_delay), *extra],
            env=child_env({}), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"lowproxy.demo exited {self.proc.wait()} before it listened")
        info = json.loads(line)
        self.prefill_url: str = info["prefill"]
        self.decode_url: str = info["decode"]
        self.bootstrap_port: int = info["bootstrap_port"]
        self.decode_port = int(self.decode_url.rsplit(":", 1)[1])
        self.prefill_port = int(self.prefill_url.rsplit(":", 1)[1])
        self.pid = self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ProxyProcess:
    """The proxy under test, configured through PD_PROXY_* only."""

    def __init__(self, command: list[str], backends: Backends, kv_protocol: str,
                 loop: str, extra_env: dict[str, str], port: int = 0) -> None:
        self.port = port or free_port()
        env = child_env({
            "PD_PROXY_HOST": "127.0.0.1",
            "PD_PROXY_PORT": str(self.port),
            "PD_PROXY_PREFILL_URL": backends.prefill_url,
            "PD_PROXY_DECODE_URL": backends.decode_url,
            "PD_PROXY_KV_PROTOCOL": kv_protocol,
            "PD_PROXY_MOONCAKE_BOOTSTRAP_PORT": str(backends.bootstrap_port),
            "PD_PROXY_LOOP": loop,
            "PD_PROXY_DRAIN_SECONDS": "5",
        })
        env.update(extra_env)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(command, env=env, stdout=self.log, stderr=self.log,
                                     cwd=ROOT)
        self.pid = self.proc.pid
        self._wait_accepting(30.0)

    def _wait_accepting(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited {self.proc.returncode}:\n{self.output()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"proxy did not accept on port {self.port}:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self) -> int:
        tree = process_tree(self.pid)[1:]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # A wrapper command (a profiler) may exit without stopping the proxy it started.
        for pid in tree:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.log.close()
        return self.proc.returncode
