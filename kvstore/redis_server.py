"""A local redis-server on a loopback port: the Redis tier `halfmoon serve`, the benchmarks
and the tests start when no Redis URL is given."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisServerError(RuntimeError):
    """redis-server is missing or did not start."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody is listening on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis_server(
    port: int | None = None,
    workdir: str | None = None,
    maxmemory: str = "256mb",
    password: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start redis-server (LRU eviction, no persistence) and wait until it accepts; returns
    the process and its URL (without the password). Stop it with `process.terminate()`."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisServerError("redis-server is not on PATH; `make test` / `make serve` install it")
    port = port or free_port()
    workdir = workdir or tempfile.mkdtemp(prefix="halfmoon-redis-")
    command = [binary, _config_file(workdir, password), *_options(port, workdir, maxmemory)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    process.terminate()
    raise RedisServerError(f"redis-server did not start on port {port}")


def _options(port: int, workdir: str, maxmemory: str) -> list[str]:
    """redis-server's command-line options: loopback only, no persistence, LRU eviction."""
    options = {
        "port": str(port),
        "bind": "127.0.0.1",
        "save": "",
        "appendonly": "no",
        "dir": workdir,
        "maxmemory": maxmemory,
        "maxmemory-policy": "allkeys-lru",
    }
    return [arg for name, value in options.items() for arg in (f"--{name}", value)]


def _config_file(workdir: str, password: str | None) -> str:
    """A config file readable by this user only, so the password is not on the command line."""
    path = Path(workdir) / "redis.conf"
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(f'requirepass "{password}"\n' if password else "")
    return str(path)
