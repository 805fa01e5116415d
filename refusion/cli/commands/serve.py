"""`refusion serve [MODEL]`: an OpenAI-compatible HTTP server (see `refusion.serve`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from ...errors import MissingExtraError, ReFusionError
from ..flags import (
    add_data_parallel_argument,
    add_decode_arguments,
    add_model_arguments,
    add_server_limit_arguments,
    check_mask_before_load,
    decode_config_from_args,
    engine_config_from_args,
    load_from_args,
    server_limits_from_args,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", metavar="MODEL", help="model (default: the bundled model)")
    add_model_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)"
    )
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients use (default: the model directory's name)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("REFUSION_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $REFUSION_API_KEY; none = no auth)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="completions that may wait to join the batch; more get 429 (default: 256)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests get to finish before they are cut "
        "(new and queued ones get 503 at once; a second signal exits now) (default: 30)",
    )
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_data_parallel_argument(g, "behind this one address; each request goes to the least-loaded")
    g.add_argument(
        "--replica-socket", default=None, help=argparse.SUPPRESS
    )  # a replica: serve on this Unix socket
    add_server_limit_arguments(parser)
    add_decode_arguments(parser)


def _check_web_stack() -> None:
    """The `serve` extra, asked for by name before anything else loads."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"refusion serve needs {' and '.join(missing)} (the serve extra): "
            "scripts/setup.sh serve in a checkout, or pip install 'refusion[serve]'"
        )


def run(args: argparse.Namespace) -> int:
    _check_web_stack()
    from ...serve import serve  # the web stack loads only when this verb runs

    args.model = args.model or args.model_pos
    _check_flags(args)
    engine_cfg = engine_config_from_args(args)
    model, tokenizer = load_from_args(args)
    cfg = decode_config_from_args(args, model=model)
    serve(
        model,
        tokenizer,
        cfg,
        engine_config=engine_cfg,
        host=args.host,
        port=args.port,
        model_name=served_name(args),
        api_key=args.api_key,
        max_queue=args.max_queue,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        uds=args.replica_socket,
        limits=server_limits_from_args(args),
    )
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """Bad flags fail before a model loads (or a replica starts)."""
    if args.max_queue < 1 or args.shutdown_timeout < 0:
        raise ReFusionError("--max-queue must be >= 1 and --shutdown-timeout >= 0")
    if args.data_parallel_size < 1:
        raise ReFusionError("--data-parallel-size takes a positive number")
    from ...serve.http.auth import check_api_key

    check_api_key(args.api_key)
    decode_config_from_args(args)
    engine_config_from_args(args)
    server_limits_from_args(args)
    check_mask_before_load(args)  # a method the checkpoint cannot decode, before its weights load


def run_replicas(args: argparse.Namespace) -> int:
    """`--data-parallel-size N`: this process is the front of N replicas."""
    _check_web_stack()
    from ...serve.replicas.run import run_front

    args.model = args.model or args.model_pos
    _check_flags(args)
    return run_front(args, args._argv, served_name(args), server_limits_from_args(args))


def served_name(args: argparse.Namespace) -> str:
    """The model id clients use: --served-model-name, else the model directory's name."""
    from ...io import BUNDLED_PREFIX

    if args.served_model_name:
        return args.served_model_name
    if args.model and args.model.startswith(BUNDLED_PREFIX):
        return args.model[len(BUNDLED_PREFIX) :]
    return Path(args.model).name if args.model else "refusion"
