"""`servelm serve` with no arguments: the embedded default model on 127.0.0.1:8000."""

from __future__ import annotations

import openai
import pytest

from servelm.cli import build_parser
from servelm.server.launcher import launch_server


def test_serve_defaults_to_localhost_8000_and_the_default_model():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.api_key) == ("127.0.0.1", 8000, None, None)


@pytest.mark.slow
def test_default_model_answers_a_chat():
    server = launch_server(None, ["--max-num-seqs", "4"])  # everything else default (a free port, not 8000)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0,
        )  # fmt: skip
        assert "Paris" in reply.choices[0].message.content
    finally:
        assert server.stop() == 0
