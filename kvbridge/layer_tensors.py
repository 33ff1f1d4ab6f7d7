"""`LayerTensors`: an engine's KV cache held one tensor per layer, each in an allocation of its own.

kvbridge's connectors take an engine's KV cache as one view `[num_blocks, num_layers, *page_shape]`
over one buffer (layout.py). Some engines allocate each layer alone (vLLM 0.25's V2 model runner,
its default on GPUs): no single view reaches every layer. They are handed a `LayerTensors` instead,
with a `KVCacheLayout.per_layer` layout whose offsets give layer l's region the virtual start
`l * layer_stride` (so every descriptor, digest and copy is computed as for a layer-outermost
buffer) and whose regions are registered with NIXL at once (`KVRegion.layer_addrs`).

It offers what the movers need of the one view, for whole blocks: `index_select(0, ids)` gathers
blocks into a new `[n, num_layers, *page_shape]` tensor, `gather_into` does it into a given one,
`index_copy_(0, ids, src)` scatters them back. Nothing else indexes it: CUDA IPC copies and reads
translated between unlike layouts are refused for it, naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvbridge.errors import ConfigError
from kvbridge.layout import KVCacheLayout

if TYPE_CHECKING:
    import torch


class LayerTensors:
    """`layers[l]`: layer l's pages, `[num_blocks, *page_shape]`, pages dense, `layout.block_stride`
    bytes apart. Checked against `layout` when built (ConfigError naming the layer)."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVCacheLayout) -> None:
        if len(layers) != layout.num_layers:
            raise ConfigError(f"LayerTensors: {len(layers)} layer tensors for a layout of {layout.num_layers} layers")
        shape, strides = layout.shape[:1] + layout.shape[2:], layout.strides[:1] + layout.strides[2:]
        first = layers[0]
        for i, t in enumerate(layers):
            placed = all(n == 1 or s == want for n, s, want in zip(shape, t.stride(), strides))
            if tuple(t.shape) != shape or not placed or t.dtype != first.dtype or t.device != first.device:
                raise ConfigError(
                    f"LayerTensors: layer {i} has shape {tuple(t.shape)}, strides {tuple(t.stride())}, {t.dtype} on "
                    f"{t.device}; the layout says shape {shape}, strides {strides}, like layer 0 ({first.dtype} on {first.device})"
                )
            if t.element_size() != layout.element_size:
                raise ConfigError(f"LayerTensors: {t.element_size()}-byte elements, the layout has {layout.dtype}")
        self.layers = list(layers)
        self.layout = layout

    # what code written for one tensor asks of it
    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def is_cuda(self) -> bool:
        return self.layers[0].is_cuda

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the view it stands for: (num_blocks, num_layers, *page_shape)."""
        return self.layout.shape

    def element_size(self) -> int:
        return self.layout.element_size

    def layer_span(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s bytes from its first page to the end of its last: [layer_region_nbytes] uint8."""
        import torch

        t = self.layers[layer]
        n = self.layout.layer_region_nbytes // self.layout.element_size
        return t.as_strided((n,), (1,), t.storage_offset()).view(torch.uint8)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Blocks `index` (on this device) gathered: a new [n, num_layers, *page_shape] tensor."""
        import torch

        out = torch.empty((len(index), *self.shape[1:]), dtype=self.dtype, device=self.device)
        return self.gather_into(index, out, dim)

    def gather_into(self, index: torch.Tensor, out: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Blocks `index` into `out` ([n, num_layers, *page_shape], contiguous); returns `out`."""
        import torch

        if dim != 0:
            raise ValueError("LayerTensors gathers whole blocks (dim 0) only")
        return torch.stack([layer.index_select(0, index) for layer in self.layers], dim=1, out=out)

    def index_copy_(self, dim: int, index: torch.Tensor, source: torch.Tensor) -> LayerTensors:
        """Blocks `source` ([n, num_layers, *page_shape]) written into blocks `index` of every layer."""
        if dim != 0:
            raise ValueError("LayerTensors scatters whole blocks (dim 0) only")
        for i, layer in enumerate(self.layers):
            layer.index_copy_(0, index, source[:, i])
        return self
