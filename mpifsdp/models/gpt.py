"""A nanoGPT-shaped GPT: token + position embeddings, pre-LN blocks, final LayerNorm, LM head."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from mpifsdp import Tensor, no_grad, ops
from mpifsdp.base.backend import array_module, array_module_of, to_numpy
from mpifsdp.base.checks import is_count, is_finite_at_least, refuse_invalid
from mpifsdp.fsdp.build import sharded_model
from mpifsdp.nn.layers import Block, Dropout, Embedding, LayerNorm, Linear, norm_and_project, norm_then_linear
from mpifsdp.nn.module import Module, deferred_init, ids_problem
from mpifsdp.planning.planner import UnitSize, unit_sizes

ACTIVATIONS = ("gelu_tanh", "relu")


@dataclass
class GPTConfig:
    vocab_size: int = 256  # token ids 0..vocab_size-1 (256: bytes)
    block_size: int = 128  # the longest context, in tokens
    n_layer: int = 4  # transformer blocks (each a unit under fully_shard(units=model.blocks))
    n_head: int = 4  # attention heads; n_embd must divide by it
    n_embd: int = 128  # the model's width
    dropout: float = 0.0  # dropout rate after attention, in the MLP and on the embeddings
    bias: bool = True  # biases in the linears and LayerNorms
    tie_weights: bool = True  # the head is the token embedding's transpose
    activation: str = "gelu_tanh"  # the MLP's: "gelu_tanh" (GPT-2's "gelu_new") or "relu"
    mlp_hidden: int = 0  # the MLP's width; 0: 4 * n_embd
    ln_eps: float = 1e-5  # every LayerNorm's epsilon

    def __post_init__(self):
        """A size below 1 or a dropout outside [0, 1) fails here, by name, not as a division by zero
        or an empty model later."""
        sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
        bad = [f"{k}={getattr(self, k)!r}" for k in sizes if not is_count(getattr(self, k), 1)]
        if bad:
            raise ValueError(f"GPTConfig: {', '.join(bad)}: sizes are integers >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig: dropout={self.dropout!r} must be in [0, 1)")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"GPTConfig: activation={self.activation!r} is not one of {ACTIVATIONS}")
        if not is_count(self.mlp_hidden):
            raise ValueError(
                f"GPTConfig: mlp_hidden={self.mlp_hidden!r}: an integer >= 1, or 0 for 4 * n_embd"
            )
        if not (isinstance(self.ln_eps, (int, float)) and 0 < self.ln_eps < 1):
            raise ValueError(f"GPTConfig: ln_eps={self.ln_eps!r} must be a number in (0, 1)")

    @property
    def hidden(self) -> int:
        """The MLP's width."""
        return self.mlp_hidden or 4 * self.n_embd


class GPT(Module):
    def __init__(self, config: GPTConfig, seed: int = 1337, dtype=np.float32, device: str = "cpu"):
        self.config = config
        rng = np.random.default_rng(seed)
        kw = dict(rng=rng, dtype=dtype, device=device)
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.wte = Embedding(config.vocab_size, config.n_embd, **kw)
        self.wpe = Embedding(config.block_size, config.n_embd, **kw)
        self.drop = Dropout(config.dropout, seed=int(rng.integers(2**31)))
        shape = dict(hidden=config.hidden, activation=config.activation, eps=config.ln_eps)
        self.blocks = [
            Block(config.n_embd, config.n_head, config.bias, config.dropout, proj_std, **shape, **kw)
            for _ in range(config.n_layer)
        ]
        self.ln_f = LayerNorm(config.n_embd, config.bias, eps=config.ln_eps, dtype=dtype, device=device)
        self.lm_head = None if config.tie_weights else Linear(config.n_embd, config.vocab_size, False, **kw)
        self._device = device

    def forward(self, idx, targets=None):
        """idx (B, T) int tokens -> logits (B, T, vocab), or the mean cross-entropy given targets."""
        idx = idx.data if isinstance(idx, Tensor) else idx
        B, T = idx.shape
        # positions where the token ids are: host ones are checked on the host and copied once, device
        # ones made there (a captured forward copies nothing from the host: fsdp/graphed.py)
        x = self.drop(self.wte(idx) + self.wpe(array_module_of(idx).arange(T)))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if self.lm_head is None:  # tied, the final LayerNorm fused into the head where it can be
            logits = norm_then_linear(self.ln_f, x, self.wte.weight, transpose_w=True)  # (B, T, vocab)
        else:
            logits = norm_and_project(self.ln_f, self.lm_head, x)
        if targets is None:
            return logits
        # the loss in at least float32, also when the model computes in float16 (mixed precision)
        return ops.cross_entropy(logits, targets)

    def check_inputs(self, idx, targets=None) -> str | None:
        """Token ids (B, T) with T <= block_size and ids < vocab_size; targets alike, or -1 (ignored)."""
        vocab = self.config.vocab_size
        problem = ids_problem("idx (token ids)", idx, vocab, ndim=2)
        if problem is None and idx.shape[1] > self.config.block_size:
            problem = f"sequence length {idx.shape[1]} exceeds block_size {self.config.block_size}"
        if problem is None and targets is not None:
            problem = ids_problem("targets", targets, vocab, ndim=2, ignore=-1)
            if problem is None and tuple(targets.shape) != tuple(idx.shape):
                problem = f"targets {tuple(targets.shape)} and idx {tuple(idx.shape)} must have one shape"
        return problem

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; non_embedding leaves out the position table (and the token table if untied)."""
        n = super().num_params()
        if non_embedding:
            n -= self.wpe.weight.size
            if self.lm_head is not None:
                n -= self.wte.weight.size
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), as in the PaLM appendix / nanoGPT."""
        c = self.config
        T = seq_len or c.block_size
        matmul_params = self.num_params() - self.wpe.weight.size
        if self.lm_head is not None:
            matmul_params -= self.wte.weight.size  # the input table is a lookup, not a GEMM
        return 6 * matmul_params + 12 * c.n_layer * c.n_embd * T  # attention scores and mixing

    def generate(
        self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, rng=None
    ):
        """Sample continuations of idx (B, T) on the host RNG; returns a NumPy (B, T + new) array.
        temperature=0: greedy (the most likely token each time, as transformers' do_sample=False).
        Samples in evaluation mode (no dropout); the model's mode is restored afterwards."""
        rng = rng or np.random.default_rng(0)
        xp = array_module(self._device)
        check = functools.partial(self._checked_prompt, idx, max_new_tokens, temperature, top_k)
        sharded = sharded_model(self)  # ranks may hold different prompts: a bad one is named on all
        out = (
            check()
            if sharded is None
            else sharded.comm.run_everywhere(check, "GPT.generate", (ValueError,), ValueError)
        )
        was_training = self.training
        self.eval()
        try:
            return self._sample(out, xp, max_new_tokens, temperature, top_k, rng)
        finally:
            self.train(was_training)

    def _checked_prompt(self, idx, max_new_tokens, temperature, top_k) -> np.ndarray:
        """The prompt as int64 token ids, every argument checked at once by name (a NaN temperature,
        a fractional top_k, a float or 1-D prompt failed deep inside, or sampled something else)."""
        prompt = to_numpy(idx)
        integral = np.issubdtype(prompt.dtype, np.integer)
        ids = (int(prompt.min()), int(prompt.max())) if integral and prompt.size else (0, 0)
        vocab = self.config.vocab_size
        shape_ok = prompt.ndim == 2 and prompt.size > 0
        refuse_invalid(
            "GPT.generate",
            (integral, f"prompt of dtype {prompt.dtype} (token ids: integers)"),
            (shape_ok, f"prompt of shape {prompt.shape} (batch, tokens), both >= 1"),
            (0 <= ids[0] and ids[1] < vocab, f"prompt ids {ids[0]}..{ids[1]} (in [0, {vocab}))"),
            (is_count(max_new_tokens), f"max_new_tokens={max_new_tokens!r} (an integer >= 0)"),
            (is_finite_at_least(temperature, 0), f"temperature={temperature!r} (finite, >= 0; 0: greedy)"),
            (top_k is None or is_count(top_k, 1), f"top_k={top_k!r} (None or an integer >= 1)"),
        )
        return prompt.astype(np.int64)

    def _sample(self, out, xp, max_new_tokens, temperature, top_k, rng):
        with no_grad():
            for _ in range(max_new_tokens):
                context = out[:, -self.config.block_size :]
                logits = to_numpy(self(xp.asarray(context)).data[:, -1, :]).astype(np.float64)
                if temperature <= 0:
                    out = np.concatenate([out, logits.argmax(axis=-1)[:, None]], axis=1)
                    continue
                logits /= max(temperature, 1e-6)
                if top_k is not None:
                    kth = np.sort(logits, axis=-1)[:, -min(top_k, logits.shape[-1])][:, None]
                    logits = np.where(logits < kth, -np.inf, logits)
                probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
                probs /= probs.sum(axis=-1, keepdims=True)
                nxt = np.array([rng.choice(len(p), p=p) for p in probs])
                out = np.concatenate([out, nxt[:, None]], axis=1)
        return out


def gpt_units(config: GPTConfig, units: str = "blocks") -> tuple[list[UnitSize], GPT]:
    """The units fully_shard(model, units=model.blocks) makes of a GPT (units="blocks"; "root": one
    unit), and the model, built without memory (deferred_init: shapes only, any size): for plan()."""
    with deferred_init():
        model = GPT(config)
    return unit_sizes(model, model.blocks if units == "blocks" else []), model
