"""Sampling from a causal language model as an RNN: prefill the prompt in parallel, then one token at a time.

`generate` runs `CausalLM.prefill` on the prompt (the parallel causal op of every layer, which also hands
back each layer's decoding state), then `CausalLM.step` once per new token: linear and Performer layers
carry (S, z), the causal sliced layers their sorted runs, softmax a KV cache (`attnlab.attention.decoding`).
`next_token` draws from the logits with a temperature (0: greedy) and top-k, from a seeded generator, so a
seed gives the same text every time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnlab.errors import UserError


def check_sampling(temperature: float, top_k: int | None, max_new_tokens: int) -> None:
    if not temperature >= 0:
        raise UserError(
            f"--temperature {temperature}: expected a number >= 0 (0: always the likeliest token)"
        )
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k {top_k}: expected an integer >= 1 (or leave it out: the whole vocabulary)")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: expected an integer >= 1")


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator
) -> torch.Tensor:
    """Token ids (B,) drawn from logits (B, V): softmax(logits / temperature) over the top_k likeliest."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@dataclass
class Generation:
    tokens: list[int]  # the new tokens (of the first sequence)
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("inf")


@torch.no_grad()
def generate(
    model,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    on_token: Callable[[int], None] | None = None,
) -> Generation:
    """``max_new_tokens`` ids after ``prompt`` (a non-empty list of ids); ``on_token`` sees each one."""
    check_sampling(temperature, top_k, max_new_tokens)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    start = time.perf_counter()
    logits, state = model.prefill(ids)
    logits = logits[:, -1]
    prefill_s = time.perf_counter() - start
    new: list[int] = []
    start = time.perf_counter()
    for i in range(max_new_tokens):
        token = next_token(logits, temperature, top_k, generator)
        new.append(int(token[0]))
        if on_token is not None:
            on_token(new[-1])
        if i + 1 < max_new_tokens:  # the last token's logits are never used
            logits, state = model.step(token, state)
    return Generation(new, prefill_s, time.perf_counter() - start)
