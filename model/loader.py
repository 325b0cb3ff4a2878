"""`load_model`: one entry point for "the embedded tiny model" or "a checkpoint directory"."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import ModelInputError
from .hybrid import HybridModel, resolve_device


def load_model(
    name_or_path: str | Path = "tiny",
    device: str | torch.device | None = "cpu",
    dtype: torch.dtype = torch.float32,
) -> HybridModel:
    """``"tiny"`` (or ``"tiny8"``, 8 layers) -> the seeded default; otherwise a Kimi-Linear checkpoint dir."""
    dev = resolve_device(device)
    if str(name_or_path) in ("tiny", "tiny8"):
        from .tiny import build_tiny

        return build_tiny(device=dev, dtype=dtype, num_layers=8 if str(name_or_path) == "tiny8" else 4)
    p = Path(name_or_path)
    if not p.is_dir():
        raise ModelInputError(f"model {str(name_or_path)!r} is neither 'tiny' nor a checkpoint directory")
    from .weights import load_checkpoint

    return load_checkpoint(p, device=dev, dtype=dtype)
