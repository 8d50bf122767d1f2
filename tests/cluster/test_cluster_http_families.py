"""The HTTP test families written against a LocalBackend (dialect, HTTP limits, tools), run
again through the production path: the router actor's ClusterBackend in a live colocated
cluster. The test functions are those modules' own, collected here a second time with this
module's `api` and `oai` fixtures; then the 50 hostile structured-output specs of issue 53
(`halfmoon bench hostile-grammars`' run) through the same cluster.
"""

from __future__ import annotations

import openai
import pytest
from cluster_kit import running_cluster
from http_testkit import RunningApi
from test_http_limits import (  # noqa: F401 - collected here, through the cluster
    test_a_body_short_of_its_content_length_gets_408_at_the_body_timeout,
    test_a_head_still_incomplete_past_max_header_bytes_gets_400_at_once,
    test_a_partial_head_gets_408_and_is_closed_at_the_header_timeout,
)
from test_openai_dialect import (  # noqa: F401 - collected here, through the cluster
    test_a_logit_bias_of_100_forces_the_token_and_minus_100_bans_it,
    test_a_value_that_would_change_the_output_and_is_not_honoured_is_a_400_naming_it,
    test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk,
    test_echo_puts_the_prompt_before_the_completion,
    test_grpc_names_a_bad_n_or_structured_output,
    test_grpc_structured_output_holds_the_text_to_the_schema,
    test_models_by_id_answers_the_served_model_and_404_for_any_other,
    test_neutral_extras_of_openai_and_vllm_clients_are_taken_and_change_nothing,
    test_null_is_the_same_as_leaving_a_field_out,
    test_penalties_and_biases_give_the_offline_greedy_output_on_every_api,
    test_tokenize_and_detokenize_speak_vllms_alignment_calls,
    test_vllm_bench_serve_probe_bodies_stream_tokens_and_usage,
)
from test_openai_tools import (  # noqa: F401 - collected here, through the cluster
    test_a_bad_tool_field_is_a_400_naming_it,
    test_a_named_function_is_called_with_arguments_valid_against_its_schema,
    test_a_streamed_call_accumulates_to_the_whole_responses_call,
)

from halfmoon.bench.probes import grammar_flood

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600)]
# test_http_limits' deadlines are 0.5 s and its checks allow for up to 2 s more; 1 s here keeps
# a loaded machine's slow client of the other families clear of them.
LIMITS_S = 1.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    settings = {
        "mode": "colocated",
        "limits.grammar_builder_at_start": True,
        "server.http_limits.header_timeout_s": LIMITS_S,
        "server.http_limits.body_timeout_s": LIMITS_S,
    }
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        yield cluster, client.model_info().model


@pytest.fixture(scope="module")
def api(cluster) -> RunningApi:
    cluster, model = cluster
    base_url = f"http://127.0.0.1:{cluster.ports['http_port']}/v1"
    return RunningApi(f"127.0.0.1:{cluster.ports['grpc_port']}", base_url, model, loop=None)


@pytest.fixture(scope="module")
def oai(api):
    with openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0) as client:
        yield client


def test_fifty_hostile_grammars_are_answered_fast_and_stall_nothing(cluster):
    flood = grammar_flood.run(cluster[0], small=10, progress=False)
    summary = flood.summary()
    answers = {(a.api, a.answer) for a in flood.answers}
    assert len(flood.answers) == 98 and summary["alive"]
    assert answers <= {
        ("http", "200"),
        ("http", "400"),
        ("grpc", "OK"),
        ("grpc", "INVALID_ARGUMENT"),
    }
    # The goals (1 s, a 100 ms stall) are bench hostile-grammars' figures on a quiet machine;
    # here, beside another test process on two cores, with room for its load (at a load
    # average of 5 the 0.8 s build deadline's refusal once took 2.5 s end to end; what this
    # guards against is the tens of seconds one spec froze serve for before issue 53).
    assert summary["worst_s"] < 4.0, summary
    assert summary["stall_flood_ms"] < 250, summary
    assert summary["small_alongside_ms"]["p50"] < 5 * summary["small_alone_ms"]["p50"] + 200
