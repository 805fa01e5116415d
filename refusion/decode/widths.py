"""Draft widths that follow the batch (docs/algorithm.md#adaptive-widths).

A ReFusion row drafts tokens it may not keep: the plan drafts its slot from MASKs and the
global verification feeds those drafts; each infilling round drafts a window past the
accepted prefix and verifies it. Alone, a forward's fixed cost dominates and the drafts
are nearly free, so wide drafts win. In a large batch the forward is compute-bound, every
drafted token costs as much as a committed one, and wide drafts lose to AR decoding.

So each step the engine picks, for the rows whose greedy output cannot depend on the
widths (`widths_keep_output`), the plan width (MASKs drafted per slot, and so the drafts
the global verification feeds) and the infilling window that commit the most tokens per
second, from two measurements:

- `ForwardCost`: seconds of a forward as a function of the tokens it feeds and the rows
  it feeds them to, fitted by least squares to a short calibration (a few shapes, timed
  again one a step after five minutes, then ten, twenty, up to an hour);
- `Acceptance`: how far runs of drafts get through verification, per distance into the
  run, counted over the rows' verify passes (the plan's drafts and infilling's apart).

At width 1 and window 0 a row feeds what an AR row feeds: one token per forward.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence

from ..settings.decode import DecodeConfig


def equals_greedy_ar(cfg: DecodeConfig) -> bool:
    """Whether this ReFusion request decodes exactly what greedy AR decoding of the same
    weights does, whichever drafts it verifies: greedy, with settings lossless at
    temperature 0 (`DecodeConfig.lossless`), it commits the AR argmax at every position."""
    return cfg.method == "refusion" and cfg.greedy and cfg.lossless is not None


def drafts_keep_output(cfg: DecodeConfig) -> bool:
    """Whether this ReFusion request's output (token for token greedy, in distribution
    sampled) does not depend on which drafts it verifies: its settings are lossless at its
    temperature."""
    return cfg.method == "refusion" and cfg.lossless_now


def widths_keep_output(cfg: DecodeConfig) -> bool:
    """Whether this request's output is the same at any draft widths (`drafts_keep_output`),
    in a layout the engine narrows: one slot per block, so that a narrower plan drafts a
    prefix of its only slot. The widths then only decide how many forwards it takes.
    Sampled, the widths decide which draws of its generator go where, so only its
    distribution stays: a request with a seed keeps its fixed widths, so that it draws the
    same tokens alone or in any batch; one without a seed follows the batch."""
    return drafts_keep_output(cfg) and cfg.slots_per_block == 1 and (cfg.greedy or cfg.seed is None)


Shape = tuple[int, int, int]  # rows, tokens fed per row, entries cached per row


class ForwardCost:
    """Seconds of one forward feeding `n` tokens over `rows` rows whose caches hold
    `context` entries: a + b * n + c * rows + d * n * context (the last: attention over
    the cache), with a, b, c, d >= 0 fitted to the fastest time measured for each of a few
    shapes. The shapes are timed at first use and again later (`stale`), and each keeps
    its fastest time ever: a shared machine only adds time to a forward, so the fastest is
    the cost, and a forward slowed by a neighbour moves nothing."""

    def __init__(self, every: float = 300.0, longest: float = 3600.0) -> None:
        self.fastest: dict[tuple[int, int, int], float] = {}  # (rows, tokens per row, context) -> s
        self.coef: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
        self.every, self.longest, self.when = every, longest, -float("inf")
        self.refresh: list[Shape] = []  # shapes still to time again, one a call

    @property
    def calibrated(self) -> bool:
        return bool(self.fastest)

    def stale(self) -> bool:
        return bool(self.refresh) or time.monotonic() - self.when > self.every

    @staticmethod
    def shapes(rows: int) -> list[Shape]:
        """One row and `rows` (at most 32), one token each up to a slot's worth, after a
        short and a long context."""
        r = max(1, min(rows, 32))
        short = [(1, 1, 16), (1, 8, 16), (1, 32, 16), (r, 1, 16), (r, 4, 16), (r, 16, 16)]
        return sorted({*short, (1, 32, 128), (r, 1, 128), (r, 16, 128)})

    def calibrate(self, time_shapes: Callable[..., list[float]], rows: int) -> None:
        """Time forwards of the `shapes` (`Forward.time_shapes`): at first use all of them,
        best of five; when `every` seconds have passed, all again, but one shape a call and
        once each, and the interval doubles after each round (up to `longest`). On a model
        whose large shapes take a second (SmolLM2-135M at 16 rows on 2 CPU cores), timing
        them all at once stalled a step for about 13 s every five minutes: half of a batch
        of 16's time in a benchmark round. One shape a call stalls a step for one forward
        and its cache's fill; the fastest-ever rule makes a single sample enough."""
        if not self.fastest:
            todo = self.shapes(rows)
            timed = time_shapes(todo)
        else:
            if not self.refresh:
                self.refresh = self.shapes(rows)
            todo = [self.refresh.pop(0)]
            timed = time_shapes(todo, 1)
            if not self.refresh:
                self.every = min(2 * self.every, self.longest)
        for shape, seconds in zip(todo, timed):
            self.fastest[shape] = min(seconds, self.fastest.get(shape, float("inf")))
        if not self.refresh:
            self.when = time.monotonic()
        keys = list(self.fastest)
        x = [(1.0, float(r * k), float(r), float(r * k * ctx)) for r, k, ctx in keys]
        self.coef = nonnegative_least_squares(x, [self.fastest[key] for key in keys])

    def __call__(self, n: float, rows: int, context: int = 0) -> float:
        a, b, c, d = self.coef
        return a + b * n + c * rows + d * n * context

    def alone(self, n: float, context: int = 0) -> float:
        """Seconds of a forward feeding `n` tokens to one row: read off the fastest times of
        the one-row shapes (linear between them, and past the widest along its last
        segment), with the fit's attention term for the context. A line fitted over every
        shape, a large batch's among them, prices a token by what it costs a compute-bound
        forward; one row's forward is memory-bound on most machines, where 8 tokens cost
        little more than one. The fit serves until a one-row shape is timed."""
        points = sorted((k, t) for (r, k, ctx), t in self.fastest.items() if r == 1 and ctx == 16)
        if len(points) < 2:
            return self(n, 1, context)
        segments = list(zip(points, points[1:]))
        (k0, t0), (k1, t1) = next((seg for seg in segments if n <= seg[1][0]), segments[-1])
        at_n = t0 + (t1 - t0) * (n - k0) / max(k1 - k0, 1e-12)
        return max(at_n, points[0][1]) + self.coef[3] * n * max(context - 16, 0)


def nonnegative_least_squares(x: Sequence[Sequence[float]], y: list[float]) -> tuple[float, ...]:
    """Least squares with every coefficient >= 0: fit, drop the most negative coefficient's
    feature, fit again (exact for the three features used here, where at most two drop)."""
    k = len(x[0])
    active = list(range(k))
    while active:
        coef = _solve([[row[j] for j in active] for row in x], y)
        if coef is not None and min(coef) >= 0:
            out = [0.0] * k
            for j, v in zip(active, coef):
                out[j] = v
            return tuple(out)
        worst = active[min(range(len(active)), key=lambda i: coef[i])] if coef is not None else active[-1]
        active.remove(worst)
    return tuple([0.0] * k)


def _solve(x: list[list[float]], y: list[float]) -> list[float] | None:
    """Normal equations (X^T X) c = X^T y by Gaussian elimination; None when singular."""
    k = len(x[0])
    xty = [sum(r[i] * t for r, t in zip(x, y)) for i in range(k)]
    m = [[sum(r[i] * r[j] for r in x) for j in range(k)] + [xty[i]] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(m[i][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for i in range(k):
            if i != col:
                f = m[i][col] / m[col][col]
                m[i] = [a - f * b for a, b in zip(m[i], m[col])]
    return [m[i][k] / m[i][i] for i in range(k)]


class Survival:
    """How far a run of drafted tokens gets through verification: per distance i, decayed
    counts of runs that reached draft i and of runs whose draft i failed, so the chance of
    passing draft i having passed the ones before is measured per distance (drafts far into
    a slot are guessed from less). The prior is hopeful, 0.95 at every distance, so that
    widths never tried look worth trying: a wrong hope costs a few wide steps and is
    measured away, where a wrong doubt would keep the drafts narrow and never learn. Decay
    is applied lazily: each new run counts 1/decay times more than the one before."""

    def __init__(self, decay: float = 0.995) -> None:
        self.reached: list[float] = []
        self.failed: list[float] = []
        self.decay, self.weight = decay, 1.0
        self._curve: list[float] | None = None
        self._expected: dict[int, tuple[float, float]] = {}  # m -> expected(m), until the next run

    def add(self, passed: int, verified: int) -> None:
        """A run of `verified` drafts of which the first `passed` passed (then one failed,
        unless all passed)."""
        if verified <= 0:
            return
        self.weight /= self.decay
        if self.weight > 1e100:  # rescale before the weights overflow
            self.reached = [r / self.weight for r in self.reached]
            self.failed = [f / self.weight for f in self.failed]
            self.weight = 1.0
        grow = verified - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.failed += [0.0] * grow
        for i in range(min(passed + 1, verified)):
            self.reached[i] += self.weight
        if passed < verified:
            self.failed[passed] += self.weight
        self._curve = None
        self._expected.clear()

    def expected(self, m: int) -> tuple[float, float]:
        """(expected passing drafts among m verified in order, chance that all m pass);
        distances never measured take the prior."""
        if m <= 0:
            return 0.0, 1.0
        if m not in self._expected:  # asked for each candidate width, step after step
            curve = self._survival()
            if m > len(curve):
                last = curve[-1] if curve else 1.0
                curve = curve + [last * 0.95 ** (i + 1) for i in range(m - len(curve))]
            self._expected[m] = sum(curve[:m]), curve[m - 1]
        return self._expected[m]

    def _survival(self) -> list[float]:
        if self._curve is None:
            alive, curve, w = 1.0, [], self.weight
            for r, f in zip(self.reached, self.failed):
                alive *= 1 - (f / w + 0.05) / (r / w + 1.0)
                curve.append(alive)
            self._curve = curve
        return self._curve


class Acceptance:
    """The runs of the plan's drafts through global verification and of the infilling
    drafts through their verify passes, measured apart."""

    def __init__(self) -> None:
        self.plan, self.infill = Survival(), Survival()


class _Both:
    """A survival count that adds each run to the model's and to one row's own."""

    def __init__(self, pooled: Survival, own: Survival) -> None:
        self.pooled, self.own = pooled, own

    def add(self, passed: int, verified: int) -> None:
        self.pooled.add(passed, verified)
        self.own.add(passed, verified)


class BlockRecord:
    """Tokens committed, and seconds their forwards and steps cost, over drafting blocks:
    a drafting rate measured on the blocks themselves. `decay` < 1 lets the latest blocks
    count most (a model's record over many requests); 1 keeps every block alike (a row's
    own)."""

    def __init__(self, decay: float = 1.0) -> None:
        self.tokens, self.seconds, self.decay = 0.0, 0.0, decay

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens = self.tokens * self.decay + tokens
        self.seconds = self.seconds * self.decay + seconds

    def rate(self) -> float | None:
        """Tokens per second, None before a block is counted."""
        return self.tokens / self.seconds if self.seconds > 0 else None


class Probe:
    """When a lone row drafts a block although its record says AR blocks are faster: after
    `every` AR blocks, an interval that doubles at each probe and starts again at `first`
    once drafting wins. Acceptance changes along a generation (code after prose, a list
    after its first item), and a record that is never renewed would keep AR blocks for good;
    the doubling bounds what the probes cost where drafting keeps losing."""

    def __init__(self, first: int = 8) -> None:
        self.first, self.every, self.since = first, first, 0

    def drafts(self, wins: bool) -> bool:
        """Whether to draft this block, drafting measured to win (`wins`) or not."""
        if wins:
            self.every, self.since = self.first, 0
            return True
        if self.since >= self.every:
            self.every, self.since = 2 * self.every, 0
            return True
        self.since += 1
        return False


class RowAcceptance:
    """What a row adds its verified runs to: the model's acceptance, pooled over every
    request (what the widths of a batch are chosen from), and its own infilling runs
    (`own_infill`: what a row alone judges its infilling window by, since a pool that
    other prompts filled says little of this one). It also keeps the row's own drafting
    blocks (`drafted`, closed at each block's end from `started`: tokens, forwards, tokens
    fed and steps when the block began) and its probes (`probe`): what a row alone decides
    between drafting and AR blocks by (`lone_drafts`)."""

    def __init__(self, pooled: Acceptance) -> None:
        self.own_infill = Survival()
        self.plan, self.infill = pooled.plan, _Both(pooled.infill, self.own_infill)
        self.drafted, self.probe = BlockRecord(), Probe()
        self.started: tuple[int, int, int, int, int, bool, bool] | None = None
        # (block, tokens, forwards, fed, steps, drafting, alone) when the block began


def lone_drafts(record: BlockRecord, probe: Probe, ar_rate: float) -> bool:
    """Whether a row alone drafts its next block at its settings' widths (else: an AR
    block). It drafts while its record of drafting blocks (its own, or the model's lone
    rows' before it has one) commits at least AR decoding's rate, `ar_rate` tokens per
    second; with no record yet it drafts (hopeful, as `Survival`), and past a losing one
    it probes now and then (`Probe`). Both rates are of the same prices (`ForwardCost`,
    `StepOverhead`): a lone row is priced from what its own blocks did, never from the
    acceptance other requests pooled."""
    rate = record.rate()
    return probe.drafts(rate is None or rate >= ar_rate)


def candidates(full: int) -> list[int]:
    """full, then halving down to 1."""
    out = [full]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def choose(
    rows: int,
    other_rows: int,
    other_fed: int,
    slot: int,
    window: int,
    acceptance: Acceptance,
    cost: Callable[[int, int], float],
    margin: float = 1.1,
    overheads: tuple[float, float] = (0.0, 0.0),
    alone_drafts: bool = True,
) -> tuple[int, int]:
    """(plan width, infilling window) for `rows` rows of one slot of `slot` tokens per block
    (window: the most their settings allow) that commit the most tokens per second of a
    block, by the model in the module docstring; (0, 0): decode the block as AR decoding
    does, a token per forward. `other_rows` rows feeding `other_fed` tokens share the plan
    and verification forwards (an AR row commits a token in each). Other widths than the
    settings' own (slot, window) must promise `margin` times their rate, and drafting
    `margin` times the rate of AR blocks. `overheads`: seconds the step costs outside its
    forwards (`StepOverhead`, at this batch's rows) when rows draft, and in AR blocks.

    A row alone in the batch keeps its settings' widths, or decodes the block as AR does
    where its measured drafting blocks commit fewer tokens a second than AR blocks would
    (`alone_drafts` False, from `lone_drafts`: a model converted and not yet trained for
    ReFusion, or a prompt whose drafts fail). The estimate picks its settings' widths there when
    its inputs are that row's own (`refusion bench decode` feeds as many tokens per
    committed one at a batch of 1 adaptive as fixed), but it prices a row from acceptance
    pooled over every request the model decoded and from step overheads fitted mostly at
    other batch sizes: after a load of many clients, a server's lone client was narrowed
    and took twice the forwards of the fixed widths."""
    if rows + other_rows == 1:  # no slower than AR decoding, by the row's own blocks
        return (slot, window) if alone_drafts else (0, 0)
    rates = {}
    windows = [*candidates(window), 0] if window else [0]
    for p in candidates(slot):
        for w in windows:
            rates[(p, w)] = block_rate(
                rows, other_rows, other_fed, slot, p, w, acceptance, cost, overheads[0]
            )
    best = max(rates, key=rates.__getitem__)
    # the settings' own widths stay unless other widths are clearly faster, and drafting
    # stays only while clearly faster than AR blocks: the estimates are of a noisy machine,
    # and they leave out the infilling forks' own work (their copies, their bookkeeping)
    if rates[best] <= margin * rates[(slot, window)]:
        best = (slot, window)
    everyone = rows + other_rows  # an AR block's two steps: a forward each, a token a row in each
    ar = 2 * everyone / max(2 * (cost(rows + other_fed, everyone) + overheads[1]), 1e-12)
    return best if rates[best] > margin * ar else (0, 0)


def block_rate(
    rows: int,
    other_rows: int,
    other_fed: int,
    slot: int,
    p: int,
    w: int,
    acceptance: Acceptance,
    cost: Callable[[int, int], float],
    overhead: float = 0.0,
) -> float:
    """Tokens per second over one block at plan width p and window w: the plan and the
    global verification each feed p tokens a row; their first token is the AR prediction
    (first-token check), then the drafts pass as measured and the first failure is
    corrected; infilling rounds commit the same way from w drafts (window 0: one token, one
    forward, as AR decoding). The plan and the verification are a step each, and every
    infilling round one more (`Engine`), each costing `overhead` seconds besides."""
    everyone = rows + other_rows
    seconds = 2 * cost(rows * p + other_fed, everyone)
    rounds = infill_rounds(slot, p, w, acceptance)
    # every round is counted at two forwards, also the first, which verifies the plan's own
    # drafts in one (`drafting.plan_drafts_first`): counting that saving alone, without the
    # forks' copies the estimate also leaves out, turned half the blocks at a batch of 16 to
    # drafting, which measured slower than AR blocks there
    infill = cost(rows, rows) if w == 0 else cost(rows * (1 + w), rows) + cost(rows * w, rows)
    seconds += rounds * infill + overhead * (2 + rounds)  # the plan's step, verification's, a round's
    return (rows * slot + 2 * other_rows) / max(seconds, 1e-12)


def infill_rounds(slot: int, p: int, w: int, acceptance: Acceptance) -> float:
    """Expected infilling rounds of a block after its plan and global verification: those
    commit the AR prediction of the first token (first-token check), then the plan's drafts
    as far as they pass, then the correction of the first that fails; each round then
    commits the drafts of its window that pass and one correction (window 0: one token)."""
    passed, whole = acceptance.plan.expected(p - 1)
    first = min(slot, 1 + passed + (1 - whole))
    passed, whole = acceptance.infill.expected(w)
    return max(slot - first, 0.0) / (passed + 1)


class StepOverhead:
    """Seconds a step spends outside its forwards: the decoder's bookkeeping, the requests'
    text, and the driver's own work between steps (a server's streaming). A block decoded
    as AR takes a step per two tokens where drafting takes one or two, so this is what
    drafting saves beside forwards. Some of it comes once a step, some once a row, so it is
    fitted as e + f * rows (non-negative least squares) over the median seconds of the
    latest steps at each batch size seen: steps measured at one batch size alone give a
    cost per step, not per row, so that the bookkeeping of a step with one row is not
    priced again for every row of a large batch."""

    def __init__(self, keep: int = 64) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=keep)  # (rows, seconds)
        self._coef: tuple[float, ...] | None = None

    def add(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds >= 0:
            self.steps.append((rows, seconds))
            self._coef = None

    def seconds(self, rows: int) -> float:
        """A step's seconds with this many rows. 0 until 8 steps are measured: hopeful, as
        for acceptance, so that a few slow first steps cannot keep a kind of step from
        ever being tried again."""
        if len(self.steps) < 8:
            return 0.0
        if self._coef is None:  # refitted once per new step at most
            by_rows: dict[int, list[float]] = {}
            for r, sec in self.steps:
                by_rows.setdefault(r, []).append(sec)
            # medians per batch size: a step held up by a neighbour moves them little
            points = [((1.0, float(r)), statistics.median(secs)) for r, secs in by_rows.items()]
            self._coef = nonnegative_least_squares([x for x, _ in points], [y for _, y in points])
        e, f = self._coef
        return e + f * rows


class Drafting:
    """What an engine's draft widths are chosen from: the forward cost and the acceptance
    measured so far on one model. Kept per model (`drafting_of`), so the engines that
    `generate` makes call after call build on each other's measurements."""

    def __init__(self) -> None:
        self.cost = ForwardCost()
        self.acceptance = Acceptance()
        self.overhead = StepOverhead()  # steps where a row drafted
        self.ar_overhead = StepOverhead()  # steps of AR blocks (and AR rows) only
        # drafting blocks of rows alone, and their probes: where a new lone row starts from
        self.lone, self.lone_probe = BlockRecord(decay=0.9), Probe()


_DRAFTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def drafting_of(model: object) -> Drafting:
    """The model's `Drafting`, made at first use."""
    d = _DRAFTING.get(model)
    if d is None:
        d = _DRAFTING[model] = Drafting()
    return d
