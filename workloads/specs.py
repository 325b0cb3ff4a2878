"""Model specs for simulation and pricing: bytes the cache holds and FLOPs a hit saves.

Byte figures are overview §7.4/§4.2 (overview §3): an MLA block costs ``mla_bytes_per_token`` x tokens, a
KDA checkpoint costs ``kda_bytes_per_checkpoint`` whatever the length (K3: 429 MiB, as much as ~32 MLA
blocks of 512 tokens), which is why checkpoints are sparse and why the simulator must count them.

``prefill_flops_per_token`` is the linear part, 2 x active parameters, ignoring the attention term that
grows with context; it therefore *under*-states compute saved by long hits (a conservative provider view).
Active-parameter counts: tiny 2.7 M (overview §7.4), Kimi-Linear-48B-A3B 3 B (its name); K3's is not
published in our references: **assumed 48 B** (Kimi K2's 32 B active scaled by 93/61 layers). Edit here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.workloads.errors import SpecError


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What one model costs the cache (bytes) and what a cached token saves (FLOPs)."""

    name: str
    mla_bytes_per_token: int  # all MLA layers together
    kda_bytes_per_checkpoint: int  # all KDA layers' recurrent + conv state; 0 for a pure-MLA model
    prefill_flops_per_token: float
    default_block_size: int
    description: str

    @property
    def hybrid(self) -> bool:
        """A hybrid model needs a KDA checkpoint at the usable boundary (the joint rule)."""
        return self.kda_bytes_per_checkpoint > 0

    def mla_block_bytes(self, tokens: int) -> int:
        return self.mla_bytes_per_token * tokens

    @property
    def breakeven_tokens(self) -> float:
        """Tokens whose MLA latents weigh as much as one KDA checkpoint."""
        return self.kda_bytes_per_checkpoint / self.mla_bytes_per_token


SPECS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
        mla_bytes_per_token=160,  # 1 MLA layer x (64 + 16) latent values x bf16
        kda_bytes_per_checkpoint=3 * (16384 + 1152 * 2),  # 3 KDA layers: fp32 state + bf16 conv values
        prefill_flops_per_token=2 * 2.7e6,
        default_block_size=64,
        description="embedded tiny test model (3 KDA + 1 MLA), overview §7.4",
    ),
    "kimi-linear-48b": ModelSpec(
        name="kimi-linear-48b",
        mla_bytes_per_token=8064,  # 7 MLA layers x 1152
        kda_bytes_per_checkpoint=43_417_600,  # 20 KDA layers x 2,170,880
        prefill_flops_per_token=2 * 3.0e9,
        default_block_size=512,
        description="Kimi-Linear-48B-A3B (20 KDA + 7 MLA), overview §7.5",
    ),
    "k3": ModelSpec(
        name="k3",
        mla_bytes_per_token=27_648,  # 24 MLA layers x 576 values x bf16
        kda_bytes_per_checkpoint=449_372_160,  # 69 KDA layers x 6,512,640 (428.6 MiB)
        prefill_flops_per_token=2 * 48e9,  # ASSUMED 48 B active parameters, see module docstring
        default_block_size=512,
        description="Kimi-K3 scale (69 KDA + 24 MLA), overview §7.5; active params assumed 48 B",
    ),
    "k3.1": ModelSpec(
        name="k3.1",
        # 24 MLA layers x (1152 B bf16 latent + 132 B DSA indexer key: 128 fp8 e4m3 + one fp32 scale),
        # every MLA layer indexing (overview §7.2, docs/design/dsa.md); 256 B per key if cached in bf16
        mla_bytes_per_token=24 * (1152 + 132),  # 30,816
        kda_bytes_per_checkpoint=449_372_160,  # KDA unchanged from K3
        prefill_flops_per_token=2 * 48e9,  # ASSUMED as for k3 (the indexer adds < 1% of the linear FLOPs)
        default_block_size=512,
        description="Kimi-K3.1 scale: K3 + DSA lightning indexer on its 24 MLA layers (fp8 keys), "
        "overview §7.2/§4.2",
    ),
}


def get_spec(name: str, pure_mla: bool = False) -> ModelSpec:
    """The spec called ``name``; ``pure_mla`` drops the KDA state (a model with MLA layers only, whose
    usable prefix is the plain longest MLA prefix)."""
    try:
        spec = SPECS[name]
    except KeyError:
        raise SpecError(f"unknown model spec {name!r}; choose one of {sorted(SPECS)}") from None
    if pure_mla:
        return ModelSpec(
            name=f"{spec.name}-mla-only",
            mla_bytes_per_token=spec.mla_bytes_per_token,
            kda_bytes_per_checkpoint=0,
            prefill_flops_per_token=spec.prefill_flops_per_token,
            default_block_size=spec.default_block_size,
            description=spec.description + " (KDA state ignored)",
        )
    return spec
