"""The GPU session as data: four steps, each one device call of at most STEP_BUDGET_S, the
commands each runs, how long each should take on the ~0.9B shape on one GPU, and which goal
figure each step measures. deploy/gpu/session.py runs a step; bench-gpu.sh runs commands.

The planned times are estimates (no step has run on a GPU yet); each command is killed at
its limit, and a step skips a command whose limit no longer fits its budget."""

from __future__ import annotations

from dataclasses import dataclass, field

STEP_BUDGET_S = 480  # a device call is at most 10 minutes; 8 leave room for start and copies
# Said beside every figure measured with a prefill and a decode worker on the same GPU.
SHARED_GPU = (
    "one GPU shared by the prefill and the decode worker: two processes time-slice it, so "
    "this measures the KV transfer path and the engine, not prefill/decode pool isolation"
)


@dataclass(frozen=True, slots=True)
class Command:
    """One command of a step: `argv` after `halfmoon` (or a `bash` script), on the GPU.

    `env`: set for it. `cpu_argv` / `cpu_env`: the CPU rehearsal's cheap stand-in (None: the
    rehearsal only checks `argv`'s arguments with the CLI's own parsers, or a script's syntax).
    """

    name: str
    argv: tuple[str, ...]
    planned_s: int
    limit_s: int
    cpu_argv: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cpu_env: dict[str, str] = field(default_factory=dict)
    shares_gpu: bool = False

    @property
    def is_script(self) -> bool:
        return self.argv[0] == "bash"


@dataclass(frozen=True, slots=True)
class Step:
    number: int
    title: str
    goal: str  # the goal figure it measures
    commands: tuple[Command, ...]

    @property
    def planned_s(self) -> int:
        return sum(command.planned_s for command in self.commands)


def _bench(name: str, *args: str, planned: int, limit: int, **kwargs) -> Command:
    return Command(name, ("bench", *args, "--json"), planned, limit, **kwargs)


SUITE = Command(
    "test-gpu",
    ("bash", "deploy/gpu/test-gpu.sh"),
    360,
    450,
    cpu_argv=("bash", "deploy/gpu/test-gpu.sh"),
    cpu_env={"GPU_TEST_PATHS": "tests/engine/test_cuda_paths.py"},
)
ENGINE = (
    _bench("step", "step", "--device", "cuda", planned=60, limit=120),
    _bench("step-eager", "step", "--device", "cuda", "--eager", planned=45, limit=90),
    _bench("kernels", "kernels", planned=30, limit=60, cpu_argv=("bench", "kernels", "--json")),
    # transformers' continuous batching (not a goal figure) could wait 600 s: left out.
    _bench(
        "engine", "engine", "--device", "cuda", "--eager", "--skip-hf-cb", planned=200, limit=260
    ),
    _bench("rdt", "rdt", "--device", "cuda", planned=30, limit=60),
    _bench(
        "rdt-gpu-shape",
        "rdt",
        "--device",
        "cuda",
        "--shape",
        "gpu",
        "--tokens",
        "1024,4096,8192",
        "--requests",
        "10",
        planned=40,
        limit=80,
    ),
)
TRANSFER = (
    _bench(
        "transfer",
        "transfer",
        "--device",
        "cuda",
        "--repeats",
        "10",
        planned=150,
        limit=200,
        shares_gpu=True,
    ),
    _bench(
        "ttft",
        "ttft",
        "--device",
        "cuda",
        "--prompt-tokens",
        "1024",
        "--requests",
        "24",
        planned=150,
        limit=200,
        shares_gpu=True,
    ),
    _bench(
        "ttft-2rps",
        "ttft",
        "--device",
        "cuda",
        "--mode",
        "disaggregated",
        "--prompt-tokens",
        "1024",
        "--requests",
        "48",
        "--max-tokens",
        "128",
        "--request-rate",
        "2",
        planned=90,
        limit=120,
        shares_gpu=True,
    ),
    _bench(
        "prefix-load",
        "prefix-load",
        "--device",
        "cuda",
        "--tokens",
        "512,2048,4064",
        planned=60,
        limit=90,
        shares_gpu=True,
    ),
)
SERVE = Command(
    "serve-bench",
    ("bash", "deploy/gpu/serve-bench.sh"),
    420,
    460,
    env={"SERVE_BENCH_BUDGET_S": "400"},
    shares_gpu=True,
)

STEPS = (
    Step(
        1,
        "suite",
        "none: the GPU suite passes (kernels compiled; bf16 engine vs transformers "
        ">= 95 % greedy tokens; live bf16 cluster = offline engine; graphs, IPC, sampling)",
        (SUITE,),
    ),
    Step(
        2,
        "engine",
        "decode step wall <= 1.3x GPU kernel time at batch 1 and 64 (step); "
        "offline throughput >= 6x transformers static (engine)",
        ENGINE,
    ),
    Step(
        3,
        "transfer",
        "KV stall p50 <= 1.2x one layer's move (transfer); served TTFT p50 <= "
        "2x engine + 5 ms (ttft)",
        TRANSFER,
    ),
    Step(
        4,
        "serve",
        "issues 12 and 17: disaggregated vs colocated TTFT and ITL at 2 and 8 "
        "req/s; live vs simulated SLO attainment (serve-bench)",
        (SERVE,),
    ),
)
COMMANDS = {command.name: command for step in STEPS for command in step.commands}
