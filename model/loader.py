"""`load_model`: one entry point for "the embedded tiny model" or "a checkpoint directory"."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .errors import ModelInputError
from .hybrid import HybridModel, resolve_device

# embedded seeded models by name: (layers, DSA indexer key storage or None for dense MLA)
TINY_MODELS: dict[str, tuple[int, str | None]] = {
    "tiny": (4, None),  # trained weights (model/data/tiny.safetensors)
    "tiny-random": (4, None),  # the same architecture, seeded random weights (tests that need them)
    "tiny8": (8, None),
    "tiny-dsa": (4, "bfloat16"),  # K3.1-style: DSA indexer on the MLA layer, bf16 indexer keys
    "tiny-dsa-fp8": (4, "float8_e4m3fn"),  # same weights, keys cached as fp8 e4m3 + fp32 scale
}


def tiny_model_config(name: str) -> ModelConfig | None:
    """The config of the embedded model called ``name`` (no weights built), or None if it is not one: for
    callers that need the architecture only (a gateway's tokenizer/vocab, a schema)."""
    if name not in TINY_MODELS:
        return None
    from .tiny import tiny_config, tiny_dsa_config

    layers, index_dtype = TINY_MODELS[name]
    return tiny_config(layers) if index_dtype is None else tiny_dsa_config(layers, index_dtype)


def load_model(
    name_or_path: str | Path = "tiny",
    device: str | torch.device | None = "cpu",
    dtype: torch.dtype = torch.float32,
) -> HybridModel:
    """A name from `TINY_MODELS` -> an embedded model (``"tiny"``: trained weights; ``"tiny-random"``,
    ``"tiny8"``, ``"tiny-dsa"``, ``"tiny-dsa-fp8"``: seeded random ones); otherwise a Kimi-Linear checkpoint
    dir."""
    dev = resolve_device(device)
    config = tiny_model_config(str(name_or_path))
    if str(name_or_path) == "tiny":
        from .tiny import build_trained_tiny

        return build_trained_tiny(device=dev, dtype=dtype)
    if config is not None:
        from .tiny import build_tiny

        return build_tiny(device=dev, dtype=dtype, config=config)
    p = Path(name_or_path)
    if not p.is_dir():
        raise ModelInputError(
            f"model {str(name_or_path)!r} is neither one of {sorted(TINY_MODELS)} nor a checkpoint directory"
        )
    from .weights import load_checkpoint

    return load_checkpoint(p, device=dev, dtype=dtype)
