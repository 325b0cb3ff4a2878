"""What the gateway needs from the model without serving it: tokenizer, vocabulary, EOS ids, fingerprint.

Why not load the weights: the gateway only tokenizes and hashes. The config and tokenizer are cheap; the
fingerprint (the hash root every worker uses) normally comes from a worker's readiness line via
``--fingerprint``; only when it is absent is the model built once to compute it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpool.gateway.chat_template import TextCodec
from kvpool.model.config import ModelConfig
from kvpool.model.hf_config import read_config_json
from kvpool.model.tokenizer import load_tokenizer


@dataclass
class ModelInfo:
    codec: TextCodec
    fingerprint: bytes
    config: ModelConfig


def model_config(model: str) -> ModelConfig:
    from kvpool.model.loader import tiny_model_config

    config = tiny_model_config(model)
    if config is not None:
        return config
    return read_config_json(Path(model) / "config.json")


def load_model_info(model: str, fingerprint_hex: str | None) -> ModelInfo:
    config = model_config(model)
    tokenizer = load_tokenizer(model, config)
    if fingerprint_hex:
        fingerprint = bytes.fromhex(fingerprint_hex)
    else:
        from kvpool.model.loader import load_model

        fingerprint = load_model(model).fingerprint()
    codec = TextCodec(tokenizer, config.vocab_size, config.eos_token_id or ())
    return ModelInfo(codec, fingerprint, config)
