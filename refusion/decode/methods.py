"""The decoding methods, registered in one place: what the engine, the admission, the
fitting advice and the sizing rule need to know of each (`Method`), by name (`METHODS`).

Adding a method is a module with its row class (the phases it feeds and takes, see
`rows.Row`) and an entry here. Nothing here imports torch: the fitting advice and the
sizing rule are read by drivers that may not load a model (the CLI's help, `info`); a
method's rows are imported when the first one is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import MissingMaskTokenError
from ..model.sizing import CacheNeed
from ..settings.decode import DecodeConfig

if TYPE_CHECKING:
    from .request import Request


class Method:
    """A decoding method's facts. `uses_cache`: its rows live in the engine's KV cache and
    take part in its plan and verification forwards (else they are a group of their own,
    fed their whole context every step); `needs_mask`: it feeds MASK tokens."""

    name: str
    uses_cache = True
    needs_mask = True

    def row(self, req: Request, mask_id: int | None) -> Any:
        """A row decoding `req` (its class imported here, on first use)."""
        raise NotImplementedError

    def cache_need(self, cfg: DecodeConfig, prompt_len: int) -> CacheNeed:
        """What a request of these settings asks of the KV cache (the sizing rule's input)."""
        raise NotImplementedError

    def unit_text(self, cfg: DecodeConfig) -> str:
        """How it decodes its region, for the advice when a request does not fit."""
        raise NotImplementedError

    def smaller_unit(self, cfg: DecodeConfig, slack: int) -> dict[str, int]:
        """The settings that make its unit at most `slack` (>= 1) positions, the first
        being the one to name (any length n fits in a room r with a unit <= r - n + 1)."""
        return {}


class ReFusion(Method):
    """Plan and infill in slots (docs/algorithm.md#decoding)."""

    name = "refusion"

    def row(self, req: Request, mask_id: int | None) -> Any:
        from .refusion import ReFusionRow

        return ReFusionRow(req, mask_id=_needed(mask_id, self.name))

    def cache_need(self, cfg: DecodeConfig, prompt_len: int) -> CacheNeed:
        """Its row grows by its region, feeds a block of MASKs past its committed end, and
        forks a row per slot of a block while it infills (the forks hold the committed row
        and at most a slot more)."""
        width = cfg.slots_per_block * cfg.slot_size
        return CacheNeed(prompt_len, cfg.region_length, width, rows=1 + cfg.slots_per_block)

    def unit_text(self, cfg: DecodeConfig) -> str:
        return (
            f"{cfg.method} decodes in whole units of slot_size {cfg.slot_size} "
            f"x serial_blocks {cfg.serial_blocks} = {cfg.unit} positions"
        )

    def smaller_unit(self, cfg: DecodeConfig, slack: int) -> dict[str, int]:
        """It keeps its blocks if it can, then its slot size, else takes one block of
        smaller slots."""
        size, blocks = cfg.slot_size, cfg.serial_blocks
        if slack // blocks >= 1:
            return {"slot_size": slack // blocks}
        if slack // size >= 1:
            return {"serial_blocks": slack // size}
        return {"slot_size": slack, "serial_blocks": 1}


class AR(Method):
    """Left to right, one token per forward (docs/algorithm.md#ar)."""

    name = "ar"
    needs_mask = False

    def row(self, req: Request, mask_id: int | None) -> Any:
        from .ar import ARRow

        return ARRow(req)

    def cache_need(self, cfg: DecodeConfig, prompt_len: int) -> CacheNeed:
        return CacheNeed(prompt_len, cfg.gen_length, 0)

    def unit_text(self, cfg: DecodeConfig) -> str:
        return "ar decodes one position at a time"


class MDM(Method):
    """Masked diffusion in semi-autoregressive blocks, no KV reuse (docs/algorithm.md#mdm)."""

    name = "mdm"
    uses_cache = False

    def row(self, req: Request, mask_id: int | None) -> Any:
        from .mdm import MDMRow

        return MDMRow(req, _needed(mask_id, self.name))

    def cache_need(self, cfg: DecodeConfig, prompt_len: int) -> CacheNeed:
        return CacheNeed(prompt_len, 0, 0, rows=0)

    def unit_text(self, cfg: DecodeConfig) -> str:
        return f"mdm decodes in whole blocks of mdm_block_length {cfg.mdm_block_length} positions"

    def smaller_unit(self, cfg: DecodeConfig, slack: int) -> dict[str, int]:
        return {"mdm_block_length": slack}


def _needed(mask_id: int | None, method: str) -> int:
    """The MASK id a method feeds (the admission refuses its requests on a model without one)."""
    if mask_id is None:
        raise MissingMaskTokenError(f"method {method!r} needs a MASK token and this model has none")
    return mask_id


METHODS: dict[str, Method] = {m.name: m for m in (ReFusion(), AR(), MDM())}


def method_of(cfg: DecodeConfig) -> Method:
    return METHODS[cfg.method]
