"""Penalties and logit bias: a step's logits changed per row before its tokens are chosen, on the device.

**Semantics**, for row i with output token counts c[v] (tokens it generated so far), `seen[v]` (v is in its
prompt or its output), and in this order (vLLM's: bias first, then the penalties):

    x[v] += bias[v]                                                       logit_bias (OpenAI)
    x[v] = x[v] / r  if x[v] > 0 else x[v] * r,   where seen[v]           repetition_penalty r (HF, vLLM)
    x[v] -= frequency * c[v] + presence * (c[v] > 0)                      OpenAI's penalties

Only the rows that ask for one of them go through this; the others' logits are not touched (the same bits).

A request's output tokens are kept on the device, where they are drawn: each penalised row has a slot in
`PenaltyStore`, and the token drawn for output position p is written at column p of its slot's history
(with async scheduling the step that drew token p may still be running when the next one reads it: the
device runs them in order, and the host never needs the id). Writing by position makes every draw of a
position idempotent: a step rolled back and run again, or a row sampled alone to find a fault, writes the
same column again instead of counting a token twice. The counts c are made from the history each step
(one scatter over the penalised rows), so nothing is kept that could drift from the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .request import Request
from .sampling_params import SamplingParams

# Slots, history columns and bias entries start small and double: memory follows what the requests ask.
_FIRST_SLOTS = 4
_FIRST_COLUMNS = 64


def penalize(
    logits: torch.Tensor,
    counts: torch.Tensor | None,
    seen: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The module's semantics on float32 logits [R, V]: `counts` [R, V] float (None: no output token yet
    or no row with presence or frequency), `seen` [R, V] bool (None: no row with a repetition penalty),
    `presence`, `frequency`, `repetition` [R], `bias` [R, V] (None: no row has one). A new tensor."""
    if bias is not None:
        logits = logits + bias
    if seen is not None:
        rep = repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if counts is not None:
        logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return logits


def _needs_history(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


@dataclass
class PenaltyStep:
    """A step's penalised rows, to record the tokens drawn for them: `rows` [H] (the step's rows that keep a
    history), `slots` [H] and `positions` [H] (each one's output position), on the device."""

    store: PenaltyStore
    rows: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor

    def record(self, tokens: torch.Tensor) -> None:
        """Write the step's tokens [S] of the history rows at their positions (queued on the device)."""
        if self.rows.numel():
            self.store.history.index_put_((self.slots, self.positions), tokens.index_select(0, self.rows))


class PenaltyStore:
    """The device state of the requests that use penalties or logit bias, one slot each: its output
    history [slots, columns] int64 (the token of output position p at column p), the tokens of its prompt
    as a mask [slots, V] (only once a request has a repetition penalty), its logit bias as padded
    entries [slots, E] (id V: none), and its three penalty values [slots, 3]. A slot is taken when a
    request is first penalised and given back once that request has finished."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab = vocab_size
        self.device = device
        self.owners: list[Request | None] = [None] * _FIRST_SLOTS
        self.slots: dict[int, int] = {}  # id(request) -> its slot, for each request in `owners`
        slots = _FIRST_SLOTS
        self.history = torch.zeros(slots, _FIRST_COLUMNS, dtype=torch.int64, device=device)
        self.values = torch.zeros(slots, 3, dtype=torch.float32, device=device)  # presence, frequency, rep.
        self.bias_ids = torch.full((slots, 0), vocab_size, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(slots, 0, dtype=torch.float32, device=device)
        self.prompt_seen: torch.Tensor | None = None  # [slots, V] bool, made for the first repetition penalty

    # -- a step ---------------------------------------------------------------------------------------

    def apply(
        self, logits: torch.Tensor, requests: Sequence[Request], rows: list[int]
    ) -> tuple[torch.Tensor, PenaltyStep]:
        """Logits [S, V] with the penalised `rows` changed (a new tensor; the other rows' values are the
        same bits), and the step to record their drawn tokens with. Queues device work only."""
        # The rows that keep a history (a penalty) first, then those with a bias alone: the history
        # rows are then a prefix of every index below, and recording them needs no mask.
        ordered = sorted(rows, key=lambda i: not _needs_history(requests[i].params))
        chosen = [requests[i] for i in ordered]
        tracked = sum(1 for r in chosen if _needs_history(r.params))
        slots = [self._slot(r) for r in chosen]
        positions = [r.num_generated if j < tracked else 0 for j, r in enumerate(chosen)]
        self._reserve_columns(max(positions[:tracked], default=-1) + 1)
        # One host-to-device copy of the step's indices: rows, slots, output positions [3, R].
        index = torch.tensor([ordered, slots, positions], dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        row_index, slot_index, position_index = index[0], index[1], index[2]
        params = [r.params for r in chosen]
        values = self.values.index_select(0, slot_index)  # [R, 3]: presence, frequency, repetition
        x = logits.index_select(0, row_index).float()  # [R, V], in `ordered`'s order
        bias = self._bias(slot_index, len(rows)) if any(p.logit_bias for p in params) else None
        width = max(positions, default=0)  # output tokens so far in the longest history
        counts = self._counts(slot_index, position_index, width) if width else None
        seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            assert self.prompt_seen is not None  # made when the first such request took its slot
            seen = self.prompt_seen.index_select(0, slot_index)
            if counts is not None:
                seen = seen | (counts > 0)
        x = penalize(x, counts, seen, values[:, 0], values[:, 1], values[:, 2], bias)
        merged = logits.float().index_copy(0, row_index, x)  # out of place: the raw logits stay for logprobs
        return merged, PenaltyStep(self, row_index[:tracked], slot_index[:tracked], position_index[:tracked])

    def _counts(self, slots: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
        """Output token counts [R, V] float32 from the slots' histories, positions [0, position) of each."""
        history = self.history[:, :width].index_select(0, slots)  # [R, W]
        columns = torch.arange(width, device=self.device)
        ids = history.masked_fill(columns[None, :] >= positions[:, None], self.vocab)  # column V: dropped
        counts = torch.zeros(len(history), self.vocab + 1, dtype=torch.float32, device=self.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        return counts[:, : self.vocab]

    def _bias(self, slots: torch.Tensor, rows: int) -> torch.Tensor:
        """The slots' logit bias as dense [R, V] float32."""
        dense = torch.zeros(rows, self.vocab + 1, dtype=torch.float32, device=self.device)
        dense.scatter_add_(1, self.bias_ids.index_select(0, slots), self.bias_values.index_select(0, slots))
        return dense[:, : self.vocab]

    # -- slots ----------------------------------------------------------------------------------------

    def _slot(self, request: Request) -> int:
        """The request's slot, taken and filled on first use (its prompt, its bias, its values, and the
        output tokens the host knows already)."""
        slot = self.slots.get(id(request))  # an id is not reused while `owners` holds the request
        if slot is not None:
            return slot
        slot = self._free_slot()
        self._fill(slot, request)
        # Taken only once filled: a request whose values cannot be kept (a value past every check that
        # overflows float32) raises here again each time it is tried, as the fault guard's retry of its
        # row alone needs to find it.
        self.owners[slot] = request
        self.slots[id(request)] = slot
        return slot

    def _fill(self, slot: int, request: Request) -> None:
        """Write the request's penalty values, bias, prompt mask and known output tokens into `slot`."""
        params = request.params
        values = [params.presence_penalty, params.frequency_penalty, params.repetition_penalty]
        self.values[slot] = torch.tensor(values, dtype=torch.float32).to(self.device)
        self._fill_bias(slot, params)
        if params.repetition_penalty != 1.0:
            seen = self._prompt_seen()
            seen[slot] = False
            seen[slot, torch.tensor(request.prompt_token_ids, dtype=torch.int64).to(self.device)] = True
        known = request.output_token_ids
        if known and _needs_history(params):
            self._reserve_columns(len(known))
            self.history[slot, : len(known)] = torch.tensor(known, dtype=torch.int64).to(self.device)

    def _free_slot(self) -> int:
        """A slot no unfinished request holds (the finished ones' are given back here), growing if none."""
        for slot, owner in enumerate(self.owners):
            if owner is None:
                return slot
            if owner.finished:  # it samples no more: its history is no one's
                del self.slots[id(owner)]
                self.owners[slot] = None
                return slot
        self._grow_slots(2 * len(self.owners))
        return self._free_slot()

    def _fill_bias(self, slot: int, params: SamplingParams) -> None:
        entries = sorted((params.logit_bias or {}).items())
        if len(entries) > self.bias_ids.shape[1]:
            self._grow_bias(len(entries))
        self.bias_ids[slot] = self.vocab
        self.bias_values[slot] = 0.0
        if entries:
            count = len(entries)
            self.bias_ids[slot, :count] = torch.tensor([t for t, _ in entries], dtype=torch.int64).to(
                self.device
            )
            self.bias_values[slot, :count] = torch.tensor([b for _, b in entries], dtype=torch.float32).to(
                self.device
            )

    def _prompt_seen(self) -> torch.Tensor:
        if self.prompt_seen is None:
            self.prompt_seen = torch.zeros(len(self.owners), self.vocab, dtype=torch.bool, device=self.device)
        return self.prompt_seen

    # -- growth (each doubles, keeping what is there) ---------------------------------------------------

    def _grow_slots(self, slots: int) -> None:
        self.owners += [None] * (slots - len(self.owners))
        self.history = _grown(self.history, slots, self.history.shape[1], 0)
        self.values = _grown(self.values, slots, 3, 0)
        self.bias_ids = _grown(self.bias_ids, slots, self.bias_ids.shape[1], self.vocab)
        self.bias_values = _grown(self.bias_values, slots, self.bias_values.shape[1], 0)
        if self.prompt_seen is not None:
            self.prompt_seen = _grown(self.prompt_seen, slots, self.vocab, False)

    def _reserve_columns(self, columns: int) -> None:
        width = self.history.shape[1]
        if columns > width:
            while width < columns:
                width *= 2
            self.history = _grown(self.history, len(self.owners), width, 0)

    def _grow_bias(self, entries: int) -> None:
        self.bias_ids = _grown(self.bias_ids, len(self.owners), entries, self.vocab)
        self.bias_values = _grown(self.bias_values, len(self.owners), entries, 0)


def _grown(tensor: torch.Tensor, rows: int, columns: int, fill: float | bool) -> torch.Tensor:
    """A [rows, columns] copy of `tensor` with its values at the top left and `fill` elsewhere."""
    out = torch.full((rows, columns), fill, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.shape[0], : tensor.shape[1]] = tensor
    return out


__all__ = ["PenaltyStep", "PenaltyStore", "penalize"]
