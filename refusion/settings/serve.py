"""`ServerLimits`: what one client may hold of an HTTP server before its request reaches
the app, the figures `refusion serve` takes as flags (each field's bounds and help
written once, as for the other settings) and `refusion.serve.http.connection` keeps.

Every connection holds a file descriptor and a little memory whatever it sends, so a
connection that sends nothing, or a byte now and then, must be closed as surely as one
that sends too much: a head and a body each have a deadline, and the connections open at
once are capped in all and per client address.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .fields import check_fields, knob


@dataclass(frozen=True)
class ServerLimits:
    """The limits on connections and what they send before the app reads a request."""

    header_timeout: float = knob(
        10.0,
        "seconds from a connection's first byte (or its opening) to the end of its request's headers; "
        "a head not in by then gets 408 and the connection is closed",
        lo=0.1,
        hi=3600.0,
    )
    body_timeout: float = knob(
        20.0,
        "seconds from the end of a request's headers that its body may take before --min-body-rate "
        "counts (with a rate of 0: seconds it may go without a byte); a body too slow gets 408 and the "
        "connection is closed",
        lo=0.1,
        hi=3600.0,
    )
    min_body_rate: int = knob(
        500,
        "bytes per second a body must average after --body-timeout: each byte that arrives extends its "
        "deadline by 1/RATE s (0: no rate, only the idle limit)",
        lo=0,
        hi=2**40,
    )
    max_connections: int = knob(
        1024,
        "connections open at once, from all clients; more are answered 503 and closed (lowered to what "
        "the process's open-file limit allows)",
        lo=1,
        hi=2**20,
    )
    max_connections_per_client: int = knob(
        256,
        "connections open at once from one client address; more are answered 429 and closed",
        lo=1,
        hi=2**20,
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def replace(self, **changes: Any) -> ServerLimits:
        return dataclasses.replace(self, **changes)
