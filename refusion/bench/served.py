"""`refusion bench served [MODEL]`: the server at one client against the engine with fixed
draft widths, on the same prompts with the same settings, interleaved.

A server chooses draft widths as the batch goes (`EngineConfig.adaptive_drafts`, on by
default), from measurements pooled over every request it has decoded; `refusion generate`
decodes a prompt alone. This starts `refusion serve` (adaptive widths, as a user starts it),
optionally loads it with many clients first (`--load-clients`: the measurements a busy
server carries into a quiet moment), then sends each prompt to the server as its one
client and decodes it in this process with fixed widths, one after the other, and prints
both's forwards, tokens, TPF and tokens/s side by side. The server's forwards are read
from its `/metrics` (`refusion_forward_passes_total`) before and after each request; its
tokens/s include the HTTP round trip, the engine's do not. The client keeps one
connection open, as an OpenAI client does: an HTTP client made per request (its TLS
context, its connection) cost more than the server's own work on each request.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from ..cli.flags import add_model_arguments, load_from_args
from .decode import bench_prompts
from .results import add_results_argument, writes_results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_pos", nargs="?", metavar="MODEL")
    add_model_arguments(parser)
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the bundled suite (default: 8)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts (default: 2)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens a request (default: 128)")
    parser.add_argument(
        "--max-batch-size", type=int, default=32, help="the server's --max-batch-size (default: 32)"
    )
    parser.add_argument(
        "--load-clients",
        type=int,
        default=0,
        help="before each round, this many streaming clients load the server for --load-seconds "
        "(default: 0, none)",
    )
    parser.add_argument("--load-seconds", type=float, default=10.0, help="(default: 10)")
    add_results_argument(parser, "widths.md")


@writes_results
def run(args: argparse.Namespace) -> int:
    from ..decode import Engine, EngineConfig

    args.model = args.model or args.model_pos
    model, tokenizer = load_from_args(args)
    fixed = Engine(model, tokenizer, EngineConfig(adaptive_drafts=False))
    prompts = bench_prompts(args.prompts)
    import httpx

    with served(args) as url, httpx.Client(base_url=url, timeout=300) as client:
        rows: dict[str, list[dict[str, float]]] = {"served": [], "fixed": []}
        for _ in range(args.rounds):
            if args.load_clients:
                load(url, args)
            for p in prompts:
                rows["served"].append(ask(client, p, args.max_tokens))
                rows["fixed"].append(decode(fixed, p, args.max_tokens))
        info = _get(client, "/playground/settings")["draft_widths"]["in_force"]
    report(rows, info, args)
    return 0


class served:
    """`refusion serve` in a child process on a free port, for the length of a `with`."""

    def __init__(self, args: argparse.Namespace) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        model = ["--model", args.model] if args.model else []
        self.argv = [sys.executable, "-m", "refusion.cli", "serve", *model, "--port", str(self.port)]
        self.argv += ["--max-batch-size", str(args.max_batch_size), "--log-level", "warning"]

    def __enter__(self) -> str:
        import httpx

        self.proc = subprocess.Popen(self.argv)
        url = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"the server did not start: {' '.join(self.argv)}")

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _get(client: Any, path: str) -> Any:
    r = client.get(path, timeout=30)
    return r.json() if path != "/metrics" else r.text


def forwards(client: Any) -> int:
    """The server's forward passes so far (`client`: an httpx.Client on the server)."""
    for line in _get(client, "/metrics").splitlines():
        if line.startswith("refusion_forward_passes_total "):
            return int(float(line.split()[1]))
    raise RuntimeError("the server's /metrics has no refusion_forward_passes_total")


def ask(client: Any, prompt: str, max_tokens: int) -> dict[str, float]:
    """One chat completion from the server, alone: its tokens, forwards and seconds
    (`client`: an httpx.Client on the server, its connection kept open between requests)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    before, t0 = forwards(client), time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return {"tokens": r.json()["usage"]["completion_tokens"], "nfe": forwards(client) - before, "s": seconds}


def decode(engine: Any, prompt: str, max_tokens: int) -> dict[str, float]:
    """The same request decoded by `engine` alone, as `refusion generate` does."""
    ready = engine.prepare([{"role": "user", "content": prompt}], length=max_tokens, lower=True)
    t0 = time.perf_counter()
    engine.add_request(ready, stream=False)
    out = None
    while engine.has_unfinished():
        out = next((o for o in engine.step() if o.finished), out)
    assert out is not None
    return {"tokens": len(out.token_ids), "nfe": out.stats.nfe, "s": time.perf_counter() - t0}


def load(url: str, args: argparse.Namespace) -> None:
    """The load test's phase of --load-clients streaming clients (it prints its line)."""
    from ..serve.loadtest import main as loadtest

    seconds, tokens = str(args.load_seconds), str(args.max_tokens)
    argv = ["--url", url, "--suite", "--clients", str(args.load_clients), "--seconds", seconds]
    loadtest([*argv, "--max-tokens", tokens])


def report(rows: dict[str, list[dict[str, float]]], widths: str, args: argparse.Namespace) -> None:
    """Per prompt and in total: forwards, tokens, TPF, tokens/s of each side."""
    print(f"server: refusion serve --max-batch-size {args.max_batch_size}, one client; draft widths {widths}")
    print("engine: Engine(EngineConfig(adaptive_drafts=False)), one request at a time (refusion generate)")
    print(f"{len(rows['fixed'])} requests ({args.rounds} rounds of {args.prompts} prompts), interleaved\n")
    print("| | forwards | tokens | TPF | tokens/s (median of requests) |")
    print("|---|---|---|---|---|")
    for side, label in (("served", "server, one client"), ("fixed", "engine, fixed widths")):
        rs = rows[side]
        nfe, toks = sum(r["nfe"] for r in rs), sum(r["tokens"] for r in rs)
        tps = statistics.median(r["tokens"] / r["s"] for r in rs)
        print(f"| {label} | {nfe:.0f} | {toks:.0f} | {toks / max(nfe, 1):.2f} | {tps:.1f} |")
    same = sum(a["nfe"] == b["nfe"] for a, b in zip(rows["served"], rows["fixed"]))
    ratio = statistics.median(
        (a["tokens"] / a["s"]) / (b["tokens"] / b["s"]) for a, b in zip(rows["served"], rows["fixed"])
    )
    print(f"\nrequests with the same forwards on both sides: {same} of {len(rows['fixed'])}")
    print(f"server tokens/s over the engine's, median of the requests' own ratios: {ratio:.2f}x")
