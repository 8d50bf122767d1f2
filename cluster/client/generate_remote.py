"""`halfmoon generate` against a running server: stream the text, or print one JSON object."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from halfmoon.cluster.cli import print_result, sampling_kwargs
from halfmoon.cluster.client.grpc_client import Client, Completion, ServerError


def generate_remote(args) -> int:
    """Exit 0 on success, 2 when the server rejects the request as invalid, 1 otherwise."""
    sampling = sampling_kwargs(args)
    with Client(args.server, args.tls_ca, api_key=args.api_key) as client:
        try:
            result = _run(client, args.prompt, sampling, stream_text=not args.json)
        except ServerError as error:
            return _report(error, args.server)
        except KeyboardInterrupt:
            return 130
    print_result(result.request_id, result.token_ids, result.text, _last(result), args.json)
    return 0


def _run(client: Client, prompt: str, sampling: dict, stream_text: bool) -> Completion:
    with client.generate(prompt, **sampling) as stream:
        result = Completion(stream.request_id)
        for delta in stream:
            result.add(delta)
            if stream_text:
                print(delta.text, end="", flush=True)
    return result


def _last(result: Completion) -> SimpleNamespace:
    """The attributes `completion_json` reads from the engine's last output."""
    usage = result.usage
    return SimpleNamespace(
        finish_reason=result.finish_reason,
        num_prompt_tokens=usage.prompt_tokens if usage else 0,
        num_cached_tokens=usage.cached_tokens if usage else 0,
    )


def _report(error: ServerError, server: str) -> int:
    if error.unreachable:
        message = f"no halfmoon server at {server} — start one with `halfmoon serve`"
    elif error.code == "INVALID_ARGUMENT":
        message = error.message
    else:
        message = f"{error.code}: {error.message}"
    print(f"halfmoon generate: error: {message}", file=sys.stderr)
    return 2 if error.code == "INVALID_ARGUMENT" else 1
