#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Generation's KV cache per token for DeepSeek-V3's latent attention (docs/generation.md): every
head's keys and values (what generation cached before the latent cache, and what the other
families' attention still caches) against the latent cache (the normalised latent and the rotated
key part), counted from each flavor's shapes; and the bytes the cache actually holds after a
generation on CPU, against the count.

    .venv/bin/python scripts/kv_cache_memory.py [--flavors 671B 16B debugmodel tiny] [--dtype bfloat16]
        [--measure tiny --batch 2 --positions 64]

Per token, for every block of the main model (generation never runs the MTP modules): every head's
keys n_heads x (qk_nope_head_dim + qk_rope_head_dim) and values n_heads x v_head_dim, against
kv_lora_rank + qk_rope_head_dim. `--measure FLAVOR` builds that flavor on CPU in `--dtype`, runs a
prompt of `--positions` - 1 tokens and one decoding step for `--batch` rows, and prints the bytes
the cache holds (KVCache.nbytes) beside batch x positions x the latent count.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from torchtitan.inference.generation import KVCache
from torchtitan.models.deepseek_v3 import deepseek_v3_configs
from torchtitan.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3ModelArgs


@dataclasses.dataclass(frozen=True)
class PerToken:
    layers: int
    per_head_elements: int  # per layer
    latent_elements: int  # per layer
    element_bytes: int

    @property
    def per_head_bytes(self) -> int:
        return self.layers * self.per_head_elements * self.element_bytes

    @property
    def latent_bytes(self) -> int:
        return self.layers * self.latent_elements * self.element_bytes


def per_token(args: DeepSeekV3ModelArgs, dtype: torch.dtype) -> PerToken:
    """The cache's numbers per token, every head's keys and values against the latent one's."""
    per_head = args.n_heads * (args.qk_head_dim + args.v_head_dim)
    return PerToken(args.n_layers, per_head, args.kv_lora_rank + args.qk_rope_head_dim, dtype.itemsize)


@torch.no_grad()
def measured(args: DeepSeekV3ModelArgs, batch: int, positions: int, dtype: torch.dtype) -> int:
    """Bytes the cache holds after a prompt of positions - 1 tokens and one decoding step (both ways
    of attending run), for `batch` rows of a randomly initialised model of `args` in `dtype`."""
    args = dataclasses.replace(args, max_seq_len=positions)
    torch.manual_seed(0)
    model = DeepSeekV3(args)
    model.init_weights()
    model = model.to(dtype).eval()
    tokens = torch.randint(0, args.vocab_size, (batch, positions))
    with KVCache(model, torch.ones(batch, positions, dtype=torch.bool), positions) as cache:
        cache.forward(tokens[:, :-1])
        cache.forward(tokens[:, -1:])
        return cache.nbytes()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", nargs="+", default=["671B", "16B", "debugmodel", "tiny"], choices=list(deepseek_v3_configs))
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--measure", choices=list(deepseek_v3_configs), help="a flavor small enough for CPU: measure its cache")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--positions", type=int, default=64)
    ns = p.parse_args(argv)
    dtype = getattr(torch, ns.dtype)
    print("| flavor | blocks | per-head numbers per block | latent numbers per block | per-head bytes per token | "
          "latent bytes per token | ratio |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for flavor in ns.flavors:
        c = per_token(deepseek_v3_configs[flavor], dtype)
        print(f"| `{flavor}` | {c.layers} | {c.per_head_elements:,} | {c.latent_elements:,} | {c.per_head_bytes:,} "
              f"({_size(c.per_head_bytes)}) | {c.latent_bytes:,} ({_size(c.latent_bytes)}) | "
              f"{c.per_head_bytes / c.latent_bytes:.1f} |")
    if ns.measure:
        c = per_token(deepseek_v3_configs[ns.measure], dtype)
        got = measured(deepseek_v3_configs[ns.measure], ns.batch, ns.positions, dtype)
        tokens = ns.batch * ns.positions
        print(f"\n{ns.measure}, {ns.dtype}, {ns.batch} rows x {ns.positions} positions on CPU: the cache holds {got:,} "
              f"bytes; counted: latent {tokens * c.latent_bytes:,}, every head's keys and values "
              f"{tokens * c.per_head_bytes:,} ({tokens * c.per_head_bytes / got:.1f} x what it holds)")


if __name__ == "__main__":
    main()
