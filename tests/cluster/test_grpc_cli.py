"""`halfmoon generate` against a running server: JSON like --local, exit codes, messages."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from halfmoon.cluster.cli import main


def run_cli(*args: str) -> dict:
    command = [sys.executable, "-m", "halfmoon.cluster.cli", "generate", *args]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout)


def test_generate_json_from_a_server_equals_generate_local(server, tiny_model_dir):
    args = ("--max-tokens", "8", "--json", "Hello there")
    remote = run_cli("--server", server.address, *args)
    local = run_cli("--local", "--model", str(tiny_model_dir), *args)
    assert remote.pop("request_id") and local.pop("request_id")  # each side names its own
    assert remote == local
    assert set(remote) >= {"token_ids", "text", "finish_reason", "usage"}


def test_generate_prints_the_request_id_that_status_explains(server, capsys):
    assert main(["generate", "--server", server.address, "--max-tokens", "2", "Hi"]) == 0
    request_id = capsys.readouterr().err.strip().removeprefix("request id: ")
    assert main(["status", "--server", server.address, "--explain", request_id]) == 0
    assert request_id in capsys.readouterr().out


def test_generate_streams_text_from_a_server(server, tiny_llm, capsys):
    from halfmoon.engine import SamplingParams

    want = tiny_llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert main(["generate", "--server", server.address, "--max-tokens", "6", "Hello"]) == 0
    assert capsys.readouterr().out == want.text + "\n"


def test_generate_invalid_request_exits_2_with_the_servers_message(server, capsys):
    assert main(["generate", "--server", server.address, "--top-p", "2", "hi"]) == 2
    assert capsys.readouterr().err == (
        "halfmoon generate: error: top_p=2.0 is invalid: must be in (0, 1]\n"
    )


def test_generate_without_a_server_says_how_to_start_one(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: refused
        assert main(["generate", "--server", address, "hi"]) == 1
    assert capsys.readouterr().err == (
        f"halfmoon generate: error: no halfmoon server at {address} — "
        "start one with `halfmoon serve`\n"
    )


def test_the_api_key_can_come_from_a_file_and_a_bad_file_is_named(tmp_path, capsys):
    from halfmoon.cluster.cli import build_parser

    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    args = build_parser().parse_args(["status", "--api-key-file", str(key_file)])
    assert args.api_key == "from-a-file"
    (tmp_path / "empty").write_text("")
    for bad, why in ((tmp_path / "missing", "No such file"), (tmp_path / "empty", "is empty")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["status", "--api-key-file", str(bad)])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one or the other
        build_parser().parse_args(["status", "--api-key", "k", "--api-key-file", str(key_file)])
