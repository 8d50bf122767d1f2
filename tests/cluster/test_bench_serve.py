"""`halfmoon bench serve`: exact metrics on fixed timings, workloads, arrivals, and real runs
over gRPC (a live cluster, and --compare against a second server) and over HTTP (halfmoon's
OpenAI frontend, with its API key)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from cluster_kit import running_cluster
from grpc_testkit import serve_model
from http_testkit import serve_openai

from halfmoon.bench.metrics import RequestResult, parse_goodput, summarize
from halfmoon.bench.workload import (
    arrival_times,
    prompt_vocabulary,
    random_requests,
    rescale_to_rate,
    trace_requests,
)
from halfmoon.cluster.cli import main
from halfmoon.engine.init_model import build_tokenizer

# The first requests of Mooncake's conversation trace, kept in the repository (tests/data).
TRACE_HEAD = Path(__file__).parents[1] / "data" / "conversation_head.jsonl"
SYNTHETIC = [
    RequestResult(0.0, 10, ttft_s=0.1, itl_s=[0.02, 0.02, 0.02], e2el_s=0.16, num_output_tokens=4),
    RequestResult(0.5, 20, ttft_s=0.3, itl_s=[0.04], e2el_s=0.34, num_output_tokens=2),
    RequestResult(1.0, 30, error="RESOURCE_EXHAUSTED", error_message="rejected"),
    RequestResult(1.5, 5, ttft_s=0.2, e2el_s=0.2, num_output_tokens=1),
]


def test_summary_of_fixed_timings_is_exact():
    got = summarize(SYNTHETIC, 2.0, [50, 90, 99], parse_goodput(["ttft:250", "tpot:30"]))
    want = {
        "duration": 2.0,
        "completed": 3,
        "failed": 1,
        "total_input_tokens": 35,
        "total_output_tokens": 7,
        "request_throughput": 1.5,
        "request_goodput": 1.0,  # the 2nd misses the TTFT SLO; a 1-token output has TPOT 0
        "slo_attainment": 0.5,  # 2 of the 4 sent: the failed request counts as missed
        "output_throughput": 3.5,
        "total_token_throughput": 21.0,
        "mean_ttft_ms": 200.0,
        "median_ttft_ms": 200.0,
        "std_ttft_ms": statistics.pstdev([100, 200, 300]),
        "p50_ttft_ms": 200.0,
        "p90_ttft_ms": 280.0,
        "p99_ttft_ms": 298.0,
        "mean_tpot_ms": 30.0,  # (160 - 100) / 3 and (340 - 300) / 1; 1-token outputs excluded
        "median_tpot_ms": 30.0,
        "std_tpot_ms": 10.0,
        "p50_tpot_ms": 30.0,
        "p90_tpot_ms": 38.0,
        "p99_tpot_ms": 39.8,
        "mean_itl_ms": 25.0,
        "median_itl_ms": 20.0,
        "std_itl_ms": statistics.pstdev([20, 20, 20, 40]),
        "p50_itl_ms": 20.0,
        "p90_itl_ms": 34.0,
        "p99_itl_ms": 39.4,
        "mean_e2el_ms": 700 / 3,
        "median_e2el_ms": 200.0,
        "std_e2el_ms": statistics.pstdev([160, 340, 200]),
        "p50_e2el_ms": 200.0,
        "p90_e2el_ms": 312.0,
        "p99_e2el_ms": 337.2,
    }
    assert got.pop("errors") == {"RESOURCE_EXHAUSTED": 1}
    assert got.pop("error_messages") == {"RESOURCE_EXHAUSTED": "rejected"}
    assert got == pytest.approx(want, abs=1e-9)
    without_slos = summarize(SYNTHETIC, 2.0)
    assert without_slos["request_goodput"] is None and without_slos["slo_attainment"] is None


@pytest.mark.parametrize("item", ["ttft", "ttft:fast", "queue:5", "e2el:0"])
def test_bad_goodput_slos_are_rejected_with_the_item(item):
    with pytest.raises(ValueError, match=item):
        parse_goodput([item])


def test_trace_workload_keeps_shared_prefixes_shared(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1400, "output_length": 512, "hash_ids": [7, 8, 9]},
        {"timestamp": 1000, "input_length": 1536, "output_length": 256, "hash_ids": [7, 8, 3]},
        {"timestamp": 3000, "input_length": 512, "output_length": 128, "hash_ids": [9]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    vocabulary = range(100, 200)
    # 512-token trace blocks scaled to 4 tokens: lengths scale by 4/512; time by 1/2.
    first, second, third = trace_requests(str(trace), 10, 4, 2.0, vocabulary)
    assert [len(r.prompt_token_ids) for r in (first, second, third)] == [11, 12, 4]
    assert [r.max_tokens for r in (first, second, third)] == [4, 2, 1]
    assert [r.arrival_s for r in (first, second, third)] == [0.0, 0.5, 1.5]
    assert first.prompt_token_ids[:8] == second.prompt_token_ids[:8]  # hash ids 7, 8
    assert first.prompt_token_ids[8:] != second.prompt_token_ids[8:11]  # 9 against 3
    assert third.prompt_token_ids[:3] == first.prompt_token_ids[8:]  # 9 is one fixed block
    unscaled = trace_requests(str(trace), 2, 512, 1.0, vocabulary)
    assert [len(r.prompt_token_ids) for r in unscaled] == [1400, 1536]
    assert [r.max_tokens for r in unscaled] == [512, 256]
    assert unscaled[0].prompt_token_ids[:1024] == unscaled[1].prompt_token_ids[:1024]


def test_mooncake_trace_requests_share_their_common_first_block():
    requests = trace_requests(str(TRACE_HEAD), 5, 16, 1.0, range(6, 262))
    assert len({tuple(r.prompt_token_ids[:16]) for r in requests}) == 1  # all start at hash 0
    assert len({tuple(r.prompt_token_ids[16:32]) for r in requests}) == 5


def test_arrivals_follow_the_rate_and_the_seed():
    assert arrival_times(4, "constant", 4.0, 1.0, 0) == [0.0, 0.25, 0.5, 0.75]
    assert arrival_times(3, "poisson", float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    poisson = arrival_times(4000, "poisson", 10.0, 1.0, 1)
    assert poisson == arrival_times(4000, "poisson", 10.0, 1.0, 1)
    assert poisson != arrival_times(4000, "poisson", 10.0, 1.0, 2)
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)
    bursty = arrival_times(4000, "poisson", 10.0, 0.25, 1)
    bursty_gaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.fmean(bursty_gaps) == pytest.approx(0.1, rel=0.1)
    # Gamma gaps of shape k have a squared coefficient of variation of 1/k.
    assert (statistics.pstdev(gaps) / 0.1) ** 2 == pytest.approx(1.0, rel=0.1)
    assert (statistics.pstdev(bursty_gaps) / 0.1) ** 2 == pytest.approx(4.0, rel=0.2)


def test_trace_arrivals_stretch_to_a_requested_rate(tmp_path):
    requests = random_requests(3, 4, 2, 0.0, range(10), 0)
    for request, at in zip(requests, [0.0, 1.0, 3.0], strict=True):
        request.arrival_s = at
    rescale_to_rate(requests, 1.0)  # 2 gaps over 3 s -> over 2 s
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 2 / 3, 2.0])


def test_random_lengths_stay_in_range_and_repeat_with_the_seed():
    requests = random_requests(200, 100, 20, 0.5, range(6, 262), 3)
    assert all(50 <= len(r.prompt_token_ids) <= 150 for r in requests)
    assert all(10 <= r.max_tokens <= 30 for r in requests)
    again = random_requests(200, 100, 20, 0.5, range(6, 262), 3)
    assert [r.prompt_token_ids for r in requests] == [r.prompt_token_ids for r in again]
    exact = random_requests(5, 7, 3, 0.0, range(6, 262), 0)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in exact] == [(7, 3)] * 5


def test_text_prompts_keep_their_length_under_the_byte_tokenizer():
    tokenizer = build_tokenizer()
    vocabulary = prompt_vocabulary(tokenizer)
    prompt = random_requests(1, 300, 1, 0.0, vocabulary, 0)[0].prompt_token_ids
    assert tokenizer.encode(tokenizer.decode(prompt)) == prompt


# --- HTTP and gRPC against halfmoon's own OpenAI frontend and gRPC API (one engine). ---

KEY = "bench-serve-key"


def bench_json(capsys, *argv: str) -> dict:
    assert main(["bench", "serve", "--json", "--disable-tqdm", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def keyed_api(tiny_model_dir):
    with serve_openai(tiny_model_dir, api_key=KEY) as api:
        yield api


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_http_openai_stream_is_measured_with_the_api_key(keyed_api, capsys, backend):
    shape = ["--random-input-len", "12", "--random-output-len", "5", "--max-concurrency", "2"]
    base = keyed_api.base_url.removesuffix("/v1")
    report = bench_json(
        capsys,
        "--backend",
        backend,
        "--base-url",
        base,
        "--api-key",
        KEY,
        "--num-prompts",
        "6",
        *shape,
    )
    assert (report["completed"], report["failed"], report["errors"]) == (6, 0, {})
    # The server's usage counts the prompt: chat adds the template's tokens around the 12.
    prompt_tokens = 12 if backend == "openai" else 15
    assert report["total_input_tokens"] == 6 * prompt_tokens
    assert report["total_output_tokens"] == 30
    assert report["mean_ttft_ms"] > 0 and report["mean_itl_ms"] > 0
    assert report["server"] == {"model": keyed_api.model}


@pytest.mark.timeout(120)
def test_a_wrong_api_key_stops_the_run_with_a_clear_error(keyed_api, capsys):
    base = keyed_api.base_url.removesuffix("/v1")
    argv = ["bench", "serve", "--backend", "openai", "--base-url", base, "--num-prompts", "2"]
    assert main([*argv, "--api-key", "wrong", "--model", keyed_api.model]) == 2
    assert "refused the API key (HTTP 401)" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_compare_http_against_grpc_on_one_server(keyed_api, capsys):
    shape = ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4"]
    base = keyed_api.base_url.removesuffix("/v1")
    report = bench_json(
        capsys, "--api-key", KEY, "--compare", f"grpc://{keyed_api.grpc_address}", base, *shape
    )
    a, b = report["runs"]
    assert a["completed"] == b["completed"] == 4
    assert a["total_output_tokens"] == b["total_output_tokens"] == 16
    assert report["ratio_b_over_a"]["total_output_tokens"] == 1.0


def test_unreachable_server_is_a_clear_error(capsys):
    assert main(["bench", "serve", "--server", "127.0.0.1:1", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the halfmoon gRPC server at 127.0.0.1:1" in err
    assert "halfmoon serve" in err


# --- gRPC against a real cluster. ---


@pytest.fixture(scope="module")
def cluster_address(tiny_model_dir, ray_session):
    with running_cluster(tiny_model_dir, **{"router.profile": None}) as (cluster, client):
        yield client.address


SMALL = ["--num-prompts", "8", "--random-input-len", "40", "--random-output-len", "6"]


@pytest.mark.slow
@pytest.mark.timeout(480)  # the module cluster starts in the first test (90 s when busy)
def test_grpc_run_against_a_live_cluster(cluster_address, capsys, tmp_path):
    plot = tmp_path / "latency.png"
    report = bench_json(
        capsys,
        "--server",
        cluster_address,
        *SMALL,
        "--request-rate",
        "20",
        "--goodput",
        "ttft:600000",
        "--plot",
        str(plot),
    )
    assert (report["completed"], report["failed"], report["errors"]) == (8, 0, {})
    assert (report["total_input_tokens"], report["total_output_tokens"]) == (320, 48)
    assert report["request_goodput"] == pytest.approx(report["request_throughput"])
    assert report["slo_attainment"] == 1.0
    assert 0 < report["mean_ttft_ms"] <= report["mean_e2el_ms"]
    assert report["mean_tpot_ms"] > 0 and report["p99_itl_ms"] > 0
    assert report["target"] == f"grpc://{cluster_address}"
    assert report["server"]["mode"] == "disaggregated"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(480)  # the module cluster starts in the first test (90 s when busy)
def test_compare_runs_the_same_load_on_two_grpc_servers(cluster_address, capsys, tiny_model_dir):
    with serve_model(tiny_model_dir) as local:
        report = bench_json(capsys, "--compare", cluster_address, f"grpc://{local.address}", *SMALL)
    a, b = report["runs"]
    assert (a["target"], b["target"]) == (f"grpc://{cluster_address}", f"grpc://{local.address}")
    assert a["completed"] == b["completed"] == 8
    assert a["total_input_tokens"] == b["total_input_tokens"] == 320
    ratio = report["ratio_b_over_a"]
    assert ratio["total_output_tokens"] == 1.0
    assert ratio["mean_ttft_ms"] == pytest.approx(b["mean_ttft_ms"] / a["mean_ttft_ms"])


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_grpc_errors_are_counted_by_code(cluster_address, capsys):
    too_long = ["--random-input-len", "5000", "--random-output-len", "2"]
    report = bench_json(capsys, "--server", cluster_address, "--num-prompts", "2", *too_long)
    assert (report["completed"], report["failed"]) == (0, 2)
    assert report["errors"] == {"INVALID_ARGUMENT": 2}
    assert "context length" in report["error_messages"]["INVALID_ARGUMENT"]
    assert report["request_throughput"] == 0.0 and report["mean_ttft_ms"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(480)  # the module cluster starts in the first test (90 s when busy)
def test_live_capacity_runs_three_rates_against_the_simulator(cluster_address, capsys):
    """`bench live-capacity` on this cluster: SLOs so loose that both sides meet them, then
    so tight that both miss them."""
    argv = ["bench", "live-capacity", "--server", cluster_address, "--json", "--disable-tqdm"]
    slos = ["--ttft-slo", "600", "--tbt-slo", "600", "--rates", "4,8,16"]
    assert main([*argv, "--num-prompts", "6", *SMALL[2:], *slos]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["mode"], report["instances"]) == ("disaggregated", "1P+1D")
    assert report["profile"].startswith("measured-")
    assert [row["rate_rps"] for row in report["rates"]] == [4.0, 8.0, 16.0]
    for row in report["rates"]:
        assert row["live"]["completed"] == 6 and row["live"]["total_output_tokens"] == 36
        assert row["live_attainment"] == row["simulated_attainment"] == 1.0
        assert row["simulated_refit_attainment"] == 1.0
    assert report["all_agree"] is True
    # SLOs no request can meet: both sides miss every one, and still agree.
    tight = ["--ttft-slo", "0.001", "--tbt-slo", "0.0001", "--rates", "8"]
    assert main([*argv, "--num-prompts", "6", *SMALL[2:], *tight]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rates"]
    assert row["live_attainment"] == row["simulated_attainment"] == 0.0
