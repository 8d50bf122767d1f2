"""`halfmoon bench engine --peer vllm` and `--threads N N ...`: our engine, and vLLM's CPU build
with `--peer`, at each thread count in alternating turns, each timed run on idle CPUs; and the
turns of two engines in this process (`timed_turns`: --vs-dtype, --vs-expert-loop)."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from halfmoon.bench.engine import Workload, our_llm, time_ours
from halfmoon.bench.peer import PeerRun, VllmPeer

# How long a timed run of `compare_in_turns` waits at most for the CPUs to go idle.
QUIET_TIMEOUT_S = 10.0


def compare_in_turns(model_dir: Path, work: Workload, dtype: torch.dtype, args) -> dict:
    """Ours, and vLLM with `--peer`, at each of `--threads` in turns (vLLM then ours at each
    count), `--repeats` turns after an untimed one, every engine loaded once; medians, and the
    median of each turn's ratios (the machine's load moves the runs of one turn alike)."""
    name, counts, log = str(dtype).removeprefix("torch."), args.thread_counts, sys.stderr
    peers: dict[int, VllmPeer] = {}
    runs: dict[int, list[TimedRun]] = {threads: [] for threads in counts}
    try:
        for threads in counts if args.peer else ():
            peers[threads] = VllmPeer(model_dir, work, name, threads, args.batch_size)
        llm = our_llm(model_dir, args.batch_size, "cpu", dtype)
        for threads in counts:  # an untimed pass each at every count: warm at every count
            torch.set_num_threads(threads)
            time_ours(llm, work)
            if peers:
                peers[threads].run()
        for turn in range(args.repeats):
            for threads in counts:
                theirs = after_quiet(peers[threads].run) if peers else None
                torch.set_num_threads(threads)
                ours = after_quiet(time_ours, llm, work)
                if theirs is not None:
                    assert theirs.output_tokens == work.num_output_tokens, theirs
                runs[threads].append(TimedRun(ours.wall_s, ours.cpu_s, theirs))
                vllm = f", vllm {theirs.wall_s:.1f}s" if theirs else ""
                print(f"turn {turn}, {threads} thread(s): ours {ours.wall_s:.1f}s{vllm}", file=log)
    finally:
        for peer in peers.values():
            peer.close()
    tokens = work.num_output_tokens
    if len(counts) == 1:
        return _turns_result(runs[counts[0]], tokens)
    result = {}
    for threads in counts:
        figures = _turns_result(runs[threads], tokens)
        result |= {f"{key}_{threads}t": value for key, value in figures.items()}
    first, last = runs[counts[0]], runs[counts[-1]]
    scalings = [a.ours_s / b.ours_s for a, b in zip(first, last, strict=True)]
    result |= {"ours_scaling": statistics.median(scalings), "ours_scalings": rounded(scalings)}
    if peers:
        scalings = [a.peer.wall_s / b.peer.wall_s for a, b in zip(first, last, strict=True)]
        result |= {"vllm_scaling": statistics.median(scalings), "vllm_scalings": rounded(scalings)}
    return result


def timed_turns(
    engines: dict, work: Workload, repeats: int, labels: dict[str, str]
) -> dict[str, list[float]]:
    """Each of `engines`' wall seconds in `repeats` turns, every turn timing them in order, each
    once the CPUs are idle; a line a turn with their walls by `labels` (in its order)."""
    walls: dict[str, list[float]] = {side: [] for side in engines}
    for turn in range(repeats):
        for side, llm in engines.items():
            walls[side].append(after_quiet(time_ours, llm, work).wall_s)
        each = ", ".join(f"{label} {walls[side][-1]:.1f}s" for side, label in labels.items())
        print(f"turn {turn}: {each}", file=sys.stderr)
    return walls


def after_quiet(run, *args, timeout_s: float = QUIET_TIMEOUT_S):
    """`run(*args)` once the machine's CPUs have been idle (under 10 % busy) for a 0.2 s window,
    or after `timeout_s`: vLLM's processes keep a core busy for ~1 s after each of its runs,
    which would otherwise be charged to the run after it."""
    deadline = time.monotonic() + timeout_s
    while _busy_fraction(0.2) > 0.1:
        if time.monotonic() > deadline:
            print(f"the CPUs are still busy after {timeout_s:g} s: timing anyway", file=sys.stderr)
            break
    return run(*args)


def _busy_fraction(window_s: float) -> float:
    """The share of all CPUs' time spent busy over the next `window_s` (0 where /proc/stat is
    not there to tell)."""

    def sample() -> tuple[int, int]:
        try:
            with open("/proc/stat") as stat:
                fields = [int(field) for field in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return 0, 0
        idle = fields[3] + fields[4]  # idle and iowait
        return sum(fields) - idle, sum(fields)

    busy_before, total_before = sample()
    time.sleep(window_s)
    busy, total = sample()
    return (busy - busy_before) / (total - total_before) if total > total_before else 0.0


@dataclass(frozen=True, slots=True)
class TimedRun:
    """One pass of ours (wall and CPU seconds) and, with a peer, the peer's pass of that turn."""

    ours_s: float
    ours_cpu_s: float
    peer: PeerRun | None


def _turns_result(runs: list[TimedRun], tokens: int) -> dict:
    ours_s = statistics.median(run.ours_s for run in runs)
    result = {
        "ours_tok_s": tokens / ours_s,
        "ours_tok_per_cpu_s": tokens / statistics.median(run.ours_cpu_s for run in runs),
    }
    if runs[0].peer is None:
        return result
    ratios = [run.peer.wall_s / run.ours_s for run in runs]
    return result | {
        "vllm_tok_s": tokens / statistics.median(run.peer.wall_s for run in runs),
        "ratio_vs_vllm": statistics.median(ratios),
        "ratios_vs_vllm": rounded(ratios),
        "vllm_tok_per_cpu_s": tokens / statistics.median(run.peer.cpu_s for run in runs),
    }


def rounded(values: list[float]) -> list[float]:
    return [round(value, 3) for value in values]
