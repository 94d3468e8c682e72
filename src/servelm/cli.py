"""`servelm serve | generate | bench | router | cluster | diagnose | manifest | pull`: the command line.

Engine flags are shared by every subcommand that runs an engine; each maps onto one
field of one config slice (see servelm.config).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from servelm.config import GEMM_PRECISIONS, EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None,
        help="HF model directory or .gguf file (default: embedded SmolLM2), or a remote one it is pulled from while "
        "loading: http(s)://HOST/PATH/, s3://BUCKET/PREFIX/ or peer://HOST:PORT (a running servelm replica)",
    )  # fmt: skip
    group.add_argument(
        "--download-dir", default=None, help="where a remote --model is pulled to (default: ~/.cache/servelm/models)"
    )
    group.add_argument("--pull-connections", type=int, default=None, help="parallel reads of a remote --model (default 8)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    group.add_argument(
        "--attention-backend", default=None, choices=["auto", "torch", "triton"],
        help="attention kernels: auto (triton on CUDA, torch elsewhere), torch (the reference) or triton",
    )  # fmt: skip
    group.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    group.add_argument("--num-threads", type=int, default=None, help="torch CPU threads for the engine core")
    group.add_argument(
        "--gemm-precision", default=None, choices=GEMM_PRECISIONS,
        help="CPU float32 models: what prefill's matmuls compute in (default float32, exact); bfloat16 is faster "
        "where the CPU has AMX / AVX512-BF16, at a measured logit error (benchmarks/RESULTS.md)",
    )  # fmt: skip
    group.add_argument(
        "--keep-warm-s", type=float, default=None,
        help="CPU: seconds between reads of every page of the weights (the KV pool: 5x that), keeping them warm "
        "where a VM's host lets memory left unread go cold (default 1; 0 = off)",
    )  # fmt: skip
    group.add_argument(
        "--hf-overrides", type=json.loads, default=None,
        help='JSON of Hugging Face config keys replacing the checkpoint\'s, e.g. \'{"rope_scaling": {"rope_type": '
        '"linear", "factor": 2.0}, "max_position_embeddings": 16384}\'',
    )  # fmt: skip
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--kv-cache-memory", type=float, default=None, dest="kv_cache_memory_gib", help="GiB for KV")
    group.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    group.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="CUDA: fraction of the device's memory to use in all; the KV cache gets what the weights, a profiled "
        "worst-case step and a reserve leave (default 0.9; ignored with --kv-cache-memory or --num-blocks)",
    )  # fmt: skip
    group.add_argument("--no-prefix-caching", action="store_false", dest="enable_prefix_caching")
    group.add_argument(
        "--kv-cache-dtype", default=None, choices=["auto", "int8", "fp8"],
        help="KV cache storage: auto (the model's dtype), int8 or fp8 (scaled per token and head; fewer bytes per block)",
    )  # fmt: skip
    group.add_argument(
        "--kv-offloading-size", type=float, default=None,
        help="GiB of host memory for KV blocks beyond the pool (L2): prefixes evicted from the pool are loaded back, not recomputed",
    )  # fmt: skip
    group.add_argument(
        "--kv-disk-path", default=None,
        help="directory for KV blocks on disk (L3): survives restarts; replicas of one model may share it",
    )  # fmt: skip
    group.add_argument("--kv-disk-size", type=float, default=None, help="GiB of KV on disk at most (default 16)")
    group.add_argument(
        "--kv-load-policy", default=None, choices=["cost", "always"],
        help="KV found in host memory or on disk: cost (load a block while its tier's measured bandwidth beats "
        "computing it; default) or always (load every block found)",
    )  # fmt: skip
    group.add_argument(
        "--kv-role", default=None, choices=["prefill", "decode", "both"],
        help="prefill/decode disaggregation: prefill (compute prompts, serve their KV), decode (pull it, then "
        "decode) or both; the router sends requests' kv_transfer_params (default: no disaggregation)",
    )  # fmt: skip
    group.add_argument(
        "--kv-transfer-port", type=int, default=None, help="prefill: the KV transfer server's port (default: any free)"
    )  # fmt: skip
    group.add_argument(
        "--kv-transfer-host", default=None, help="prefill: the KV transfer server's address (default 127.0.0.1)"
    )
    group.add_argument(
        "--kv-transfer-hold-s", type=float, default=None,
        help="prefill: seconds a prompt's KV waits for its pull after the prefill, then is dropped (default 30)",
    )  # fmt: skip
    group.add_argument(
        "--kv-transfer-wait-s", type=float, default=None,
        help="decode: seconds a pull waits for a silent peer before computing itself (default 5)",
    )  # fmt: skip
    group.add_argument(
        "--kv-transfer-timeout-s", type=float, default=None,
        help="decode: seconds a whole pull may take, the prefill included (default 120)",
    )  # fmt: skip
    group.add_argument(
        "--kv-transfer-max-reserved-blocks", type=int, default=None,
        help="decode: most KV blocks held by pulls in flight (default: half the pool)",
    )  # fmt: skip
    group.add_argument(
        "--kv-transfer-peers", default=None, type=_comma_list,
        help="decode: prefill servers' transfer addresses (tcp://HOST:PORT,...) to connect at start-up",
    )  # fmt: skip
    group.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=None,
        help="ranks the weights are split over (heads, MLP columns, vocabulary); torch.distributed",
    )  # fmt: skip
    group.add_argument(
        "--context-parallel-size", "-cp", type=int, default=None,
        help="ranks each request's tokens and KV are split over (long prompts; ring attention)",
    )  # fmt: skip
    group.add_argument(
        "--distributed-timeout-s", type=float, default=None,
        help="seconds a collective may take before a silent rank counts as dead (default 60)",
    )  # fmt: skip
    group.add_argument(
        "--threads-per-rank", type=int, default=None,
        help="torch threads of each rank with -tp/-cp (default: the cores split over the ranks)",
    )  # fmt: skip
    group.add_argument(
        "--no-shm-collectives", action="store_false", dest="shared_memory_collectives", default=None,
        help="with -tp/-cp on CPU, send every collective over gloo (default: small ones through shared memory)",
    )  # fmt: skip
    group.add_argument(
        "--enforce-eager", action="store_true", default=None,
        help="never use CUDA graphs (default: pure-decode steps replay them on CUDA with a graph-capturable backend)",
    )  # fmt: skip
    group.add_argument(
        "--max-cudagraph-capture-size", type=int, default=None,
        help="largest decode batch a CUDA graph serves; larger ones run eagerly (default: min(--max-num-seqs, 512))",
    )  # fmt: skip
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    group.add_argument("--max-num-seqs", type=int, default=None, help="requests per step at most")
    group.add_argument(
        "--max-num-partial-prefills", type=int, default=None,
        help="prompts one step may leave unfinished (several long prompts mid-prefill at once)",
    )  # fmt: skip
    group.add_argument(
        "--max-long-partial-prefills", type=int, default=None,
        help="... of them longer than --long-prefill-token-threshold",
    )  # fmt: skip
    group.add_argument(
        "--long-prefill-token-threshold", type=int, default=None,
        help="chunk cap for a prompt while others want the budget (default: budget / max-num-partial-prefills; 0 = none)",
    )  # fmt: skip
    group.add_argument(
        "--aging-s", type=float, default=None,
        help="seconds of waiting after which a request's priority improves by one class (0 = no aging)",
    )  # fmt: skip
    group.add_argument(
        "--max-step-ms", "--arrival-wait-ms", dest="max_step_ms", type=float, default=None,
        help="step-time target (ms): every step's work is sized to end within it, so a request arriving mid-step "
        "waits at most about that long (default: 10x the fixed part of a prompt step, measured at start-up; "
        "0 = no bound). --arrival-wait-ms is an older name for it",
    )  # fmt: skip
    group.add_argument(
        "--no-layered-prefill", dest="layered_prefill", action="store_false", default=None,
        help="cut long prompts into token chunks only (default: a chunk the step-time target would make too small "
        "to run efficiently runs a few layers a step instead)",
    )  # fmt: skip
    group.add_argument(
        "--speculative-config", default=None,
        help='speculative decoding, JSON in vLLM\'s shape, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' '
        "(methods: ngram, suffix, draft; off when not given)",
    )  # fmt: skip


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    flat = {
        name: getattr(args, name, None)
        for name in (
            "dtype",
            "device",
            "attention_backend",
            "max_model_len",
            "num_threads",
            "gemm_precision",
            "keep_warm_s",
            "hf_overrides",
            "download_dir",
            "pull_connections",
            "block_size",
            "kv_cache_memory_gib",
            "num_blocks",
            "gpu_memory_utilization",
            "enable_prefix_caching",
            "kv_cache_dtype",
            "kv_offloading_size",
            "kv_disk_path",
            "kv_disk_size",
            "kv_load_policy",
            "kv_role",
            "kv_transfer_host",
            "kv_transfer_port",
            "kv_transfer_hold_s",
            "kv_transfer_wait_s",
            "kv_transfer_timeout_s",
            "kv_transfer_max_reserved_blocks",
            "kv_transfer_peers",
            "tensor_parallel_size",
            "context_parallel_size",
            "distributed_timeout_s",
            "threads_per_rank",
            "shared_memory_collectives",
            "enforce_eager",
            "max_cudagraph_capture_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_num_partial_prefills",
            "max_long_partial_prefills",
            "long_prefill_token_threshold",
            "aging_s",
            "max_step_ms",
            "layered_prefill",
            "kv_events_port",
            "kv_events_host",
            "speculative_config",
        )
        if getattr(args, name, None) is not None
    }
    return EngineConfig.from_flat(model=args.model, **flat)


def _generate(args: argparse.Namespace) -> int:
    from servelm.engine.llm import LLM
    from servelm.sampling_params import SamplingParams

    llm = LLM(config=engine_config_from_args(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    for prompt in prompts:
        token_ids = llm.chat_prompt([{"role": "user", "content": prompt}]) if args.chat else None
        [result] = llm.generate([token_ids if token_ids is not None else prompt], params)
        print(result.outputs[0].text, flush=True)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from servelm.engine.async_client import prestart_core_process

    prestart_core_process()  # it imports torch and the model code while this process imports the server
    from servelm.server.app import run_server

    return run_server(engine_config_from_args(args), args)


@contextlib.contextmanager
def _launch_server(model: str | None, extra_args: list[str]) -> Iterator[str]:
    """`servelm bench scenario`'s server: a `servelm serve` subprocess, its URL while it runs."""
    from servelm.server.launcher import launch_server

    with launch_server(model, extra_args) as server:
        yield server.base_url


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servelm", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    from servelm.openai_api.overload import add_overload_arguments  # argparse only

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require this bearer token (or env SERVELM_API_KEY)")
    serve.add_argument(
        "--tenants", type=Path, default=None, metavar="FILE",
        help="tenants YAML: API keys, SLO classes, per-tenant limits (README, deploy/tenants.example.yaml)",
    )  # fmt: skip
    serve.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key (PEM)")
    serve.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate chain (PEM)")
    serve.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-waiting-requests", type=int, default=1024, help="beyond this, 429")
    add_overload_arguments(serve)
    serve.add_argument(
        "--max-stream-backlog", type=int, default=4096, metavar="N",
        help="cut a stream (and abort its request) once N engine outputs wait for its client (0: no bound)",
    )  # fmt: skip
    serve.add_argument(
        "--max-request-body-mb", type=float, default=32.0, dest="max_request_body_mb",
        help="larger request bodies get 413 before they are parsed",
    )  # fmt: skip
    serve.add_argument(
        "--protect-metrics", action="store_true", default=None,
        help="put /metrics behind --api-key too (default: open, as vLLM does, for Prometheus)",
    )  # fmt: skip
    serve.add_argument("--log-requests", action="store_true", help="one JSON timeline line per request")
    serve.add_argument(
        "--shutdown-timeout", type=int, default=30, dest="shutdown_timeout_s",
        help="on SIGTERM, seconds in-flight requests may take to finish before they are cut",
    )  # fmt: skip
    serve.add_argument(
        "--tokenizer-threads", type=int, default=2, help="threads that tokenize prompts off the event loop"
    )
    serve.add_argument(
        "--max-engine-restarts", type=int, default=3,
        help="restart a dead engine core at most this often within --engine-restart-window-s (backoff 1 s, "
        "doubling), then stay down with /live and /health 503 (0: never restart)",
    )  # fmt: skip
    serve.add_argument("--engine-restart-window-s", type=float, default=300.0,
                       help="crashes older than this many seconds no longer count against --max-engine-restarts")  # fmt: skip
    serve.add_argument(
        "--kv-events-port", type=int, default=None,
        help="publish KV-cache events for a router: PUB on tcp://HOST:P, snapshots on P+1",
    )  # fmt: skip
    serve.add_argument(
        "--kv-events-host", default=None,
        help="address the KV-event sockets bind (default 127.0.0.1; a pod's IP or 0.0.0.0 for a router elsewhere)",
    )  # fmt: skip
    serve.set_defaults(handler=_serve)

    generate = sub.add_parser("generate", help="one-shot generation (prompts from --prompt or stdin)")
    add_engine_arguments(generate)
    generate.add_argument("--prompt", action="append", help="may repeat; default: one prompt per stdin line")
    generate.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.set_defaults(handler=_generate)

    from servelm.bench.cli import add_bench_parser  # argparse only: the bench's own imports wait for its handlers

    add_bench_parser(sub, launch_server=_launch_server)

    from servelm.cluster.cli import add_cluster_parser  # argparse only, like bench
    from servelm.diagnose.cli import add_diagnose_parser  # argparse only, like bench
    from servelm.router.cli import add_router_parser

    add_router_parser(sub)
    add_cluster_parser(sub)
    add_diagnose_parser(sub)

    from servelm.delivery import commands as delivery  # argparse only, like bench

    manifest = sub.add_parser("manifest", help="write DIR/servelm-manifest.json (per-chunk sha256) for `servelm pull`")
    delivery.add_manifest_arguments(manifest)
    manifest.set_defaults(handler=delivery.manifest_command)
    pull = sub.add_parser("pull", help="fetch a model (path, http(s)://, s3://, peer://) into a directory, verified")
    delivery.add_pull_arguments(pull)
    pull.set_defaults(handler=delivery.pull_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
