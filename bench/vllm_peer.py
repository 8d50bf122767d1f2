"""The vLLM side of `halfmoon bench engine --peer vllm`, run by the peers' Python (.peers-venv).

Not imported by halfmoon: `bench engine` starts it as a script, sends one line per timed run
on stdin (`run`, then `quit`) and reads one JSON object per line back on the result pipe (the
process's original stdout; vLLM's own logging goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _result_pipe():
    """The original stdout for results; fd 1 then points at stderr, where vLLM logs."""
    pipe = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return pipe


def _engine(args):
    from vllm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,  # repeated runs would otherwise hit their own cache
        kv_cache_memory_bytes=args.kv_cache_bytes,
        enforce_eager=args.eager,
        seed=0,
    )


def _tree_cpu_s() -> float:
    """CPU seconds used so far by this process and every process it started (vLLM's engine
    core and worker)."""
    import psutil

    me = psutil.Process()
    times = [proc.cpu_times() for proc in [me, *me.children(recursive=True)]]
    return sum(t.user + t.system for t in times)


def _generate(llm, work: dict) -> dict:
    """Wall and CPU seconds and output tokens of the whole workload, greedy, ignoring EOS."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in work["prompts"]]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        for n in work["output_lens"]
    ]
    started, cpu_before = time.perf_counter(), _tree_cpu_s()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s, cpu_s = time.perf_counter() - started, _tree_cpu_s() - cpu_before
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    return {"wall_s": wall_s, "cpu_s": cpu_s, "output_tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True, help="JSON: prompts, output_lens")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    args = parser.parse_args()
    # This folder's modules (kernels.py) would shadow packages of the same name vLLM imports.
    sys.path[:] = [path for path in sys.path if path != os.path.dirname(os.path.abspath(__file__))]
    # peers.sh's `vllm` metadata alias lacks "+cpu", from which vLLM would infer its platform.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    results = _result_pipe()
    with open(args.workload) as file:
        work = json.load(file)
    llm = _engine(args)
    _generate(llm, {"prompts": [work["prompts"][0][:8]], "output_lens": [2]})  # warm up
    results.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if line.strip() != "run":
            break
        results.write(json.dumps(_generate(llm, work)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
