"""`servelm serve | run-batch | generate | bench | router | cluster | diagnose | simulate | manifest | pull`: the command line.

Engine flags are shared by every subcommand that runs an engine; each is declared once, in the
config slice it sets (servelm.config: FLAGS), and grouped by slice in --help.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from servelm.config import FLAG_SLICES, EngineConfig
from servelm.server.tool_parsers import TOOL_CALL_PARSERS


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Every engine flag, as its config slice declares it (servelm.config: each slice's FLAGS),
    one --help group per slice. Unset, a flag passes nothing: the slice's default holds."""
    for heading, config_slice in FLAG_SLICES:
        group = parser.add_argument_group(f"engine: {heading}")
        for flag in config_slice.FLAGS:
            options: dict[str, Any] = {"dest": flag.setting, "default": None, "help": flag.help}
            if flag.action is not None:
                options["action"] = flag.action
            else:
                options.update(type=flag.type, choices=flag.choices)
                if flag.nargs is not None:
                    options["nargs"] = flag.nargs
            group.add_argument(*flag.names, **options)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given (add_engine_arguments) as EngineConfig.from_flat keywords."""
    settings = (flag.setting for _, config_slice in FLAG_SLICES for flag in config_slice.FLAGS)
    return {name: value for name in settings if (value := getattr(args, name, None)) is not None}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the engine flags given (add_engine_arguments), each to its slice."""
    return EngineConfig.from_flat(**engine_settings(args))


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


def _run_batch(args: argparse.Namespace) -> int:
    from servelm.server.run_batch import RunBatchOptions, run_batch

    return run_batch(engine_config_from_args(args), RunBatchOptions(args.input_file, args.output_file, args.data_dir))


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
        "--tool-call-parser", choices=[*TOOL_CALL_PARSERS, "none"], default="hermes",
        help="how tool calls are read from a tool_choice \"auto\" reply (vLLM's names; default hermes, the format "
        "a model whose chat template has no tools is shown them in); none: replies stay text",
    )  # fmt: skip
    serve.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="accepted for vLLM's command lines: tool_choice \"auto\" is on unless --tool-call-parser none",
    )  # fmt: skip
    serve.add_argument(
        "--max-engine-restarts", type=int, default=3,
        help="restart a dead engine core at most this often within --engine-restart-window-s (backoff 1 s, "
        "doubling), then stay down with /live and /health 503 (0: never restart)",
    )  # fmt: skip
    serve.add_argument("--engine-restart-window-s", type=float, default=300.0,
                       help="crashes older than this many seconds no longer count against --max-engine-restarts")  # fmt: skip
    from servelm.batch.arguments import add_batch_arguments  # argparse only

    add_batch_arguments(serve)
    serve.set_defaults(handler=_serve)

    run_batch = sub.add_parser("run-batch", help="an OpenAI batch input file (JSONL) through the engine offline, "
                                                 "resumable: every line's result, in input order")  # fmt: skip
    add_engine_arguments(run_batch)
    run_batch.add_argument("-i", "--input-file", required=True, help="the input JSONL: a path or an http(s) URL")
    run_batch.add_argument("-o", "--output-file", required=True, type=Path, help="where the results go")
    run_batch.add_argument("--data-dir", type=Path, default=None,
                           help="where progress is kept for resuming (default: the user's data directory, run-batch/)")  # fmt: skip
    run_batch.set_defaults(handler=_run_batch)

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

    from servelm.simulate.cli import add_simulate_parser  # argparse only, like bench

    add_simulate_parser(sub, add_engine_arguments, engine_settings)

    from servelm.delivery import commands as delivery  # argparse only, like bench

    manifest = sub.add_parser("manifest", help="write DIR/servelm-manifest.json (per-chunk sha256) for `servelm pull`")
    delivery.add_manifest_arguments(manifest)
    manifest.set_defaults(handler=delivery.manifest_command)
    pull = sub.add_parser("pull", help="fetch a model (path, http(s)://, s3://, peer://) into a directory, verified")
    delivery.add_pull_arguments(pull)
    pull.set_defaults(handler=delivery.pull_command)
    plan = sub.add_parser("plan", help="from a config.json alone: parameters (total, active), weight bytes per dtype, "
                                       "KV bytes per token, the smallest GPU layout that holds it")  # fmt: skip
    plan.add_argument("config", help="a config.json, or a directory holding one")
    plan.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default 80: an H100; 141: an H200)")
    plan.add_argument("--kv-tokens", type=int, default=32768, help="KV tokens each data-parallel rank must hold (default 32768)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="the most GPUs tensor parallelism spans (default 8)")
    plan.set_defaults(handler=_plan_command)
    return parser


def _plan_command(args: argparse.Namespace) -> int:
    from servelm.models.plan import load_config, report

    print(report(load_config(args.config), args.gpu_memory_gib, args.kv_tokens, args.gpus_per_node))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
