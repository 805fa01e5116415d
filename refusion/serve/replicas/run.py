"""The command: `refusion serve ... --data-parallel-size N` runs the front in this process."""

from __future__ import annotations

import argparse
import socket
import sys

from ...errors import ReFusionError
from ...settings.serve import ServerLimits
from ..server import make_server
from .front import create_front
from .pool import start_replicas


def run_front(args: argparse.Namespace, argv: list[str], model_name: str, limits: ServerLimits) -> int:
    """`refusion serve ... --data-parallel-size N` in this process: start the replicas,
    wait until each answers, then serve the front until a signal, with `limits` on the
    clients' connections."""
    size, split = args.data_parallel_size, args.tensor_parallel_size or 1
    sock = _listen(args.host, args.port)  # a taken port fails before N models load
    print(
        f"refusion serve: starting {size} replicas"
        + (f" of {split} ranks each" if split > 1 else "")
        + " ...",
        file=sys.stderr,
        flush=True,
    )
    replicas = start_replicas(argv, size, split, args.device, args.api_key)
    try:
        replicas.wait_ready()
        print(f"refusion serve: {size} replicas ready", file=sys.stderr, flush=True)
        app = create_front(replicas, model_name, args.shutdown_timeout)
        app.state.server = make_server(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            limits=limits,
        )
        app.state.server.run(sockets=[sock])
    finally:
        replicas.stop()  # a replica that failed, a front that failed to start: no replica is left behind
        sock.close()
    if replicas.all_gone:
        codes = ", ".join(str(r.proc.returncode) for r in replicas.all)
        raise ReFusionError(
            f"every replica exited (exit codes {codes}; their errors are above), so the front stopped"
        )
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """The front's listening socket, bound now."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ReFusionError(
            f"cannot listen on {host}:{port} ({e.strerror or e}): pass --port with a free port "
            "(or --host with an address of this machine)"
        ) from None
    return sock
