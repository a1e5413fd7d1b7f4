"""What the planner needs of a model, read from its flavor on the meta device: sizes, the MoE
layers, and the parameters of each FSDP unit as FSDP and TP treat them (step_time.py's traffic)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from torchtitan.errors import UserError
from torchtitan.estimation.tracker import is_moe_layer
from torchtitan.models import get_train_spec


@dataclass(frozen=True)
class Block:
    """One transformer block's parameters, as FSDP and TP treat them."""

    params: int  # outside the routed experts
    replicated: tuple[int, ...] = ()  # sizes of its 1-D parameters (norms): TP keeps them whole
    tensors: int = 0  # parameter tensors outside the routed experts
    dense_ffn: bool = True  # a dense feed-forward (TP's second pair of collectives)
    experts: int = 0  # the routed experts' parameters (all of them)
    expert_tensors: int = 0
    moe_params: int = 0  # the MoE layer's other parameters (router): part of `params`, not split by TP


@dataclass
class Model:
    """What the plan needs of a model, read from its flavor on the meta device."""

    name: str
    flavor: str
    n_params: int
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    flops_per_token: Callable[[int], int] = field(repr=False)
    # Mixture-of-experts models (0 for dense ones): routed experts per MoE layer and chosen per
    # token, MoE layers, the routed experts' parameters in all of them, an expert's hidden width.
    num_experts: int = 0
    top_k: int = 0
    attention_width: int = 0  # outputs of one block's attention projections (0: unknown)
    moe_layers: int = 0
    expert_params: int = 0
    moe_hidden_dim: int = 0
    # The FSDP units: every block, and the root's two ends (under PP on the first and last stage).
    blocks: tuple[Block, ...] = ()
    embedding_params: int = 0
    head_params: int = 0  # final norm and output (and whatever else the root holds)
    head_replicated: tuple[int, ...] = ()  # the root's 1-D parameters (final norm)
    embedding_tensors: int = 1
    head_tensors: int = 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_flavor(cls, name: str, flavor: str, vocab_size: int = 0) -> Model:
        """`vocab_size`: the tokenizer's (the vocabulary always comes from it); 0: the flavor's."""
        import torch

        spec = get_train_spec(name)
        if flavor not in spec.config:
            raise UserError(f"unknown flavor {flavor!r} of model {name!r}; choose from {', '.join(spec.config)}")
        args = spec.config[flavor]
        if vocab_size:
            args = dataclasses.replace(args, vocab_size=vocab_size)
        with torch.device("meta"):
            model = spec.model_cls.from_model_args(args)
        heads = args.n_heads
        head_dim = getattr(args, "head_dim", None) or args.dim // heads
        hidden = max((m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)
                      and m.in_features == args.dim and m.out_features != args.vocab_size), default=4 * args.dim)
        moe = [m for m in model.modules() if is_moe_layer(m)]
        attention = next((m.attention for m in model.modules() if isinstance(getattr(m, "attention", None), nn.Module)),
                         None)
        experts = {"attention_width": 0 if attention is None else
                   sum(m.out_features for m in attention.modules() if isinstance(m, nn.Linear))}
        if moe:
            w1 = getattr(moe[0].experts, "w1", None)
            experts.update(num_experts=moe[0].num_experts, top_k=moe[0].top_k, moe_layers=len(moe),
                           expert_params=sum(p.numel() for m in moe for p in m.experts.parameters()),
                           moe_hidden_dim=w1.shape[1] if w1 is not None else args.dim)
        return cls(name, flavor, sum(p.numel() for p in model.parameters()), args.n_layers, args.dim, heads,
                   getattr(args, "n_kv_heads", None) or heads, head_dim, hidden, args.vocab_size, model.flops_per_token,
                   **experts, **_fsdp_units(model))


def _fsdp_units(model: nn.Module) -> dict:
    """The blocks and the root's parts of a model on the meta device, as Model's unit fields."""
    blocks = []
    for block in model.layers.values():
        moe = next((m for m in block.modules() if is_moe_layer(m)), None)
        expert_ids = {id(p) for p in moe.experts.parameters()} if moe is not None else set()
        own = [p for p in block.parameters() if id(p) not in expert_ids]
        blocks.append(Block(
            params=sum(p.numel() for p in own), replicated=tuple(p.numel() for p in own if p.ndim == 1),
            tensors=len(own), dense_ffn=getattr(block, "feed_forward", None) is not None,
            experts=sum(p.numel() for p in moe.experts.parameters()) if moe is not None else 0,
            expert_tensors=len(expert_ids),
            moe_params=sum(p.numel() for p in moe.parameters() if id(p) not in expert_ids) if moe is not None else 0))
    in_blocks = {id(p) for p in model.layers.parameters()}
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    head = [p for p in root if id(p) not in embedding]
    return {"blocks": tuple(blocks), "embedding_params": sum(p.numel() for p in root if id(p) in embedding),
            "head_params": sum(p.numel() for p in head), "head_replicated": tuple(p.numel() for p in head if p.ndim == 1),
            "embedding_tensors": len(root) - len(head), "head_tensors": len(head)}
