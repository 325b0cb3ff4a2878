"""Host pools on CPU tensors with the interface SGLang 0.5.23's storage backends read from a host pool.

SGLang's own host pool classes (``sglang/srt/mem_cache/pool_host``: ``MLATokenToKVPoolHost``,
``MambaPoolHost``) cannot be imported without CUDA: their package imports the device memory pool, which
imports triton and SGLang's model configs (torchvision). So these are minimal objects with the same page
geometry and the same methods a storage backend calls: ``page_size``, ``layout``, ``dtype``,
``get_data_page`` / ``get_dummy_flat_data_page`` / ``set_from_flat_data_page`` (HiCacheFile and the generic
path) and ``get_page_buffer_meta`` (the zero-copy paths: one pointer per buffer a page spans). Written from
the interface's documented behaviour, not copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class CpuMLAHostPool:
    """MLA latents: ``kv_buffer`` of ``layer_first`` [layers, tokens, 1, dim] or ``page_first``
    [tokens, layers, 1, dim]; a page is ``page_size`` consecutive token slots."""

    def __init__(
        self,
        layers: int = 4,
        dim: int = 576,
        page_size: int = 64,
        pages: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        layout: str = "page_first",
    ) -> None:
        self.layer_num, self.kv_cache_dim, self.page_size, self.dtype, self.layout = (
            layers,
            dim,
            page_size,
            dtype,
            layout,
        )
        self.size = pages * page_size
        if layout == "layer_first":
            shape = (layers, self.size, 1, dim)
        elif layout == "page_first":
            shape = (self.size, layers, 1, dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        index = int(index)
        if self.layout == "layer_first":
            return self.kv_buffer[:, index : index + self.page_size]
        return self.kv_buffer[index : index + self.page_size]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.layer_num * self.page_size * self.kv_cache_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        item = self.dtype.itemsize
        starts = indices.tolist()[:: self.page_size]
        base = self.kv_buffer.data_ptr()
        if self.layout == "page_first":
            stride = self.layer_num * self.kv_cache_dim * item
            ptrs = [base + s * stride for s in starts]
            return ptrs, [self.page_size * stride] * len(ptrs)
        row = self.kv_cache_dim * item
        ptrs = [base + (layer * self.size + s) * row for s in starts for layer in range(self.layer_num)]
        return ptrs, [self.page_size * row] * len(ptrs)

    def fill(self, index: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        page = self._page(index)
        page.copy_(torch.randn(page.shape, generator=g).to(self.dtype))

    def page(self, index: int) -> torch.Tensor:
        return self._page(index).clone()


class CpuMambaHostPool:
    """Mamba/KDA state per slot (``page_size`` 1, ``page_first``): a recurrent ``temporal`` state
    [slots, layers, *shape] and short-conv states [slots, layers, *shape] each."""

    page_size = 1
    layout = "page_first"

    def __init__(
        self,
        slots: int = 8,
        layers: int = 3,
        temporal: Sequence[int] = (4, 16, 16),
        convs: Sequence[Sequence[int]] = ((3, 96),),
        dtype: torch.dtype = torch.float32,
        conv_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.dtype = dtype
        self.temporal_buffer = torch.zeros((slots, layers, *temporal), dtype=dtype)
        self.conv_buffer = [torch.zeros((slots, layers, *c), dtype=conv_dtype) for c in convs]
        self.size_per_token = sum(b[0].numel() * b.element_size() for b in self._buffers())

    def _buffers(self) -> list[torch.Tensor]:
        return [self.temporal_buffer, *self.conv_buffer]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return torch.cat([b[int(index)].reshape(-1).view(torch.uint8) for b in self._buffers()])

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        flat, at = data_page.reshape(-1).view(torch.uint8), 0
        for b in self._buffers():
            n = b[0].numel() * b.element_size()
            b[int(index)].copy_(flat[at : at + n].clone().view(b.dtype).reshape(b[0].shape))
            at += n

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs, sizes = [], []
        for slot in indices.tolist():
            for b in self._buffers():
                n = b[0].numel() * b.element_size()
                ptrs.append(b.data_ptr() + slot * n)
                sizes.append(n)
        return ptrs, sizes

    def fill(self, index: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for b in self._buffers():
            b[int(index)].copy_(torch.randn(b[0].shape, generator=g).to(b.dtype))

    def page(self, index: int) -> torch.Tensor:
        return self.get_data_page(index).clone()
