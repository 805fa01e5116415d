"""The front's metrics: its own gauges and counters of each replica, and the replicas'
own samples merged into one text, each labelled with its replica."""

from __future__ import annotations

from ..metrics import Counter, Gauge, Registry


class FrontMetrics(Registry):
    """What the front itself knows of each replica: up, load, requests sent, restarts."""

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
