"""Kimi-Linear checkpoint directories (``config.json`` + ``*.safetensors``, single file or sharded with
``model.safetensors.index.json``) <-> `HybridModel`.

Our parameter names are the checkpoint names except that MLPs live under ``mlp`` (the checkpoint, as written
by transformers' ``save_pretrained``, says ``block_sparse_moe``). Also accepted on load, so that any
transformers-side layout works: ``mlp.*``, ``self_attn.forget_gate.*``, the fused
``self_attn.conv1d.weight`` and the stacked ``experts.gate_up_proj``/``experts.down_proj``. Every tensor must
be accounted for: a missing, unexpected or wrongly shaped tensor raises `WeightsError` naming it (a silently
half-loaded model would produce plausible garbage that the cache would then faithfully store).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .errors import WeightsError
from .hf_config import config_to_hf, read_config_json
from .hybrid import HybridModel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, via the shard index when there is one."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index}: bad shard index ({exc})") from None
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise WeightsError(f"shard {f.name} listed in {INDEX_FILE} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors in {path}")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in out:
                    raise WeightsError(f"tensor {name} appears in more than one shard", tensor=name)
                out[name] = st.get_tensor(name)
    return out


def to_internal(tensors: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint names -> our parameter names (splitting fused/stacked layouts)."""
    out: dict[str, torch.Tensor] = {}
    D = config.kda_dim
    for name, t in tensors.items():
        n = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
        if n.endswith(".self_attn.conv1d.weight"):
            if t.shape[0] != 3 * D:
                raise WeightsError(f"{name}: fused conv has {t.shape[0]} rows, want {3 * D}", tensor=name)
            base = n[: -len("conv1d.weight")]
            for part, chunk in zip("qkv", t.split(D, 0), strict=True):
                out[f"{base}{part}_conv1d.weight"] = chunk
            continue
        m = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", n)
        if m:
            base, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    w1, w3 = t[e].chunk(2, dim=0)
                    out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = w1, w3
                else:
                    out[f"{base}.{e}.w2.weight"] = t[e]
            continue
        out[n] = t
    return out


def to_checkpoint_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> the names transformers' ``save_pretrained`` writes for Kimi-Linear."""
    return {n.replace(".mlp.", ".block_sparse_moe."): t for n, t in state.items()}


@torch.no_grad()
def load_state(model: HybridModel, tensors: Mapping[str, torch.Tensor]) -> HybridModel:
    """Copy checkpoint tensors into ``model`` after checking names and shapes one by one."""
    c = model.config
    given = to_internal(tensors, c)
    params = model.state_dict()
    optional = {"lm_head.weight"} if c.tie_word_embeddings else set()
    missing = sorted(set(params) - set(given) - optional)
    if missing:
        raise WeightsError(
            f"checkpoint lacks {len(missing)} tensor(s), first: {missing[0]}", tensor=missing[0]
        )
    unexpected = sorted(set(given) - set(params))
    if unexpected:
        raise WeightsError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s), first: {unexpected[0]}",
            tensor=unexpected[0],
        )
    for name, t in sorted(given.items()):
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        want = params[name]
        if tuple(t.shape) != tuple(want.shape):
            raise WeightsError(
                f"{name}: checkpoint shape {tuple(t.shape)}, config implies {tuple(want.shape)}", tensor=name
            )
        want.copy_(t.to(want.dtype))
    model.invalidate_fingerprint()
    return model


def load_checkpoint(
    path: str | Path, device: str | torch.device | None = "cpu", dtype: torch.dtype = torch.float32
) -> HybridModel:
    """Build a `HybridModel` from a Kimi-Linear checkpoint directory."""
    p = Path(path)
    if not p.is_dir():
        raise WeightsError(f"{p} is not a checkpoint directory")
    config = read_config_json(p / "config.json")
    model = HybridModel(config, device="cpu", dtype=dtype)
    load_state(model, read_tensors(p))
    from .hybrid import resolve_device

    return model.to(resolve_device(device))


def save_checkpoint(model: HybridModel, path: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` + safetensors (sharded with an index when ``max_shard_bytes`` is exceeded) in the
    layout transformers' ``KimiLinearForCausalLM.from_pretrained`` reads."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(model.config)
    config["dtype"] = str(model.dtype).removeprefix("torch.")
    (p / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {n: t.detach().to("cpu").contiguous() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = to_checkpoint_names(state)
    meta = {"format": "pt"}
    if (
        max_shard_bytes is None
        or sum(t.numel() * t.element_size() for t in state.values()) <= max_shard_bytes
    ):
        save_file(state, str(p / SINGLE_FILE), metadata=meta)
        return p
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(p / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (p / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return p
