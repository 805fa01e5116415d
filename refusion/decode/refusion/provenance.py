"""Tracing a ReFusion row: an observer the decoder's steps report to (docs/algorithm.md#provenance).

A traced request (`Engine.add_request(..., trace=True)`) records, per committed span, how
each token was accepted (`request.HOW`) and whether its left context was exactly AR's;
with trace="steps" also what each step did besides committing: the plan's drafts, tokens
replaced by an AR prediction, drafts thrown away. The steps call the same methods whether
or not the request is traced: `NoTrace` answers them with nothing, so the decoding code
carries no tracing branches of its own, and an untraced row pays for none of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..request import Request

Spans = Sequence[tuple[int, list[int]]]  # (generation offset, tokens)


class NoTrace:
    """The observer of a row whose request is not traced."""

    steps = False  # whether it notes what each step did besides committing (callers build the spans then)

    def planned(self, spans: Spans) -> None:
        """The plan's drafts of the selected slots."""

    def rejected(self, spans: Spans) -> None:
        """Drafts thrown away."""

    def replaced(self, offset: int, old: int, new: int) -> None:
        """A draft (or a MASK no plan drafted) replaced by its AR prediction."""

    def first_tokens(
        self, slots: list[int], before: list[int] | None, after: list[int], checked: list[bool]
    ) -> None:
        """How the plan step left each selected slot's first token."""

    @property
    def wants_first_tokens(self) -> bool:
        return False

    def verified(self, slots: list[int], per_slot: list[int], scored: list[bool]) -> list[list[str]] | None:
        """How global verification passed each selected slot's passing prefix (None: untraced)."""
        return None

    def infilled(
        self,
        how: list[str] | None,
        accepted: int,
        n: int,
        corrected: int | None,
        passes: list[bool],
        off: int,
    ) -> list[str] | None:
        """How a fork's verify pass accepted its tokens accepted..n-1 (None: untraced)."""
        return None

    def decided(self, path: str, slots: list[int]) -> list[bool] | None:
        """Per committed slot, whether its context was exactly AR's (None: untraced)."""
        return None

    def ar_committed(self, slot: int) -> None:
        """A slot of an AR block is complete."""


class RowTrace(NoTrace):
    """The observer of a traced row: it keeps how the row's slots were decided, and notes
    what its steps did in its request's trace."""

    def __init__(self, req: Request, mask_id: int, tau: float) -> None:
        self.req, self.mask_id, self.tau = req, mask_id, tau
        self.steps = req.traces_steps
        self.first_how: dict[int, str] = {}  # slot -> how the plan step set its first token
        self.exact: dict[int, bool] = {}  # committed slot -> it was decided in AR's own context

    def planned(self, spans: Spans) -> None:
        self.req.note("plan", spans)

    def rejected(self, spans: Spans) -> None:
        self.req.note("rejected", [(at, toks) for at, toks in spans if toks])

    def replaced(self, offset: int, old: int, new: int) -> None:
        if self.steps:
            if old != self.mask_id:
                self.req.note("rejected", [(offset, [old])])
            self.req.note("correction", [(offset, [new])])

    @property
    def wants_first_tokens(self) -> bool:
        return True

    def first_tokens(
        self, slots: list[int], before: list[int] | None, after: list[int], checked: list[bool]
    ) -> None:
        """A first token that the plan step changed was corrected (first_token_check); one
        checked against its left neighbour's AR prediction passed verification."""
        self.first_how = {}
        for j, old, new, check in zip(slots, before or after, after, checked):
            if new != old:
                self.first_how[j] = "corrected"
            elif check:
                self.first_how[j] = "verify"

    def verified(self, slots: list[int], per_slot: list[int], scored: list[bool]) -> list[list[str]]:
        """Up to each slot's passing prefix (`per_slot`, before a slot keeps its first token
        regardless): its first token as the plan step left it, or scored by this pass."""
        how = []
        for j, sc, n in zip(slots, scored, per_slot):
            first = self.first_how.get(j) or ("verify" if sc and n > 0 else "plan")
            how.append([first] + ["verify"] * (max(n, 1) - 1))
        return how

    def infilled(
        self,
        how: list[str] | None,
        accepted: int,
        n: int,
        corrected: int | None,
        passes: list[bool],
        off: int,
    ) -> list[str]:
        out = list(how or [])[:accepted]
        for i in range(accepted, n):
            if i == corrected:
                out.append("corrected")
            else:
                out.append("infill" if 0 <= i - off < len(passes) and passes[i - off] else "infill-first")
        return out

    def decided(self, path: str, slots: list[int]) -> list[bool]:
        """Per slot: was its context exactly AR's, every slot to its left final (committed
        in an exact context itself) and in it, and none to its right? Global verification
        decided each slot after the ones fed before it; an infilling fork saw the committed
        ones only."""
        out = []
        for i, j in enumerate(slots):  # position order: slots[:i] are to the left of j
            left = all(self.exact.get(k, False) for k in range(j))
            right = any(k > j for k in self.exact)  # committed before, at a later position
            ok = (path == "fast" or i == 0) and left and not right
            self.exact[j] = ok
            out.append(ok)
        return out

    def ar_committed(self, slot: int) -> None:
        """Decoded left to right: in AR's context if everything to its left was."""
        self.exact[slot] = all(self.exact.get(k, False) for k in range(slot))


def trace_of(req: Request, mask_id: int, tau: float) -> NoTrace:
    return RowTrace(req, mask_id, tau) if req.tracing else NoTrace()
