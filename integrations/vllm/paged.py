"""vLLM's paged KV buffers as the connector reads and writes them: whole blocks, whatever the layout.

Every backend keeps a layer's cache as one tensor (or several, for recurrent state) with one dimension
indexed by block id: ``[num_blocks, heads, block, 2·head]`` on CPU, ``[2, num_blocks, block, heads, head]``
for flash attention, ``[num_blocks, ...]`` per state tensor. The connector never interprets the other
dimensions: it moves whole blocks along the block dimension, so one object is bit-for-bit the blocks the
engine computed, and any backend whose block dimension is found works unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import xxhash
from kvpool.integrations.vllm.codec import Part


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

    def scatter(
        self,
        payload: memoryview,
        layer_groups: Sequence[Sequence[str]],
        blocks: Sequence[Sequence[int]],
        skip: Sequence[int],
    ) -> int:
        """Write an object's payload into the blocks, leaving the first ``skip[i]`` of group i alone; returns
        the xxh3-64 of the whole payload, computed in the same pass.

        Why fused: the payload is read once, part by part (one layer's blocks, ~100 KiB-1 MiB), hashed and
        then copied while it is still in cache, so the check costs no second pass over memory. The blocks
        are written before the digest is known: the caller compares it and, on a mismatch, reports these
        blocks to vLLM, which recomputes them before anything reads them. One tensor over the whole payload
        and slices of it per part keep the per-part cost to a few tensor views (a load is ~10^3 parts)."""
        digest = xxhash.xxh3_64()
        with warnings.catch_warnings():  # a read-only source (the store's pool): only ever read from
            warnings.simplefilter("ignore", UserWarning)
            raw = (
                torch.frombuffer(payload, dtype=torch.uint8)
                if len(payload)
                else torch.empty(0, dtype=torch.uint8)
            )
        offset = 0
        for names, ids, s in zip(layer_groups, blocks, skip, strict=True):
            n_ids = len(ids) - s
            first = ids[s] if n_ids > 0 else 0
            run = (
                n_ids > 0
                and ids[-1] - first == n_ids - 1
                and list(ids[s:]) == list(range(first, ids[-1] + 1))
            )
            idx: torch.Tensor | None = None
            for name in names:
                for t, d in self.tensors[name]:
                    per_block = t.numel() // t.shape[d] * t.element_size()
                    n = per_block * len(ids)
                    digest.update(payload[offset : offset + n])
                    if n_ids > 0:
                        shape = list(t.shape)
                        shape[d] = len(ids)
                        src = raw[offset : offset + n].view(t.dtype).view(shape)
                        if s:
                            src = src.narrow(d, s, n_ids)  # a view: one copy, into t
                        if run:
                            t.narrow(d, first, n_ids).copy_(src)
                        else:
                            if idx is None or idx.device != t.device:
                                idx = torch.tensor(ids[s:], dtype=torch.long, device=t.device)
                            t.index_copy_(d, idx, src.to(t.device, non_blocking=False))
                    offset += n
        return digest.intdigest()
