"""Can this host run the GPU suite? Checked in seconds, before minutes of device time go by.

Triton builds a small C launcher for each kernel at its first launch, with the host's C
compiler against `Python.h`: without either, every kernel test fails at its first launch, and
only then. `preflight.py` looks for both, then compiles and runs one Triton kernel (on CUDA;
under the interpreter without one) and compares it with torch, within SMOKE_LIMIT_S.

    python deploy/gpu/preflight.py [--json]   exit 0 when all is well, 1 with the reason
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

SMOKE_LIMIT_S = 60  # a first compile takes a few seconds; a hung one must not take the run
COMPILERS = ("cc", "gcc", "clang")
SMOKE = """
import time, torch, triton, triton.language as tl

@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    total = tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, total, mask=mask)

device = "cuda" if torch.cuda.is_available() else "cpu"
x, y = torch.arange(1000.0, device=device), torch.ones(1000, device=device)
out = torch.empty_like(x)
started = time.perf_counter()
add[(triton.cdiv(1000, 256),)](x, y, out, 1000, BLOCK=256)
assert torch.equal(out, x + y), "the Triton kernel's sum differs from torch's"
print(device, round(time.perf_counter() - started, 3))
"""


def find_compiler() -> str | None:
    """The C compiler Triton will use: $CC, else the first of COMPILERS on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((path for name in COMPILERS if (path := shutil.which(name))), None)


def python_header() -> Path | None:
    """This Python's `Python.h`, or None when its development headers are not installed."""
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return header if header.is_file() else None


def smoke_kernel() -> dict:
    """Compile and run one Triton kernel in a child process, bounded by SMOKE_LIMIT_S."""
    env = dict(os.environ)
    if not _has_cuda():
        env["TRITON_INTERPRET"] = "1"  # no GPU: the interpreter runs the same kernel
    started = time.perf_counter()
    # From a file: Triton reads a kernel's source with `inspect`, which `python -c` defeats
    # ("@jit functions should be defined in a Python file"; the interpreter does not mind).
    with tempfile.TemporaryDirectory(prefix="halfmoon-preflight-") as folder:
        script = Path(folder) / "smoke.py"
        script.write_text(SMOKE)
        try:
            run = subprocess.run(
                [sys.executable, str(script)],
                env=env,
                capture_output=True,
                text=True,
                timeout=SMOKE_LIMIT_S,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"no result in {SMOKE_LIMIT_S} s"}
    seconds = round(time.perf_counter() - started, 2)
    if run.returncode != 0:
        return {"ok": False, "seconds": seconds, "error": run.stderr.strip()[-2000:]}
    device, kernel_s = run.stdout.split()
    return {"ok": True, "seconds": seconds, "device": device, "first_launch_s": float(kernel_s)}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def preflight() -> dict:
    """The checks' results; `ok` only when the compiler, the header and the kernel are."""
    compiler, header = find_compiler(), python_header()
    result = {"compiler": compiler, "python_h": str(header) if header else None}
    problems = []
    if compiler is None:
        problems.append(
            "no C compiler (cc, gcc or clang; or $CC): Triton cannot build its launcher"
        )
    if header is None:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        problems.append(f"no Python.h for {sys.executable}: install python{version}-dev")
    result["smoke"] = smoke_kernel() if not problems else {"ok": False, "error": "not run"}
    if not result["smoke"]["ok"] and not problems:
        problems.append(f"the Triton smoke kernel failed: {result['smoke']['error']}")
    return {"ok": not problems, "problems": problems, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="preflight.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    result = preflight()
    if args.json:
        print(json.dumps(result))
    for problem in result["problems"]:
        print(f"preflight: {problem}", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
