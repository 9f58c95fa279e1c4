"""How the learner lays sequences out for a forward pass, and how it cuts a step into micro-batches.

`Rows` is the layout of one forward pass: either one right-padded row per sequence (`pad_rows`) or
sequences packed back to back into rows of at most `max_tokens` tokens without padding between them
(`pack_rows`: position ids restart at 0 for every sequence and no attention mask is passed, so
transformers attends within each sequence only, as the toy SFT does). Either way `target_mask[r, j]`
marks the positions whose next token is a completion token, and `seq_index` says whose; per-sequence
values go in with `per_token`/`place` and come out with `split`, so the loss never needs to know
which layout it runs on.

`micro_batches` cuts a rank's sequences into micro-batches: `micro_batch_sequences` at a time, or,
with `learner.max_tokens_per_micro_batch`, as many as fit the token budget (memory then scales with
the budget, whatever the lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class Rows:
    input_ids: torch.Tensor  # (R, W)
    attention_mask: torch.Tensor | None  # (R, W), None when packed
    position_ids: torch.Tensor | None  # (R, W), restarting per sequence when packed
    target_mask: torch.Tensor  # (R, W-1) bool
    seq_index: torch.Tensor  # (R, W-1) long: the sequence each target position scores, -1 elsewhere
    lengths: list[int]  # completion length of each sequence, in order
    # flat_targets on each accelerator it was asked for: copied over once per layout, not per call
    _targets_by_device: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """(n,) per-sequence values spread over each sequence's target positions (zero elsewhere)."""
        out = values[self.seq_index.clamp(min=0).to(values.device)]
        return torch.where(self.target_mask.to(values.device), out, torch.zeros_like(out))

    @cached_property
    def flat_targets(self) -> torch.Tensor:
        """Flat positions of the target mask's true entries (host, long): what `place` and `split` index by,
        so that on a GPU neither needs a boolean mask (whose count the host must wait for)."""
        return self.target_mask.reshape(-1).nonzero().flatten()

    def _targets_on(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.flat_targets
        key = str(device)
        if key not in self._targets_by_device:
            self._targets_by_device[key] = to_device(self.flat_targets, device)
        return self._targets_by_device[key]

    def place(self, vectors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        """Per-sequence vectors (one value per completion token) in the (R, W-1) layout, fp32, on `device`
        (default the host; host vectors go over from pinned memory, device ones stay)."""
        device = torch.device("cpu") if device is None else device
        out = torch.zeros(self.target_mask.shape, dtype=torch.float32, device=device)
        if vectors:
            values = torch.cat([to_device(v.float(), device) if v.device.type == "cpu" else v.float() for v in vectors])
            out.view(-1).index_copy_(0, self._targets_on(device), values)
        return out

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The (R, W-1) tensor's values at each sequence's target positions, one vector per sequence (on
        `t`'s device, without a host synchronisation)."""
        return list(t.reshape(-1).index_select(0, self._targets_on(t.device)).split(self.lengths))


def pad_rows(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> Rows:
    """One right-padded row per prompt+completion."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    n = len(prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    att = torch.zeros((n, width), dtype=torch.long)
    seq = torch.full((n, width - 1), -1, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        row = list(p) + list(c)
        ids[i, :len(row)] = torch.tensor(row)
        att[i, :len(row)] = 1
        seq[i, len(p) - 1:len(row) - 1] = i
    return Rows(ids, att, None, seq >= 0, seq, [len(c) for c in completions])


def pack_rows(prompts: list[list[int]], completions: list[list[int]], pad_id: int, max_tokens: int) -> Rows:
    """Sequences back to back in rows of at most `max_tokens` (a longer sequence gets a row of its own);
    shorter rows are padded at the end with a segment of their own."""
    rows: list[list[int]] = [[]]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        cur = sum(len(prompts[j]) + len(completions[j]) for j in rows[-1])
        if rows[-1] and cur + len(p) + len(c) > max_tokens:
            rows.append([])
        rows[-1].append(i)
    width = max(sum(len(prompts[j]) + len(completions[j]) for j in r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    seq = torch.full((len(rows), width - 1), -1, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            p, c = prompts[i], completions[i]
            n = len(p) + len(c)
            ids[r, at:at + n] = torch.tensor(list(p) + list(c))
            pos[r, at:at + n] = torch.arange(n)
            seq[r, at + len(p) - 1:at + n - 1] = i
            at += n
        pos[r, at:] = torch.arange(width - at)  # the padding: a segment of its own
    return Rows(ids, None, pos, seq >= 0, seq, [len(c) for c in completions])


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU from pinned memory, without blocking: a copy from pageable
    memory would first wait for everything queued on the stream (a host synchronisation per input)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def layout(prompts: list[list[int]], completions: list[list[int]], pad_id: int, max_tokens: int | None) -> Rows:
    """Packed rows under a token budget, else one padded row per sequence."""
    return pack_rows(prompts, completions, pad_id, max_tokens) if max_tokens else pad_rows(prompts, completions, pad_id)


def micro_batches(lengths: list[int], max_sequences: int, max_tokens: int | None) -> list[list[int]]:
    """Positions 0..n-1 cut in order into micro-batches: `max_sequences` at a time, or as many as fit
    `max_tokens` (prompt + completion tokens; a longer sequence forms a micro-batch of its own)."""
    out: list[list[int]] = []
    load = 0
    for i, n in enumerate(lengths):
        if not out or (len(out[-1]) >= max_sequences if max_tokens is None else load + n > max_tokens):
            out.append([])
            load = 0
        out[-1].append(i)
        load += n
    return out
