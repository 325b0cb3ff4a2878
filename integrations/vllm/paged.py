"""vLLM's paged KV buffers as the connector reads and writes them: whole blocks, whatever the layout.

Every backend keeps a layer's cache as one tensor (or several, for recurrent state) with one dimension
indexed by block id: ``[num_blocks, heads, block, 2·head]`` on CPU, ``[2, num_blocks, block, heads, head]``
for flash attention, ``[num_blocks, ...]`` per state tensor. The connector never interprets the other
dimensions: it moves whole blocks along the block dimension, so one object is bit-for-bit the blocks the
engine computed, and any backend whose block dimension is found works unchanged.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvpool.integrations.vllm.codec import Part

# an element width -> the integer types (torch, numpy) a load moves it as: bits, never values
_BITS = {
    1: (torch.uint8, np.dtype(np.uint8)),
    2: (torch.int16, np.dtype(np.int16)),
    4: (torch.int32, np.dtype(np.int32)),
    8: (torch.int64, np.dtype(np.int64)),
}


class LayoutError(ValueError):
    """A registered KV tensor has no unambiguous block dimension."""


def block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension of ``t`` indexed by block id: the first of size ``num_blocks`` among the first two."""
    dims = [d for d in range(min(2, t.dim())) if t.shape[d] == num_blocks]
    if not dims:
        raise LayoutError(
            f"no dimension of size {num_blocks} (blocks) in a KV tensor of shape {tuple(t.shape)}"
        )
    return dims[0]


class PagedKV:
    """The registered KV tensors of one worker, by layer name, with each tensor's block dimension."""

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], num_blocks: int
    ) -> None:
        self.tensors: dict[str, list[tuple[torch.Tensor, int]]] = {}
        for name, value in kv_caches.items():
            ts = [value] if isinstance(value, torch.Tensor) else list(value)
            for t in ts:
                if t.element_size() not in _BITS:
                    raise LayoutError(f"KV tensor {name} of {t.dtype}: elements of 1, 2, 4 or 8 bytes only")
            self.tensors[name] = [(t, block_dim(t, num_blocks)) for t in ts]

    def parts(self, layer_groups: Sequence[Sequence[str]], blocks: Sequence[Sequence[int]]) -> list[Part]:
        """Parts (name, bytes) of an object holding ``blocks[i]`` of every layer in ``layer_groups[i]``."""
        out = []
        for names, ids in zip(layer_groups, blocks, strict=True):
            for name in names:
                for j, (t, d) in enumerate(self.tensors[name]):
                    per_block = t.numel() // t.shape[d] * t.element_size()
                    out.append(Part(f"{name}#{j}", per_block * len(ids)))
        return out

    def gather(
        self,
        layer_groups: Sequence[Sequence[str]],
        blocks: Sequence[Sequence[int]],
        staging: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The bytes of those blocks, one contiguous host tensor per part (device tensors are copied off).

        ``staging(shape, dtype)`` hands out a host tensor to copy into (the saver recycles them: a fresh
        allocation's first touch costs a page fault per 4 KiB, which on a VM is most of the copy)."""
        out = []
        for names, ids in zip(layer_groups, blocks, strict=True):
            for name in names:
                for t, d in self.tensors[name]:
                    idx = torch.tensor(ids, dtype=torch.long, device=t.device)
                    if staging is not None and t.device.type == "cpu":
                        shape = list(t.shape)
                        shape[d] = len(ids)
                        host = torch.index_select(t, d, idx, out=staging(tuple(shape), t.dtype))
                    else:
                        host = t.index_select(d, idx).contiguous().cpu()
                    out.append(host)
        return out

    def target(
        self, layer_groups: Sequence[Sequence[str]], blocks: Sequence[Sequence[int]], skip: Sequence[int]
    ) -> ObjectTarget:
        """Where an object holding ``blocks[i]`` of every layer in ``layer_groups[i]`` lands, leaving the
        first ``skip[i]`` blocks of group i alone: prepared ahead of its bytes (``ObjectTarget``).

        Why ahead: the destination views depend only on the plan, so the engine's thread builds them in
        ``start_load_kv``, where it holds the GIL anyway, and the thread that reads the object only cuts its
        payload and starts one copy (see ``ObjectTarget``)."""
        dst: list[torch.Tensor] = []
        sources: list[_Source] = []
        # vLLM calls start_load_kv in inference mode, and a view made there may not be written in place
        # outside it, where the reading thread copies: the views are made as ordinary ones
        with torch.inference_mode(False):
            nbytes = self._views(layer_groups, blocks, skip, dst, sources)
        return ObjectTarget(dst, sources, nbytes)

    def _views(
        self,
        layer_groups: Sequence[Sequence[str]],
        blocks: Sequence[Sequence[int]],
        skip: Sequence[int],
        dst: list[torch.Tensor],
        sources: list[_Source],
    ) -> int:
        """Append each destination view and its source to ``dst`` and ``sources``; the payload's bytes."""
        offset = 0
        for names, ids, s in zip(layer_groups, blocks, skip, strict=True):
            runs = _runs(ids, s)
            for name in names:
                for t, d in self.tensors[name]:
                    shape = _part_shape(t, d, len(ids))
                    size = math.prod(shape) * t.element_size()
                    bits = _BITS[t.element_size()]
                    for first, start, n in runs:
                        dst.append(t.narrow(d, first, n).view(bits[0]))
                        whole = start == 0 and n == len(ids)
                        cut = (slice(None),) * d + (slice(start, start + n),)
                        sources.append(_Source(offset, size, bits[1], shape, () if whole else cut))
                    offset += size
        return offset


@dataclass(frozen=True, slots=True)
class _Source:
    """Where the bytes of one destination view lie in the payload: a part's byte range, the part's shape
    in its bit-type, and the run of blocks within it (``()``: all of them)."""

    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    cut: tuple[slice, ...]


class ObjectTarget:
    """One object's destination blocks in the paged KV, and how its payload's bytes map onto them.

    ``write`` cuts the payload into numpy views (no GIL hand-over: a numpy view is made under the GIL
    without releasing it), wraps them with ``torch.from_numpy`` (same), and copies every layer with one
    ``torch._foreach_copy_``, whose copies run in C++ with the GIL released. One hand-over per object,
    not one per tensor call per layer: while the engine steps, each hand-over waits up to the switch
    interval to get the GIL back. Both sides are viewed as same-width integers (float32 as int32, bf16
    as int16...), so the copy moves bits, never values, and what lands is the per-layer copy bit for bit.
    """

    def __init__(self, dst: list[torch.Tensor], sources: list[_Source], nbytes: int) -> None:
        self.dst, self.sources, self.nbytes = dst, sources, nbytes

    def write(self, payload: memoryview) -> None:
        """Copy a checked payload (exactly ``nbytes``) into the object's blocks."""
        if len(payload) != self.nbytes:
            raise ValueError(f"payload of {len(payload)} B for an object of {self.nbytes} B")
        if not self.dst:
            return
        raw = np.frombuffer(payload, dtype=np.uint8)
        with warnings.catch_warnings():  # a read-only source (the store's pool): only ever read from
            warnings.simplefilter("ignore", UserWarning)
            src = [
                torch.from_numpy(raw[s.offset : s.offset + s.nbytes].view(s.dtype).reshape(s.shape)[s.cut])
                for s in self.sources
            ]
        torch._foreach_copy_(self.dst, src)


def _part_shape(t: torch.Tensor, d: int, n: int) -> tuple[int, ...]:
    """The shape of ``n`` blocks of ``t`` taken along its block dimension ``d`` (one part of an object)."""
    shape = list(t.shape)
    shape[d] = n
    return tuple(shape)


def _runs(ids: Sequence[int], skip: int) -> tuple[tuple[int, int, int], ...]:
    """``ids[skip:]`` as maximal runs of consecutive block ids: (first id, its index in ``ids``, length)."""
    out: list[tuple[int, int, int]] = []
    for i in range(skip, len(ids)):
        if out and ids[i] == out[-1][0] + out[-1][2]:
            first, start, n = out[-1]
            out[-1] = (first, start, n + 1)
        else:
            out.append((ids[i], i, 1))
    return tuple(out)
