"""Training objectives: ReFusion's slot reorganisation with the hybrid AR/MDM loss
(docs/algorithm.md#training), and plain next-token training of the same model.

Input is a right-padded batch in text order: `tokens` (B, T) holding prompt then response
(EOS included), `prompt_lens` (B,) and `lengths` (B,) (prompt + response). Column c of that
batch is also the true position id of its token, so the whole reorganisation is one sort per
row: every token gets a key (prompt first, then clean slots by a random rank, then masked
slots in slot order, each slot in token order, then padding) and the row is gathered in key
order. Labels and weights are computed in text order, where "the next token of the same slot"
is simply the next column, and travel with the sort. No Python loop over tokens or examples.

The random draws (slot size, mask ratio, which slots are masked, the order of the clean
slots) are made on the CPU from a `torch.Generator` by `draw_slots`, so a seed reproduces a
batch on any device, and a test can replay the same draws one example at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..settings.train import AR_REDUCTIONS, ObjectiveConfig

IGNORE = -100  # label of a token that carries no loss
_DEFAULT_CFG = ObjectiveConfig()  # frozen: one shared instance serves as the default


@dataclass
class SlotDraws:
    """The random choices of the reorganisation for a batch (CPU tensors)."""

    slot_size: torch.Tensor  # (B,) int64
    p: torch.Tensor  # (B,) float32, mask probability of each slot
    masked: torch.Tensor  # (B, S) bool, slot k of example b is masked
    order_key: torch.Tensor  # (B, S) float32, clean slots are fed by increasing key
    plain: torch.Tensor  # (B,) bool, the example is a plain next-token one (ar_mix)
    frontier: torch.Tensor  # (B,) bool, the example masks one slot after a clean prefix (frontier_mix)
    cut: torch.Tensor  # (B,) float32 in [0, 1): which slot a frontier example masks, as a share of its slots

    def __getitem__(self, rows) -> SlotDraws:
        return SlotDraws(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def to(self, device: torch.device | str) -> SlotDraws:
        return SlotDraws(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def draw_slots(
    batch_size: int, max_slots: int, cfg: ObjectiveConfig, generator: torch.Generator | None = None
) -> SlotDraws:
    """Draw slot sizes, mask ratios, masked slots and the clean-slot order
    (docs/algorithm.md#slot-reorganisation, steps 1-2)."""
    sizes = torch.tensor(cfg.slot_sizes, dtype=torch.int64)
    slot_size = sizes[torch.randint(len(sizes), (batch_size,), generator=generator)]
    t = torch.rand(batch_size, generator=generator)
    p = (1.0 - cfg.eps) * t + cfg.eps
    masked = torch.rand(batch_size, max_slots, generator=generator) < p[:, None]
    order_key = torch.rand(batch_size, max_slots, generator=generator)
    plain = torch.zeros(batch_size, dtype=torch.bool)
    if cfg.ar_mix > 0:  # drawn only then, so that the other draws of a seed stay as they were
        plain = torch.rand(batch_size, generator=generator) < cfg.ar_mix
        masked &= ~plain[:, None]
        in_order = torch.arange(max_slots, dtype=order_key.dtype) / max_slots  # (S,) increasing, < 1
        order_key = torch.where(plain[:, None], in_order, order_key)
    frontier = torch.zeros(batch_size, dtype=torch.bool)
    cut = torch.zeros(batch_size)
    if cfg.frontier_mix > 0:  # drawn only then, as ar_mix: a seed's earlier draws stay as they were
        share = cfg.frontier_mix / (1.0 - cfg.ar_mix)  # of the examples ar_mix left: frontier_mix of all
        frontier = ~plain & (torch.rand(batch_size, generator=generator) < share)
        cut = torch.rand(batch_size, generator=generator)
        in_order = torch.arange(max_slots, dtype=order_key.dtype) / max_slots
        order_key = torch.where(frontier[:, None], in_order, order_key)
    return SlotDraws(slot_size, p, masked, order_key, plain, frontier, cut)


@dataclass
class TrainBatch:
    """What the model is fed and what the loss reads, in physical (fed) order. (B, T) each."""

    input_ids: torch.Tensor  # int64; masked-slot tokens replaced by MASK
    position_ids: torch.Tensor  # int64; true positions (a permutation of 0..T-1 per row)
    ar_labels: torch.Tensor  # int64; next token of the same slot, IGNORE elsewhere
    mdm_labels: torch.Tensor  # int64; the original token at a MASK, IGNORE elsewhere
    mdm_weights: torch.Tensor  # float32; 1 / (p * |R|) at a MASK, 0 elsewhere

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def _check_lengths(tokens: torch.Tensor, prompt_lens: torch.Tensor, lengths: torch.Tensor) -> None:
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (B, T), got shape {tuple(tokens.shape)}")
    if prompt_lens.shape != (tokens.shape[0],) or lengths.shape != (tokens.shape[0],):
        raise ValueError("prompt_lens and lengths must be (B,) for tokens (B, T)")
    if bool((prompt_lens < 0).any() | (lengths <= prompt_lens).any() | (lengths > tokens.shape[1]).any()):
        raise ValueError(
            "need 0 <= prompt_len < length <= T for every row (a response of at least one token)"
        )


def refusion_batch(
    tokens: torch.Tensor,  # (B, T) int64, prompt then response (with EOS), right-padded
    prompt_lens: torch.Tensor,  # (B,) int64
    lengths: torch.Tensor,  # (B,) int64, prompt + response
    mask_id: int,
    cfg: ObjectiveConfig = _DEFAULT_CFG,
    generator: torch.Generator | None = None,
    draws: SlotDraws | None = None,
) -> TrainBatch:
    """The slot reorganisation (docs/algorithm.md#slot-reorganisation), vectorised over the batch.

    Pass `draws` to replay given random choices (they may have more slot columns than needed);
    otherwise they are drawn from `generator`."""
    _check_lengths(tokens, prompt_lens, lengths)
    B, T = tokens.shape
    dev = tokens.device
    if draws is None:
        draws = draw_slots(B, cfg.max_slots(T), cfg, generator)
    draws = draws.to(dev)
    S = draws.masked.shape[1]

    col = torch.arange(T, device=dev)[None]  # (1, T): text column = true position
    m, length = prompt_lens[:, None].to(dev), lengths[:, None].to(dev)  # (B, 1)
    n = length - m  # response length |R|
    s = draws.slot_size[:, None]  # (B, 1)
    if bool((n > S * s).any()):
        raise ValueError(f"draws hold {S} slots per row, too few for a response of {int(n.max())} tokens")
    slot_idx = torch.arange(S, device=dev)[None]  # (1, S)
    masked, p_times_n = draws.masked, draws.p[:, None].float() * n.float()  # (B, S), (B, 1)
    if bool(draws.frontier.any()):
        masked, length, p_times_n = _frontier(draws, slot_idx, m, n, s, length, p_times_n)
        n = length - m
    is_resp = (col >= m) & (col < length)  # (B, T)
    j = (col - m).clamp(min=0)  # offset in the response
    slot = torch.where(is_resp, j // s, 0)  # (B, T) slot index of each response token
    off = j % s  # offset inside the slot

    # Slot ranks: clean slots by their random key (< 1), then masked slots in slot order
    # (1 + index), then slots past the response.
    n_slots = (n + s - 1) // s  # (B, 1)
    key = torch.where(masked, 1.0 + slot_idx, draws.order_key.double())
    key = torch.where(slot_idx < n_slots, key, float("inf"))
    rank = key.argsort(dim=1, stable=True).argsort(dim=1)  # (B, S)

    tok_masked = masked.gather(1, slot) & is_resp  # (B, T)
    resp_key = T + rank.gather(1, slot) * s + off  # all in [T, T + S * s)
    far = T + S * int(draws.slot_size.max()) + T  # past every response key
    sort_key = torch.where(is_resp, resp_key, torch.where(col < m, col, far + col))
    perm = sort_key.argsort(dim=1)  # (B, T) physical index -> text column

    next_tok = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # tokens[c + 1]
    across = (draws.plain | draws.frontier)[:, None] | cfg.boundary_labels  # (B, 1): labels across slots
    next_allowed = (off + 1 < s) | across  # the next token is of the same slot, or may be of the next
    labelled = (is_resp & ~tok_masked & next_allowed & (j + 1 < n)) | (across & (col == m - 1))
    ar_labels = torch.where(labelled, next_tok, IGNORE)
    mdm_labels = torch.where(tok_masked, tokens, IGNORE)
    weight = 1.0 / p_times_n  # (B, 1)
    mdm_weights = torch.where(tok_masked, weight, 0.0)
    inputs = torch.where(tok_masked, mask_id, tokens)

    def phys(x: torch.Tensor) -> torch.Tensor:
        return x.gather(1, perm)

    return TrainBatch(phys(inputs), perm, phys(ar_labels), phys(mdm_labels), phys(mdm_weights))


def _frontier(
    draws: SlotDraws,
    slot_idx: torch.Tensor,  # (1, S)
    m: torch.Tensor,  # (B, 1) prompt lengths
    n: torch.Tensor,  # (B, 1) response lengths
    s: torch.Tensor,  # (B, 1) slot sizes
    length: torch.Tensor,  # (B, 1)
    p_times_n: torch.Tensor,  # (B, 1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A frontier example's masked slots, length and MDM normaliser (docs/algorithm.md#training-options):
    the one slot its draw picks is masked, the response is cut after it (nothing to its
    right exists when lossless decoding drafts it), and its MDM part is the mean CE of that
    slot's tokens. Other examples keep theirs."""
    fr = draws.frontier[:, None]  # (B, 1)
    n_slots = (n + s - 1) // s
    cut = (draws.cut[:, None] * n_slots).long().clamp(max=n_slots - 1)  # (B, 1) the masked slot
    masked = torch.where(fr, slot_idx == cut, draws.masked)  # (B, S)
    cut_length = torch.minimum(length, m + (cut + 1) * s)
    hidden = (cut_length - m - cut * s).float()  # tokens of the masked slot
    return masked, torch.where(fr, cut_length, length), torch.where(fr, hidden, p_times_n)


def ar_batch(tokens: torch.Tensor, prompt_lens: torch.Tensor, lengths: torch.Tensor) -> TrainBatch:
    """Plain next-token training on prompt + response, labels on the response tokens only."""
    _check_lengths(tokens, prompt_lens, lengths)
    B, T = tokens.shape
    col = torch.arange(T, device=tokens.device)[None]
    m, length = prompt_lens[:, None].to(tokens.device), lengths[:, None].to(tokens.device)
    next_tok = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    predicts_response = (col + 1 >= m) & (col + 1 < length)  # the token after c is a response token
    ar_labels = torch.where(predicts_response, next_tok, IGNORE)
    none = torch.full_like(tokens, IGNORE)
    return TrainBatch(
        tokens, col.expand(B, T).contiguous(), ar_labels, none, torch.zeros(B, T, device=tokens.device)
    )


# --------------------------------------------------------------------------------- the loss
@dataclass
class LossTargets:
    """The labelled tokens of a batch, flattened, with each token's weight in the loss."""

    flat_index: torch.Tensor  # (N,) index into the flattened (B * T) batch
    labels: torch.Tensor  # (N,)
    ar_weight: torch.Tensor  # (N,) weight of the token's CE in the AR part, 0 for MASK tokens
    mdm_weight: torch.Tensor  # (N,) weight in the MDM part, 0 for clean tokens

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LossTargets:
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)}
        return LossTargets(**moved)


@dataclass
class LossParts:
    total: torch.Tensor  # scalar, what is back-propagated
    ar: torch.Tensor  # scalar, the AR (clean slot) part
    mdm: torch.Tensor  # scalar, the MDM (masked slot) part


def loss_targets(batch: TrainBatch, ar_reduction: str = "token") -> LossTargets:
    """Which logits the loss needs and how each token's CE is weighted (docs/algorithm.md#loss)."""
    if ar_reduction not in AR_REDUCTIONS:
        raise ConfigError(f"ar_reduction must be one of {AR_REDUCTIONS}, got {ar_reduction!r}")
    B = batch.batch_size
    is_ar = batch.ar_labels != IGNORE  # (B, T)
    is_mdm = batch.mdm_labels != IGNORE
    if ar_reduction == "token":
        ar_w = is_ar.float() / is_ar.sum().clamp(min=1)
    else:
        ar_w = is_ar.float() / (B * is_ar.sum(dim=1, keepdim=True).clamp(min=1))
    mdm_w = batch.mdm_weights.float() * is_mdm / B
    flat_index = (is_ar | is_mdm).flatten().nonzero().squeeze(1)
    labels = torch.where(is_ar, batch.ar_labels, batch.mdm_labels).flatten()[flat_index]
    return LossTargets(flat_index, labels, ar_w.flatten()[flat_index], mdm_w.flatten()[flat_index])


def weighted_loss(logits: torch.Tensor, targets: LossTargets) -> LossParts:
    """The hybrid loss from the logits at the labelled tokens only, `logits` (N, V)."""
    ce = F.cross_entropy(logits.float(), targets.labels, reduction="none")  # (N,)
    ar = (ce * targets.ar_weight).sum()
    mdm = (ce * targets.mdm_weight).sum()
    return LossParts(ar + mdm, ar, mdm)
