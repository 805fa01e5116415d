"""Load test for `refusion serve`: N concurrent streaming clients for a bounded time.

    python -m refusion.serve.loadtest --url http://127.0.0.1:8000 --clients 32 --seconds 60 --pid PID
    python -m refusion.serve.loadtest --url http://127.0.0.1:8000 --compare 1,16 --seconds 30
    python -m refusion.serve.loadtest --compare 1,16,32 --methods ar,refusion --suite --max-tokens 128

Each client sends streamed chat completions back to back (prompts taken in turn from a
fixed list, so runs compare; `--suite`: the bundled suite's held-out prompts) until the
time is up; requests in flight then finish. It
reports requests/s, completion tokens/s (from the usage the server streams), latency and
time-to-first-token percentiles, errors by kind, responses that ended without a
finish_reason or `[DONE]`, and with --pid the server's resident memory before and after.
--compare runs one phase per client count, same prompts, and prints the tokens/s ratio;
`--compare same,mixed` instead runs --clients clients twice: all with the same settings,
then each client with its own (`MIXED`: methods, thresholds, slot sizes, sampling), which
the server batches together. `--methods ar,refusion` runs each client count once per
method (the request's `method`, the rest from the checkpoint's settings) and prints, per
count, the second method's tokens/s over the first's. --rounds N repeats the phases
interleaved and reports each phase's median round; a method ratio is then the median of
each round's own ratio. `--against URL`: a second server (other code, other flags) takes
each phase right after the first, and a table sets their figures side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..model.sizing import process_memory_kib
from ..timing import median_ratio

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did she sell altogether?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers larger than 100.",
    "Translate 'good morning, how are you?' into French.",
    "What is 17 times 23? Think step by step.",
    "Summarise the plot of a heist movie in one paragraph.",
    "Give a haiku about autumn rain.",
]


# per-client decode settings for the `mixed` phase (client k takes MIXED[k % len(MIXED)])
MIXED: list[dict[str, Any]] = [
    {},
    {"slot_threshold": 0.7, "token_threshold": 0.3},
    {"slot_size": 4, "serial_blocks": 2},
    {"method": "ar"},
    {"temperature": 0.7, "seed": 1},
    {"slot_size": 16, "slot_threshold": 0.8},
    {"slot_threshold": 0.5, "token_threshold": 0.5, "serial_blocks": 4},
    {"temperature": 1.0, "top_p": 0.9, "seed": 2},
]


@dataclass
class Phase:
    clients: int
    seconds: float
    label: str = ""
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: int = 0
    incomplete: int = 0
    errors: Counter = field(default_factory=Counter)
    wall: float = 0.0

    def summary(self) -> dict:
        def pct(xs, q):
            return (
                statistics.quantiles(xs, n=100, method="inclusive")[q - 1]
                if len(xs) > 1
                else (xs[0] if xs else float("nan"))
            )

        return {
            "phase": self.label or str(self.clients),
            "clients": self.clients,
            "seconds": round(self.wall, 2),
            "requests_ok": self.ok,
            "requests_per_s": round(self.ok / self.wall, 3) if self.wall else 0.0,
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.wall, 1) if self.wall else 0.0,
            "latency_p50_s": round(pct(self.latencies, 50), 3),
            "latency_p95_s": round(pct(self.latencies, 95), 3),
            "ttft_p50_s": round(pct(self.ttfts, 50), 3),
            "ttft_p95_s": round(pct(self.ttfts, 95), 3),
            "incomplete": self.incomplete,
            "errors": dict(self.errors),
        }


async def one_request(client: httpx.AsyncClient, url: str, body: dict, phase: Phase) -> None:
    t0 = time.perf_counter()
    first = None
    finish = done = False
    usage = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                phase.errors[f"http {r.status_code}"] += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    phase.errors[f"stream error {obj['error'].get('code')}"] += 1
                    return
                for c in obj.get("choices", []):
                    if first is None and c.get("delta", {}).get("content"):
                        first = time.perf_counter() - t0
                    finish = finish or c.get("finish_reason") is not None
                usage = obj.get("usage") or usage
    except httpx.HTTPError as e:
        phase.errors[type(e).__name__] += 1
        return
    if not (done and finish and usage):
        phase.incomplete += 1
        return
    phase.ok += 1
    phase.latencies.append(time.perf_counter() - t0)
    if first is not None:
        phase.ttfts.append(first)
    phase.tokens += usage["completion_tokens"]


async def run_phase(
    args: argparse.Namespace,
    model: str,
    clients: int,
    mixed: bool = False,
    label: str = "",
    extra: dict | None = None,
    url: str | None = None,
) -> Phase:
    """One phase of `clients` clients against `url` (default: --url)."""
    url = url or args.url
    phase = Phase(clients, args.seconds, label)
    prompts = suite_prompts() if args.suite else PROMPTS
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as client:
        end = time.perf_counter() + args.seconds
        t0 = time.perf_counter()

        async def worker(k: int) -> None:
            # every client cycles through all prompts (from its own offset), so each phase
            # decodes the same mix whatever the client count: stepping by the client count
            # would pin client k to prompt k % len(PROMPTS), and the prompts with short
            # answers, finished sooner, would then be asked more often
            i = k
            while time.perf_counter() < end:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                    "max_tokens": args.max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    **args.extra,
                    **(extra or {}),
                    **(MIXED[k % len(MIXED)] if mixed else {}),
                }
                await one_request(client, url, body, phase)
                i += 1

        await asyncio.gather(*(worker(k) for k in range(clients)))
        phase.wall = time.perf_counter() - t0
    return phase


def suite_prompts(n: int = 64) -> list[str]:
    """Held-out prompts of the bundled synthetic suite: what the bundled models answer (at
    length: worked steps, lists, code), where the generic prompts get a few tokens."""
    from ..tasks import load_test_items

    return [it.prompt for it in load_test_items()[:n]]


def median_phase(rounds: list[dict]) -> dict:
    """The round with the median tokens/s (the lower middle one for an even count), with
    every round's tokens/s listed: the machine is shared, so one round can be an outlier."""
    ordered = sorted(rounds, key=lambda ph: ph["tokens_per_s"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["rounds_tokens_per_s"] = [ph["tokens_per_s"] for ph in rounds]
    return mid


def rss_kib(pid: int | None) -> dict[str, int] | None:
    return process_memory_kib(pid) if pid is not None else None


def _phases(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, int, bool, dict]]:
    """(label, clients, mixed settings, body fields) per phase."""
    methods = args.methods.split(",") if args.methods else []
    if methods and (len(methods) != 2 or not args.compare or args.compare == "same,mixed"):
        p.error("--methods takes two methods (ar,refusion) with --compare client counts (1,16,32)")
    if not args.compare:
        return [("", args.clients, False, {})]
    if args.compare == "same,mixed":
        return [("same", args.clients, False, {}), ("mixed", args.clients, True, {})]
    try:
        counts = [int(c) for c in args.compare.split(",")]
    except ValueError:
        p.error("--compare takes client counts (1,16) or same,mixed")
    if not methods:
        return [("", n, False, {}) for n in counts]
    return [(f"{m}@{n}", n, False, {"method": m}) for n in counts for m in methods]


def paired_ratio(pairs: list[tuple[dict, dict]]) -> float | None:
    """The median over rounds of the second phase's tokens/s over the first's, rounded;
    None when a first phase made no tokens."""
    if any(not a["tokens_per_s"] for a, _ in pairs):
        return None
    return round(median_ratio((a["tokens_per_s"], b["tokens_per_s"]) for a, b in pairs), 2)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m refusion.serve.loadtest", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--against",
        default=None,
        metavar="URL",
        help="a second server (the same model, other code or flags): each phase runs against --url, "
        "then against this one, and the figures are printed per server",
    )
    p.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    p.add_argument("--seconds", type=float, default=60.0, help="how long clients start new requests")
    p.add_argument(
        "--compare",
        default=None,
        metavar="A,B",
        help="run one phase per client count (e.g. 1,16) and compare tokens/s; "
        "or 'same,mixed': --clients clients with identical settings, then with mixed per-client settings",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --compare: repeat the phases this many times, interleaved (A, B, A, B, ...); "
        "each count's figures are from its median round (tokens/s)",
    )
    p.add_argument(
        "--methods",
        default=None,
        metavar="A,B",
        help="with --compare client counts: run each count with the request's method A, then B "
        "(e.g. ar,refusion), and print B's tokens/s over A's per count",
    )
    p.add_argument(
        "--suite",
        action="store_true",
        help="prompts from the bundled synthetic suite's held-out items (what the bundled models "
        "answer at length) instead of the generic ones",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--extra", type=json.loads, default={}, help='extra body fields as JSON, e.g. \'{"method": "ar"}\''
    )
    p.add_argument("--pid", type=int, default=None, help="server process id: report its RSS before and after")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0:
        p.error("--clients must be >= 1 and --seconds > 0")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    phases_spec = _phases(p, args)
    before = rss_kib(args.pid)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    urls = [args.url, *([args.against] if args.against else [])]
    runs = run_rounds(args, model, phases_spec, urls)
    reports = [
        _report(
            args, model, runs[url], *((before, rss_kib(args.pid)) if url == args.url else (None, None)), url
        )
        for url in urls
    ]
    for report in reports:
        if args.json:
            print(json.dumps(report))
        else:
            _print_report(args, report, len(runs[report["url"]]))
    if len(reports) == 2 and not args.json:
        _print_side_by_side(*reports)
    failed = sum(
        ph["incomplete"] + sum(ph["errors"].values()) for rs in runs.values() for r in rs for ph in r
    )
    return 1 if failed else 0


def run_rounds(
    args: argparse.Namespace, model: str, phases_spec: list[tuple[str, int, bool, dict]], urls: list[str]
) -> dict[str, list[list[dict]]]:
    """Per server, its rounds of phase summaries; within a round each phase runs against
    each server in turn, so that the figures compared are taken moments apart."""
    runs: dict[str, list[list[dict]]] = {url: [] for url in urls}
    for _ in range(args.rounds if args.compare else 1):
        for url in urls:
            runs[url].append([])
        for label, n, mixed, extra in phases_spec:
            for url in urls:
                phase = asyncio.run(run_phase(args, model, n, mixed, label, extra, url))
                runs[url][-1].append(phase.summary())
    return runs


def _report(
    args: argparse.Namespace, model: str, runs: list[list[dict]], before: Any, after: Any, url: str
) -> dict:
    """The figures of every phase (its median round), and the ratios asked for."""
    phases = [median_phase([r[i] for r in runs]) for i in range(len(runs[0]))]
    report = {
        "url": url,
        "model": model,
        "max_tokens": args.max_tokens,
        "phases": phases,
        "rss_kib_before": before,
        "rss_kib_after": after,
    }
    if args.methods:
        # each round's own ratio, then their median: phases moments apart, on a machine whose
        # speed drifts from round to round
        report["method_ratio"] = {
            phases[i]["clients"]: paired_ratio([(r[i], r[i + 1]) for r in runs])
            for i in range(0, len(phases), 2)
        }
    elif len(phases) > 1 and phases[0]["tokens_per_s"]:
        report["tokens_per_s_ratio"] = round(phases[-1]["tokens_per_s"] / phases[0]["tokens_per_s"], 2)
    return report


def _print_report(args: argparse.Namespace, report: dict, rounds: int) -> None:
    """The report as a few lines of text."""
    phases, before, after = report["phases"], report["rss_kib_before"], report["rss_kib_after"]
    print(f"model {report['model']} at {report['url']}, max_tokens {args.max_tokens}")
    for ph in phases:
        print(
            f"{ph['phase']:>6} ({ph['clients']} clients): {ph['requests_ok']} ok in {ph['seconds']} s "
            f"= {ph['requests_per_s']} req/s, {ph['tokens_per_s']} tokens/s; "
            f"latency p50 {ph['latency_p50_s']} s p95 {ph['latency_p95_s']} s; "
            f"TTFT p50 {ph['ttft_p50_s']} s p95 {ph['ttft_p95_s']} s; incomplete {ph['incomplete']}; "
            f"errors {ph['errors'] or 0}"
            + (f"; tokens/s by round {ph['rounds_tokens_per_s']}" if rounds > 1 else "")
        )
    if "method_ratio" in report:
        a, b = args.methods.split(",")
        print(
            f"tokens/s of {b} over {a}, per client count: "
            + ", ".join(f"{n}: {r}x" for n, r in report["method_ratio"].items())
        )
    if "tokens_per_s_ratio" in report:
        print(
            f"tokens/s ratio, {phases[-1]['phase']} vs {phases[0]['phase']}: {report['tokens_per_s_ratio']}x"
        )
    if before:
        print(
            f"server RSS before {before['VmRSS'] / 1024:.1f} MiB, after {after['VmRSS'] / 1024:.1f} MiB "
            f"(peak {after['VmHWM'] / 1024:.1f} MiB)"
        )


def _print_side_by_side(a: dict, b: dict) -> None:
    """--against: each phase's tokens/s and TTFT on both servers, as a markdown table."""
    print(f"\nA = {a['url']}, B = {b['url']} (each phase's median round)\n")
    print("| phase | tokens/s A | tokens/s B | B / A | TTFT p50 A | TTFT p50 B | TTFT p95 A | TTFT p95 B |")
    print("|---|---|---|---|---|---|---|---|")
    for pa, pb in zip(a["phases"], b["phases"]):
        ratio = f"{pb['tokens_per_s'] / pa['tokens_per_s']:.2f}x" if pa["tokens_per_s"] else "-"
        print(
            f"| {pa['phase']} | {pa['tokens_per_s']} | {pb['tokens_per_s']} | {ratio} | {pa['ttft_p50_s']} | "
            f"{pb['ttft_p50_s']} | {pa['ttft_p95_s']} | {pb['ttft_p95_s']} |"
        )


if __name__ == "__main__":
    sys.exit(main())
