"""Fixtures of the API tests: one in-process OpenAI server (over a LocalBackend) per module
that asks for it, the official `openai` client pointed at it, and likewise one gRPC server."""

from __future__ import annotations

import openai
import pytest
from grpc_testkit import serve_model
from http_testkit import serve_openai


@pytest.fixture(scope="module")
def api(tiny_model_dir):
    with serve_openai(tiny_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def oai(api):
    with openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_model(tiny_model_dir) as running:
        yield running
