"""A tiny random Llama checkpoint for the vLLM tests, built at test time (no download)."""

from __future__ import annotations

import sys
from pathlib import Path


def make_tiny_llama(out: Path, hidden: int = 128, layers: int = 2, kv_heads: int = 1) -> Path:
    """Random Llama with heads of 64 (the CPU attention kernels need it): by default two layers, 2 heads,
    1 KV head, varied greedy tokens (``initializer_range`` 0.3), float32. The bench asks for a larger one,
    so that recomputing a prompt costs what it would cost relative to loading it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        initializer_range=0.3,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(make_tiny_llama(Path(sys.argv[1])))
