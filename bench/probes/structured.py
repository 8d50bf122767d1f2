"""`halfmoon bench structured`: requests with random JSON schemas through the offline engine.

How many outputs parse and validate against their schema (the goal: all), and the throughput
with the schemas against the same prompts without them, each request generating as many tokens
as it did under its schema (the goal: >= 0.8x); the grammar's cost per token, from the wall
times and from the sampler's mask and the matchers' advance timed alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from halfmoon.engine.init_model import SHAPES, default_model_dir, ensure_model

NAMES = ["id", "name", "age", "tags", "score", "active", "address", "items", "kind", "note"]
WORDS = ["red", "green", "blue", "a b", "Z", 1, 2.5, None, True]
LEAVES = ("integer", "number", "string", "pattern", "boolean", "enum", "null", "any_of")
NESTED = ("array", "object")
MAX_DEPTH = 3
# The checkpoint directory each shape is cached under (`bench engine` names the same ones).
MODEL_NAMES = {"tiny": "tiny-llama", "bench": "bench-50m", "gpu": "bench-0.9b"}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 properties of mixed kinds (objects and arrays nested to depth 3),
    each required with probability 0.6. Strings and arrays are bounded (`maxLength`,
    `maxItems`), so that an output fits a token budget whatever the model does."""
    names = rng.sample(NAMES, rng.randint(1, 4))
    properties = {name: _random_value(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required}


def _random_value(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(LEAVES + NESTED if depth < MAX_DEPTH else LEAVES)
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 10_000)}
    if kind == "number":
        return {"type": "number", "minimum": -1000, "maximum": 1000}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{2,6}$", "^[A-Z][0-9]{3}$"])}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "any_of":
        integer = {"type": "integer", "minimum": 0, "maximum": 99}
        return {"anyOf": [integer, {"type": "string", "maxLength": 4}]}
    if kind == "array":
        low = rng.randint(0, 1)
        items = _random_value(rng, depth + 1)
        return {
            "type": "array",
            "items": items,
            "minItems": low,
            "maxItems": low + rng.randint(1, 3),
        }
    if kind == "object":
        return random_schema(rng, depth)
    return {"type": kind}  # boolean, null


@dataclass(slots=True)
class Run:
    wall_s: float
    num_tokens: int
    outputs: list


def validation_errors(text: str, schema: dict) -> str | None:
    """Why `text` is not a JSON document valid against `schema`; None when it is."""
    import jsonschema

    try:
        document = json.loads(text)
    except ValueError as error:
        return f"does not parse: {error}"
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError as error:
        return f"does not validate: {error.message}"
    return None


@contextmanager
def timed_grammar():
    """Seconds spent in the sampler's grammar masks and the matchers' advance, while open."""
    from halfmoon.engine import grammar, sampler

    spent = [0.0]
    mask, advance = sampler.mask_logits, grammar.GrammarState.advance

    def timed(fn):
        def call(*args):
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[0] += time.perf_counter() - started

        return call

    sampler.mask_logits, grammar.GrammarState.advance = timed(mask), timed(advance)
    try:
        yield spent
    finally:
        sampler.mask_logits, grammar.GrammarState.advance = mask, advance


def run(llm, prompts: list[str], params: list) -> Run:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - started
    return Run(wall_s, sum(len(o.token_ids) for o in outputs), outputs)


def compile_ms(schemas: list[dict], tokenizer, vocab_size: int, stop_ids: list[int]) -> list[float]:
    """Each schema's compile against the vocabulary, one at a time, from a cold cache."""
    from halfmoon.engine.grammar import Grammars
    from halfmoon.engine.structured_output import StructuredOutput

    grammars = Grammars(tokenizer, vocab_size, stop_ids)
    grammars.start(StructuredOutput("json_object")).compiled.result()  # the tokenizer's setup
    times = []
    for schema in schemas:
        started = time.perf_counter()
        grammars.start(StructuredOutput("json", json.dumps(schema))).compiled.result()
        times.append((time.perf_counter() - started) * 1000)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="halfmoon bench structured",
        description="Random JSON schemas through the offline engine: how many outputs parse "
        "and validate, and throughput with the schemas vs without on the same prompts.",
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny", help="shape (tiny)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=64, help="max_num_seqs (64)")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=1.0, help="1.0; 0 is greedy")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each (3; best)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>26}: {value:.3f}" if isinstance(value, float) else f"{key:>26}: {value}")
    return 0 if result["valid_pct"] == 100.0 else 1


def measure(args: argparse.Namespace) -> dict:
    from halfmoon.engine import LLM, SamplingParams
    from halfmoon.engine.structured_output import StructuredOutput

    model_dir = ensure_model(
        default_model_dir().with_name(MODEL_NAMES[args.model]), SHAPES[args.model]
    )
    # No prefix cache: a later run would find an earlier run's prompts there.
    llm = LLM(
        str(model_dir),
        max_num_seqs=args.batch_size,
        device=args.device,
        enable_prefix_caching=False,
    )
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.requests)]
    prompts = [f"Request {i}: reply in JSON.\n" for i in range(len(schemas))]
    seeds = [dict(seed=args.seed + i) if args.temperature else {} for i in range(len(schemas))]
    constrained = [
        SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            **seed,
            structured_output=StructuredOutput("json", json.dumps(schema)),
        )
        for schema, seed in zip(schemas, seeds, strict=True)
    ]
    any_object = StructuredOutput("json_object")  # warms up xgrammar and the vocabulary's setup
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_output=any_object))
    with timed_grammar() as grammar_s:
        with_schema = [run(llm, prompts, constrained)]
    outputs = with_schema[0].outputs
    errors = [validation_errors(o.text, s) for o, s in zip(outputs, schemas, strict=True)]
    for error, schema in zip(errors, schemas, strict=True):
        if error:
            print(f"{error}: {json.dumps(schema)}", file=sys.stderr)
    free = [
        SamplingParams(
            temperature=args.temperature, max_tokens=len(o.token_ids), ignore_eos=True, **seed
        )
        for o, seed in zip(outputs, seeds, strict=True)
    ]
    without = [run(llm, prompts, free)]
    for _ in range(args.rounds - 1):  # alternate, so that a busy moment hits both
        with_schema.append(run(llm, prompts, constrained))
        without.append(run(llm, prompts, free))
    tokens = with_schema[0].num_tokens
    with_s, without_s = min(r.wall_s for r in with_schema), min(r.wall_s for r in without)
    engine = llm.engine
    compiles = compile_ms(
        schemas, engine.tokenizer, engine.model_config.vocab_size, sorted(engine.eos_token_ids)
    )
    return {
        "model": f"{args.model} on {args.device}",
        "requests": len(schemas),
        "valid_pct": 100.0 * errors.count(None) / len(errors),
        "finished_stop_pct": 100.0 * sum(o.finish_reason == "stop" for o in outputs) / len(outputs),
        "output_tokens": tokens,
        "tok_s_with_schema": tokens / with_s,
        "tok_s_without": tokens / without_s,
        "throughput_ratio": without_s / with_s,
        "grammar_us_per_token_wall": (with_s - without_s) / tokens * 1e6,
        "mask_and_advance_us_per_token": grammar_s[0] / tokens * 1e6,
        "compile_ms_p50": statistics.median(compiles),
        "compile_ms_max": max(compiles),
    }
