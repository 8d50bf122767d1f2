"""The peer engine of `halfmoon bench engine --peer vllm`: vLLM's CPU build in a subprocess of
the peers' virtualenv (`make peers`), driven by `vllm_peer.py`, one timed run per call."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

PEERS_PYTHON = Path(__file__).resolve().parents[1] / ".peers-venv" / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_peer.py")
# Put on the peer's PYTHONPATH where our kernels run a pre-AVX-512 variant (its sitecustomize).
PEER_SITE = Path(__file__).with_name("peer_site")


class PeerUnavailableError(RuntimeError):
    """The peer engine is not installed or did not start."""


@dataclass(frozen=True, slots=True)
class PeerRun:
    """One timed pass over the workload: wall seconds and CPU seconds of the whole process tree."""

    wall_s: float
    cpu_s: float
    output_tokens: int


class VllmPeer:
    """vLLM loaded once in its own process; `run` times one `generate` over the workload."""

    def __init__(self, model_dir: Path, work, dtype: str, threads: int, batch_size: int) -> None:
        if not PEERS_PYTHON.is_file():
            raise PeerUnavailableError(f"{PEERS_PYTHON} is missing: run `make peers` first")
        self.workload = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)  # noqa: SIM115
        json.dump({"prompts": work.prompts, "output_lens": work.output_lens}, self.workload)
        self.workload.close()
        command = [str(PEERS_PYTHON), str(DRIVER), "--model", str(model_dir)]
        command += ["--workload", self.workload.name, "--dtype", dtype]
        command += ["--batch-size", str(batch_size)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(threads)
        )
        self._read()  # {"ready": true} once loaded, compiled and warmed up

    def run(self) -> PeerRun:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return PeerRun(**self._read())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(timeout=120)
        os.unlink(self.workload.name)

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise PeerUnavailableError(f"vLLM exited with status {code}; its log is above")
        return json.loads(line)


def _env(threads: int) -> dict[str, str]:
    """vLLM's own way to use `threads` cores: its OpenMP threads bound to the first `threads`
    CPUs this process may use (unless the caller set VLLM_CPU_OMP_THREADS_BIND). Where
    `HALFMOON_CPU_ISA` is `avx2` (or `generic`), vLLM's AVX2 build (`peer_site`)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    if env.get("HALFMOON_CPU_ISA", "").strip().lower() in ("avx2", "generic"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PEER_SITE), env.get("PYTHONPATH")]))
    return env
