"""`refusion serve --data-parallel-size N`: N engine replicas behind one HTTP front.

Each replica is a `refusion serve` of its own: a process (with --tensor-parallel-size, the
leader of its group) with its own engine and its own share of the cores or its own GPUs,
listening on a Unix socket in a private directory. This process runs only the front. It
sends each request to the replica with the fewest requests in flight and passes the body
and the response through untouched (a stream chunk by chunk); a client that goes away
closes its replica connection, which aborts its rows there. Validation, auth, limits and
error bodies are the replicas' own, so N replicas answer as one server would. The front
answers /health (every replica's, and its own state) and /metrics (every replica's
samples labelled `replica="i"`, and its own gauges of each replica's load).

A replica that exits (killed, or crashed) is started again on the same socket after a
backoff (1 s, doubling with each exit in a row up to 30 s; a replica that has served for
a minute starts again from 1 s), and takes requests once its /health answers 200. One
that exits three times in a row before it was ever ready is not started again (its error
is in the log); when no replica is left running or starting, the front stops, so a
supervisor sees it go.

Shutdown: at the first SIGTERM/SIGINT the front tells every replica to drain (SIGUSR1,
which a replica already draining ignores: systemd, say, signals every process of a
service at once). Each drains as one server does (queued requests 503, running ones
finish within --shutdown-timeout) while the front keeps passing their responses through
and answers new requests with 503 `shutting_down` itself; then the front exits. A
second signal is passed on as it is, and everything exits at once. Replicas run in their
own session, so a terminal's Ctrl-C reaches only the front, and on Linux each is sent
SIGTERM should the front die without a word.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)

from ..errors import ConfigError, ReFusionError
from .http.auth import authorised, unauthorised
from .http.errors import error_response
from .http.limits import read_body
from .loop import REFUSED, ShuttingDown
from .metrics import Counter, Gauge, Registry
from .protocol.errors import APIError, library_error

log = logging.getLogger("refusion.serve")

# headers that describe one connection, not the message: never passed through
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
}
OWN = {"date", "server"}  # a response's own, which the front's server writes
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
# restarting a replica that exited: the first wait, the longest, how long it must have served for
# its next exit to count as the first again, and how many starts in a row may fail before it is left
RESTART_FIRST_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
RESTART_STABLE_SECONDS = 60.0
MAX_FAILED_STARTS = 3


class Replica:
    """One replica process (started again when it exits), its socket, and the front's
    count of its load."""

    def __init__(self, index: int, socket_path: str, cmd: list[str], env: dict[str, str]) -> None:
        self.index, self.socket, self.cmd, self.env = index, socket_path, cmd, env
        self.in_flight = 0
        self.ready = False  # its /health has answered 200 since it was started
        self.ready_since = 0.0
        self.restarts = 0
        self.exits_in_a_row = 0  # exits without a stable run between them: the backoff's exponent
        self.failed_starts = 0  # starts in a row that exited before they were ready
        self.restart_at: float | None = None  # while it is down: when it is started again
        self.left = False  # not started again: it failed to start too often
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, start_new_session=True, preexec_fn=_end_with_parent
        )
        self.ready = False
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket),
            base_url="http://replica",
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0),
        )  # under uvicorn's 5 s

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def mark_ready(self) -> None:
        self.ready, self.ready_since, self.failed_starts = True, time.monotonic(), 0

    def exited(self) -> float | None:
        """Note that the process has exited: the seconds until it is started again, or
        None when it is left (it failed to start `MAX_FAILED_STARTS` times in a row).
        What is left of its session (tensor-parallel ranks) is killed."""
        now = time.monotonic()
        if self.ready and now - self.ready_since >= RESTART_STABLE_SECONDS:
            self.exits_in_a_row = 0
        self.exits_in_a_row += 1
        self.failed_starts = 0 if self.ready else self.failed_starts + 1
        self.ready = False
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.failed_starts >= MAX_FAILED_STARTS:
            self.left = True
            return None
        delay = min(RESTART_MAX_SECONDS, RESTART_FIRST_SECONDS * 2 ** (self.exits_in_a_row - 1))
        self.restart_at = now + delay
        return delay

    def signal(self, sig: int, group: bool = False) -> None:
        """Signal the replica; with `group`, its tensor-parallel ranks too (its session's
        processes: they would otherwise wait in a collective for a leader gone)."""
        if self.alive:
            try:
                os.killpg(self.proc.pid, sig) if group else self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


class FrontMetrics(Registry):
    def __init__(self) -> None:
        super().__init__()
        self.up = self._add(
            Gauge, "refusion_replica_up", "1 while the replica's process runs", labels=("replica",)
        )
        self.in_flight = self._add(
            Gauge,
            "refusion_replica_requests_in_flight",
            "Requests the front has sent to the replica that have not finished",
            labels=("replica",),
        )
        self.dispatched = self._add(
            Counter,
            "refusion_replica_requests_total",
            "Requests the front has sent to the replica",
            labels=("replica",),
        )
        self.restarts = self._add(
            Counter,
            "refusion_replica_restarts_total",
            "Times the front has started the replica again after it exited",
            labels=("replica",),
        )


class ReplicaPool:
    """The replica processes: started together, ready together, stopped together."""

    def __init__(self, replicas: list[Replica], root: str, api_key: str | None = None) -> None:
        self.all, self.root, self.api_key = replicas, root, api_key
        self.metrics = FrontMetrics()
        self.closing = False
        self.all_gone = False  # every replica exited before the front was asked to stop
        for r in replicas:
            self.metrics.dispatched.inc(0, str(r.index))
            self.metrics.restarts.inc(0, str(r.index))

    def pick(self) -> Replica | None:
        """The ready replica with the fewest requests in flight (the lowest index on a tie)."""
        live = [r for r in self.all if r.alive and r.ready]
        return min(live, key=lambda r: r.in_flight) if live else None

    @property
    def drained(self) -> bool:
        """Every replica has exited (after the first signal: its drain is over)."""
        return not any(r.alive for r in self.all)

    async def tend(self) -> None:
        """One round of the front's watch: note replicas that exited (and when each
        starts again), start those whose wait is over, and mark started ones ready once
        their /health answers 200."""
        for r in self.all:
            if self.closing:
                return
            if r.alive:
                if not r.ready and await _answers_health(r):
                    r.mark_ready()
                    if r.restarts:
                        log.warning("replica %d is back (started %d time(s) again)", r.index, r.restarts)
            elif r.left:
                continue
            elif r.restart_at is None:
                self._note_exit(r)
            elif time.monotonic() >= r.restart_at:
                await r.client.aclose()
                r.restart_at = None
                r.restarts += 1
                self.metrics.restarts.inc(1, str(r.index))
                r.start()

    def _note_exit(self, r: Replica) -> None:
        code = r.proc.returncode
        delay = r.exited()
        if delay is None:
            log.error(
                "replica %d exited (code %s) %d times in a row before it was ready: not started again",
                r.index,
                code,
                MAX_FAILED_STARTS,
            )
        else:
            log.warning("replica %d exited (code %s): starting it again in %.0f s", r.index, code, delay)

    @property
    def all_left(self) -> bool:
        """No replica is running or due to start again."""
        return all(r.left for r in self.all)

    def wait_ready(self, poll: float = 0.2) -> None:
        """Block until every replica answers /health with 200; a replica that exits first
        ends the wait with its exit code."""
        waiting = list(self.all)
        while waiting:
            for r in list(waiting):
                if not r.alive:
                    raise ReFusionError(
                        f"replica {r.index} exited with code {r.proc.returncode} before it was ready "
                        "(its error is above)"
                    )
                try:
                    with httpx.Client(transport=httpx.HTTPTransport(uds=r.socket), timeout=2.0) as c:
                        if c.get("http://replica/health").status_code == 200:
                            waiting.remove(r)
                            r.mark_ready()
                except httpx.HTTPError:
                    pass
            if waiting:
                time.sleep(poll)

    def terminate(self, _timeout: float | None = None) -> None:
        """The first signal: every replica begins its drain (once)."""
        if not self.closing:
            self.closing = True
            for r in self.all:
                r.signal(signal.SIGUSR1)

    def exit_now(self, sig: int) -> None:
        """A second signal: passed on, so the replicas (and their ranks) exit at once too."""
        for r in self.all:
            r.signal(sig, group=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def stop(self, wait: float = 10.0) -> None:
        """Terminate the replicas, give them `wait` seconds to drain and exit, kill what is
        left, and remove their sockets' directory."""
        self.terminate()
        deadline = time.monotonic() + wait
        for r in self.all:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("replica %d did not exit in time: killed", r.index)
                r.signal(signal.SIGKILL, group=True)
                r.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    async def aclose(self) -> None:
        for r in self.all:
            await r.client.aclose()


def start_replicas(
    argv: list[str], size: int, tensor_parallel_size: int = 1, device: str = "cpu", api_key: str | None = None
) -> ReplicaPool:
    """Start `size` replicas of the `refusion serve` that `argv` (its arguments after
    `refusion`) describes, each on a socket of its own, with this machine's cores (or
    GPUs, `tensor_parallel_size` each) shared between them."""
    import torch

    gpus = _gpus_per_replica(device, size, tensor_parallel_size)
    root = tempfile.mkdtemp(prefix="refusion-replicas-")  # 0700: only this user reaches the sockets
    threads = max(1, torch.get_num_threads() // size)
    replicas = []
    for i in range(size):
        path = os.path.join(root, f"{i}.sock")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i])
        cmd = [
            sys.executable,
            "-m",
            "refusion.cli",
            *argv,
            "--data-parallel-size",
            "1",
            "--replica-socket",
            path,
        ]
        replicas.append(Replica(i, path, cmd, env))
    return ReplicaPool(replicas, root, api_key)


def _gpus_per_replica(device: str, size: int, tensor_parallel_size: int) -> list[list[str]] | None:
    """Each replica's GPUs (CUDA_VISIBLE_DEVICES), consecutive ones; None on the CPU."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    if str(device) != "cuda":
        raise ConfigError(
            f"--device {device} names one GPU; with --data-parallel-size give --device cuda "
            "(each replica takes GPUs of its own)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [x for x in visible.split(",") if x.strip()]
        if visible
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    need = size * tensor_parallel_size
    if len(ids) < need:
        raise ConfigError(
            f"--data-parallel-size {size} x --tensor-parallel-size {tensor_parallel_size} needs {need} GPUs; "
            f"this machine shows {len(ids)}"
        )
    return [ids[i * tensor_parallel_size : (i + 1) * tensor_parallel_size] for i in range(size)]


def _end_with_parent() -> None:
    """In the replica, before it runs: Linux sends it SIGTERM when the front dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------- the front
def create_front(replicas: ReplicaPool, model_name: str, shutdown_timeout: float = 30.0) -> FastAPI:
    """The HTTP front over started, ready replicas."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.ensure_future(_watch(replicas, app))
        yield
        watcher.cancel()
        # after uvicorn's drain: the replicas had their signal when it began; wait for them
        wait = shutdown_timeout + 10.0
        await asyncio.get_running_loop().run_in_executor(None, replicas.stop, wait)
        await replicas.aclose()

    app = FastAPI(title="ReFusion", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.shutdown_timeout = shutdown_timeout
    app.state.begin_drain, app.state.on_exit_now = replicas.terminate, replicas.exit_now
    app.state.drained = lambda: replicas.drained
    app.state.replicas = replicas

    @app.get("/health")
    async def health() -> JSONResponse:
        states = await asyncio.gather(*(_replica_health(r) for r in replicas.all))
        ok = not replicas.closing and all(s["status"] == "ok" for s in states)
        body = {
            "status": "ok" if ok else "unavailable",
            "model": model_name,
            "queue_length": sum(s.get("queue_length", 0) for s in states),
            "running": sum(s.get("running", 0) for s in states),
            "replicas": states,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        headers = _passed_headers(request.headers.raw)
        answers = await asyncio.gather(*(_replica_metrics(r, headers) for r in replicas.all))
        for answer in answers:
            if (
                isinstance(answer, httpx.Response) and answer.status_code != 200
            ):  # auth refused: the replica's answer
                return Response(
                    answer.content, status_code=answer.status_code, headers=_response_headers(answer)
                )
        for r in replicas.all:
            replicas.metrics.up.set(1 if r.alive and r.ready else 0, str(r.index))
            replicas.metrics.in_flight.set(r.in_flight, str(r.index))
        texts = [
            (str(r.index), a.text) for r, a in zip(replicas.all, answers) if isinstance(a, httpx.Response)
        ]
        body = merge_metrics(texts) + replicas.metrics.render()
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=METHODS)
    async def passed_on(request: Request) -> Response:
        return await _pass_on(request, replicas)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    return app


async def _watch(replicas: ReplicaPool, app: FastAPI, every: float = 0.5) -> None:
    """Start replicas that exited again (`ReplicaPool.tend`), and stop the front when none
    is left running or starting (a supervisor then sees the front exit, and can start it
    again, instead of a front answering 503 for ever)."""
    while not replicas.closing:
        await asyncio.sleep(every)
        await replicas.tend()
        if not replicas.closing and replicas.all_left:
            log.error("every replica has exited: the front stops")
            replicas.all_gone = True
            server = getattr(app.state, "server", None)
            if server is not None:
                server.should_exit = True
            return


async def _answers_health(r: Replica) -> bool:
    try:
        return (await r.client.get("/health", timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


async def _replica_health(r: Replica) -> dict[str, Any]:
    state: dict[str, Any] = {
        "replica": r.index,
        "status": "exited",
        "in_flight": r.in_flight,
        "restarts": r.restarts,
    }
    if not r.alive:
        return {**state, "exit_code": r.proc.returncode}
    if not r.ready:
        return {**state, "status": "starting"}
    try:
        answer = await r.client.get("/health", timeout=5.0)
        body = answer.json()
        return {
            **state,
            "status": body.get("status", "unavailable"),
            "queue_length": body.get("queue_length", 0),
            "running": body.get("running", 0),
        }
    except (httpx.HTTPError, ValueError):
        return {**state, "status": "unavailable"}


async def _replica_metrics(r: Replica, headers: list) -> httpx.Response | None:
    if not r.alive:
        return None
    try:
        return await r.client.get("/metrics", headers=headers, timeout=5.0)
    except httpx.HTTPError:
        return None


def _passed_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.decode("latin-1").lower() not in HOP_BY_HOP]


def _response_headers(answer: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP | OWN}


async def _pass_on(request: Request, replicas: ReplicaPool) -> Response:
    """Send the request to the least-loaded replica and its answer back, as it comes."""
    if not authorised(request.scope, replicas.api_key):  # before reading a body that would be refused
        raise unauthorised()
    if replicas.closing:  # every replica drains: it would refuse the request too, or be gone already
        raise library_error(ShuttingDown(REFUSED))
    body = await read_body(request)
    replica = replicas.pick()
    if replica is None:
        raise APIError(503, "no replica is running", type="server_error", code="no_replica")
    replica.in_flight += 1
    replicas.metrics.dispatched.inc(1, str(replica.index))
    done = [False]

    def release() -> None:
        if not done[0]:
            done[0] = True
            replica.in_flight -= 1

    try:
        raw = request.scope.get("raw_path") or request.url.path.encode()  # as sent: %3F stays %3F
        target = raw.decode("latin-1") + (f"?{request.url.query}" if request.url.query else "")
        upstream = replica.client.build_request(
            request.method, target, headers=_passed_headers(request.headers.raw), content=body
        )
        answer = await _until_disconnect(request, replica.client.send(upstream, stream=True))
    except BaseException as e:
        release()
        if isinstance(e, _ClientGone):
            return Response(status_code=499)
        if isinstance(e, httpx.HTTPError):
            raise APIError(
                503,
                f"replica {replica.index} did not answer ({type(e).__name__}); retry",
                type="server_error",
                code="replica_unavailable",
            ) from None
        raise

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.HTTPError:  # the replica went away mid-answer
            log.warning("replica %d broke off a response", replica.index)
            if not answer.headers.get("content-type", "").startswith("text/event-stream"):
                raise  # the client's connection is cut too, so a partial body does not pass for a whole one
            error = APIError(
                502,
                f"replica {replica.index} stopped during the response",
                type="server_error",
                code="replica_failed",
            )  # a stream ends as the server's own do
            yield f"\n\ndata: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()  # after a cut event
        finally:
            release()
            await answer.aclose()

    return StreamingResponse(relay(), status_code=answer.status_code, headers=_response_headers(answer))


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, awaitable: Any) -> Any:
    """The awaitable's result, unless the client disconnects first (then it is cancelled,
    which closes the replica's connection, and `_ClientGone`). A plain completion's
    response starts only when it is done, so only this would notice a client that left."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        try:
            await work
        except BaseException:
            pass
        raise _ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Replicas' Prometheus texts as one: each family's HELP and TYPE once, then its
    samples from every replica, each labelled replica="i"."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in texts:
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    headers, _ = families.setdefault(family, ([], []))
                    if len(headers) < 2 and line not in headers:
                        headers.append(line)
                continue
            families.setdefault(family or line.split()[0], ([], []))[1].append(_with_label(line, replica))
    return "".join("\n".join(h + s) + "\n" for h, s in families.values())


def _with_label(line: str, replica: str) -> str:
    """A sample line with replica="i" as its first label."""
    own = f'replica="{replica}"'
    name, brace, rest = line.partition("{")
    if brace:
        return f"{name}{{{own}{'' if rest.startswith('}') else ','}{rest}"
    name, _, value = line.partition(" ")
    return f"{name}{{{own}}} {value}"


# ---------------------------------------------------------------------------- the command
def run_front(args: argparse.Namespace, argv: list[str], model_name: str) -> int:
    """`refusion serve ... --data-parallel-size N` in this process: start the replicas,
    wait until each answers, then serve the front until a signal."""
    from .server import make_server

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
        app.state.server = make_server(app, host=args.host, port=args.port, log_level=args.log_level)
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


def served_name(args: argparse.Namespace) -> str:
    """The model id clients use: --served-model-name, else the model directory's name."""
    from ..io import BUNDLED_PREFIX

    if args.served_model_name:
        return args.served_model_name
    if args.model and args.model.startswith(BUNDLED_PREFIX):
        return args.model[len(BUNDLED_PREFIX) :]
    return Path(args.model).name if args.model else "refusion"
