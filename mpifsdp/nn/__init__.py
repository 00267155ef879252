"""Modules: the module system with deferred initialisation (module.py) and the layers a GPT is made
of, with the dispatch that fuses a LayerNorm into the projection after it (layers.py).

May import: ops, autodiff, base. Layers know nothing of FSDP: fully_shard reaches them through one
hook, `Module._forward_wrapper`, and finds its ShardedModel again through `Module._sharded`.
"""

from .layers import MLP, Block, CausalSelfAttention, Dropout, Embedding, LayerNorm, Linear
from .module import Module, deferred_init

__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "Module",
    "deferred_init",
]
