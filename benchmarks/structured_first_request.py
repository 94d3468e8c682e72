"""How long a fresh server's first structured request waits, against the next ones: the grammar
backend is built by the first structured request of an engine process (structured/grammars.py),
so whatever that costs lands in one user's TTFT after every start or restart.

    PYTHONPATH=src .venv/bin/python benchmarks/structured_first_request.py            # a tiny random model
    PYTHONPATH=src .venv/bin/python benchmarks/structured_first_request.py --model DIR

Starts `servelm serve` (one thread, 512 blocks), sends the same json_schema chat request
`--requests` times one after another, prints each one's wall time, and stops the server.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from servelm.server.launcher import launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {"verdict": {"enum": ["heavy", "light"]}, "sorted": {"type": "boolean"}},
    "required": ["verdict", "sorted"],
    "additionalProperties": False,
}
BODY = {
    "messages": [{"role": "user", "content": "Is this list sorted? 3 1 2 " * 10}],
    "max_completion_tokens": 40,
    "temperature": 0,
    "response_format": {"type": "json_schema", "json_schema": {"name": "report", "schema": SCHEMA, "strict": True}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: a tiny random Llama written to a temp dir)")
    parser.add_argument("--requests", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(write_tiny_checkpoint(Path(scratch) / "model", seed=0))
        with launch_server(model, ["--num-threads", "1", "--num-blocks", "512"]) as server:
            for i in range(args.requests):
                started = time.perf_counter()
                response = httpx.post(f"{server.base_url}/v1/chat/completions", json=BODY, timeout=300)
                seconds = time.perf_counter() - started
                response.raise_for_status()
                text = response.json()["choices"][0]["message"]["content"]
                print(f"request {i + 1}: {seconds:.2f} s  {text}")


if __name__ == "__main__":
    main()
