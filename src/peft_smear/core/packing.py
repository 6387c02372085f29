"""Packed and padding-free batches (TRL's ``SFTConfig(packing=True)``, transformers' ``DataCollatorWithFlattening``):
several sequences per row, no attention mask, starts told by ``position_ids``, ``cu_seq_lens_q`` or ``seq_idx``. Each
sequence routes as its own example: a wrapped layer unpacks its input to a padded batch (a sequence per row), runs the
per-example path unchanged and packs the output back; the wrapped module runs on the packed rows, no padding work."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F


BOUNDARY_SOURCES = ("position_ids", "cu_seq_lens_q", "seq_idx")
PACKING_ARGUMENTS = (*BOUNDARY_SOURCES, "cu_seq_lens_k")
"""Arguments that may start a sequence in a row (``cu_seq_lens_k`` stands in for a missing ``cu_seq_lens_q``)."""


class PackedLayout:
    """Index maths from packed ``[rows, tokens]`` to padded ``[sequences, longest]`` and back: a gather per tensor."""

    def __init__(self, starts: torch.Tensor) -> None:
        starts = starts.clone()
        starts[:, 0] = True  # a sequence never continues from the previous row
        self.rows, self.row_length = starts.shape
        flat = starts.reshape(-1)
        total = flat.numel()
        device = starts.device
        first_token = flat.nonzero().squeeze(1)  # [S]: flat index of each sequence's first token
        self.lengths = torch.diff(first_token, append=first_token.new_tensor([total]))
        self.num_sequences, self.max_length = first_token.numel(), int(self.lengths.max())
        sequence_of_token = flat.long().cumsum(0) - 1
        offset = torch.arange(total, device=device) - first_token[sequence_of_token]
        self.sequence_rows = first_token // self.row_length  # [S]: each sequence's row in the packed batch
        self.mask = torch.arange(self.max_length, device=device) < self.lengths.unsqueeze(1)
        """``[S, longest]`` bool: the real tokens of the padded batch."""
        positions = torch.arange(self.max_length, device=device).masked_fill(~self.mask, 0)
        self._unpack_index = (first_token.unsqueeze(1) + positions).reshape(-1)  # padded slot -> packed token
        self._pack_index = sequence_of_token * self.max_length + offset  # packed token -> padded slot
        self._indices = {device: (self._unpack_index, self._pack_index)}
        self._last_unpacked: tuple[weakref.ref, tuple[int, int], torch.Tensor] | None = None

    def unpack(self, x: torch.Tensor, shared: bool = False) -> torch.Tensor:
        """``[rows, tokens, ...]`` -> ``[sequences, longest, ...]``; padded slots repeat a real token (finite, masked
        out). ``shared``: a layer input unpacked once for all layers reading it (q, k, v), which route it together."""
        last = self._last_unpacked
        state = (x._version, torch._C._current_graph_task_id())  # a checkpointed recomputation unpacks anew
        if shared and last is not None and last[0]() is x and last[1] == state:
            return last[2]
        if x.dim() < 3 or tuple(x.shape[:2]) != (self.rows, self.row_length):
            raise ValueError(
                f"This call packs {self.num_sequences} sequences in [{self.rows}, {self.row_length}] rows, but a "
                f"SMEAR layer got an input of shape {tuple(x.shape)}: it cannot tell its sequences apart. Wrap only "
                "layers that see the packed tokens, or call the model unpacked."
            )
        unpacked = self._gather(x, unpack=True)
        if shared:
            self._last_unpacked = (weakref.ref(x), state, unpacked)
        return unpacked

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[sequences, longest, ...]`` -> ``[rows, tokens, ...]``, the inverse of :meth:`unpack` on real tokens."""
        return self._gather(x, unpack=False)

    def unpack_tokens(self, values: torch.Tensor, fill: int | bool, name: str) -> torch.Tensor:
        """A per-token ``[rows, tokens]`` input (a routing mask may be shorter) unpacked, ``fill`` at padded slots."""
        if values.dim() != 2 or values.shape[0] != self.rows or values.shape[1] > self.row_length:
            raise ValueError(
                f"{name} has shape {tuple(values.shape)} but the packed input is [{self.rows}, {self.row_length}]."
            )
        values = F.pad(values, (0, self.row_length - values.shape[1]), value=fill)
        return self._gather(values, unpack=True).masked_fill(~self.mask.to(values.device), fill)

    def per_sequence(self, values: torch.Tensor, name: str) -> torch.Tensor:
        """A per-example input (``smear_task_ids``), given per sequence or per row (shared by its sequences)."""
        if values.shape[0] == self.num_sequences:
            return values
        if values.shape[0] == self.rows:
            return values[self.sequence_rows.to(values.device)]
        raise ValueError(
            f"{name} has {values.shape[0]} entries, but the packed batch has {self.rows} rows holding "
            f"{self.num_sequences} sequences: give one per sequence (in order) or one per row."
        )

    def _gather(self, x: torch.Tensor, unpack: bool) -> torch.Tensor:  # x's leading 2 dims packed -> padded, or back
        if x.device not in self._indices:
            self._indices[x.device] = (self._unpack_index.to(x.device), self._pack_index.to(x.device))
        index = self._indices[x.device][0 if unpack else 1]
        shape = (self.num_sequences, self.max_length) if unpack else (self.rows, self.row_length)
        return x.reshape(-1, *x.shape[2:]).index_select(0, index).view(*shape, *x.shape[2:])


def packed_layout(arguments: Mapping[str, Any]) -> PackedLayout | None:
    """The layout of a call (``arguments`` by name) packing several sequences per row, or ``None``: no attention mask
    (or all ones), boundaries (:data:`PACKING_ARGUMENTS`) in a row. Disagreeing ones: an error (another's tokens)."""
    tokens = next((arguments[n] for n in ("input_ids", "inputs_embeds") if arguments.get(n) is not None), None)
    if tokens is None or tokens.dim() < 2 or tokens.shape[1] < 2:  # decode steps see one token: never packed
        return None
    rows, length = tokens.shape[0], tokens.shape[1]
    sources = {name: arguments[name] for name in PACKING_ARGUMENTS if isinstance(arguments.get(name), torch.Tensor)}
    if "cu_seq_lens_q" in sources:  # cu_seq_lens_k only stands in for a missing cu_seq_lens_q
        sources.pop("cu_seq_lens_k", None)
    if not sources:  # decided without reading any tensor: an ordinary call costs no synchronisation (nor graph break)
        return None
    mask = arguments.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or not bool(mask.bool().all())):
        return None
    found = {name: _sequence_starts(name, value, rows, length) for name, value in sources.items()}
    (first_name, starts), *others = found.items()
    for name, other in others:
        if not torch.equal(other.to(starts.device), starts):
            raise ValueError(
                f"The packed batch's sequence boundaries disagree: {first_name} starts sequences at "
                f"{_start_list(starts)}, {name} at {_start_list(other)} (row, token). Pass consistent boundaries."
            )
    if int(starts.sum()) == rows:
        return None
    return PackedLayout(starts)


def _sequence_starts(name: str, value: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """``[rows, tokens]`` bool, true where a sequence starts, as ``name`` tells it."""
    if name == "position_ids" or name == "seq_idx":
        if value.dim() == 1:
            value = value.unsqueeze(0)
        if value.dim() != 2 or value.shape[0] not in (1, rows) or value.shape[1] != length:
            raise ValueError(f"{name} must be [batch, tokens] = [{rows}, {length}], got {tuple(value.shape)}.")
        value = value.expand(rows, length)
        step = 1 if name == "position_ids" else 0  # transformers' rule (find_packed_sequence_indices)
        starts = torch.ones(rows, length, dtype=torch.bool, device=value.device)
        starts[:, 1:] = value[:, 1:] != value[:, :-1] + step  # not the predecessor (plus one, for positions)
        return starts
    cumulative = value.flatten().long()  # cu_seq_lens_*: cumulative lengths over the flat batch, 0 to rows * tokens
    if cumulative.numel() < 2 or int(cumulative[0]) != 0 or int(cumulative[-1]) != rows * length:
        raise ValueError(
            f"{name} must run from 0 to the number of tokens in the batch ({rows * length}), got "
            f"{cumulative.tolist()}."
        )
    flat = torch.zeros(rows * length, dtype=torch.bool, device=value.device)
    flat[cumulative[:-1]] = True
    starts = flat.view(rows, length)
    if not bool(starts[:, 0].all()):
        raise ValueError(f"{name} {cumulative.tolist()} has a sequence that runs across rows of the batch.")
    return starts


def _start_list(starts: torch.Tensor) -> list[tuple[int, int]]:
    return [tuple(pair) for pair in starts.nonzero().tolist()]
