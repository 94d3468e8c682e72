"""The router's own answers, in process (its lifespan run by Starlette's test client): OpenAI's
error shape for routes and methods it does not have, and a Retry-After on its 503 when no
replica is in rotation (a replica address nothing listens on)."""

from __future__ import annotations

import socket

import pytest
from starlette.testclient import TestClient

from servelm.router.app import RouterServerOptions, create_router_app
from servelm.router.replicas import ReplicaSpec
from servelm.router.state import RouterOptions


@pytest.fixture(scope="module")
def client():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]  # closed again: nothing listens there
    options = RouterServerOptions(replicas=[ReplicaSpec.parse(f"http://127.0.0.1:{dead}")])
    with TestClient(create_router_app(RouterOptions(policy="round_robin"), options)) as test_client:
        yield test_client


def _error(response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("method, path, status", [("POST", "/v1/embeddings", 404), ("GET", "/", 404),
                                                  ("GET", "/v1/chat/completions", 405)])  # fmt: skip
def test_unknown_routes_and_methods_answer_in_openais_error_shape(client, method, path, status):
    response = client.request(method, path)
    assert response.status_code == status
    assert _error(response)["type"] == "invalid_request_error"


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"), ("POST", "/tokenize"), ("GET", "/v1/models")])
def test_no_replica_in_rotation_is_a_503_that_says_when_to_retry(client, method, path):
    response = client.request(method, path, json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert _error(response)["code"] == "no_replica_available"
