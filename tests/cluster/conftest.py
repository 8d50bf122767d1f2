"""Fixtures of the HTTP API tests: one in-process OpenAI server (over a LocalBackend) per module
that asks for it, and the official `openai` client pointed at it."""

from __future__ import annotations

import openai
import pytest
from http_testkit import serve_openai


@pytest.fixture(scope="module")
def api(tiny_model_dir):
    with serve_openai(tiny_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def oai(api):
    with openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0) as client:
        yield client
