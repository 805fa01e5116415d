"""`refusion serve --data-parallel-size N`: N engine replicas behind one HTTP front.

- `process.py`: one replica process, started (and started again) with its share of the machine
- `pool.py`: the replicas together: which takes a request, watching them, draining, stopping
- `proxy.py`: a request passed on to the least-loaded replica, its answer passed back
- `front.py`: the front's app: /health and /metrics of every replica, the rest passed on
- `metrics.py`: the front's own gauges, and the replicas' metrics merged
- `run.py`: `run_front`, the command: replicas started, then the front served

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
