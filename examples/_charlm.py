"""A character-level Transformer language model (Flax NNX) and its corpus: the Python
standard library's own source files, read from the installed Python (nothing is
downloaded).

Used by ``02_char_transformer.py``, ``04_multiprocess.py`` and ``demo.py``.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# '\n' and the 95 printable ASCII characters; anything else becomes '?'.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB = len(ALPHABET)


def stdlib_text(max_chars: int = 2_000_000) -> str:
    """Up to ``max_chars`` characters of the standard library's ``*.py`` files, in sorted
    file-name order (deterministic for a given Python installation)."""
    root = os.path.dirname(os.__file__)
    parts, total = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        try:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not parts:
        raise SystemExit(f"error: found no .py files in {root} to train on")
    return "".join(parts)[:max_chars]


def encode(text: str) -> np.ndarray:
    table = np.full(256, ALPHABET.index("?"), np.int32)
    for i, ch in enumerate(ALPHABET):
        table[ord(ch)] = i
    codes = np.frombuffer(text.encode("ascii", errors="replace"), np.uint8)
    return table[codes]


class Corpus:
    """Token ids split into a training part and a held-out tail (the last ``eval_frac``)."""

    def __init__(self, max_chars: int = 2_000_000, eval_frac: float = 0.05):
        ids = encode(stdlib_text(max_chars))
        cut = int(len(ids) * (1 - eval_frac))
        self.train, self.held_out = ids[:cut], ids[cut:]

    def batch(self, seed: int, step: int, size: int, seq_len: int) -> np.ndarray:
        """``size`` random windows of ``seq_len + 1`` tokens: a pure function of (seed, step)."""
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - seq_len - 1, size)
        return self.train[starts[:, None] + np.arange(seq_len + 1)]

    def eval_batch(self, size: int, seq_len: int) -> np.ndarray:
        """``size`` fixed, evenly spaced windows of the held-out text."""
        starts = np.linspace(0, len(self.held_out) - seq_len - 2, size).astype(np.int64)
        return self.held_out[starts[:, None] + np.arange(seq_len + 1)]


class Block(nnx.Module):
    """Pre-norm Transformer block: causal self-attention and a 4x GELU MLP, no biases."""

    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs):
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.heads = heads
        init = nnx.initializers.normal(0.02)
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, kernel_init=init, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.fc = nnx.Linear(d_model, 4 * d_model, use_bias=False, kernel_init=init, rngs=rngs)
        self.proj = nnx.Linear(4 * d_model, d_model, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        heads = lambda a: a.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        a = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.out(a.reshape(b, t, d))
        return x + self.proj(nnx.gelu(self.fc(self.ln2(x))))


class CharTransformer(nnx.Module):
    """Token + learned position embeddings, ``layers`` blocks, tied output embedding."""

    def __init__(self, *, d_model: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 64,
                 vocab: int = VOCAB, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
        # nnx.List holds sub-modules in Flax 0.12+; earlier versions take a plain list.
        self.blocks = getattr(nnx, "List", list)([Block(d_model, heads, rngs=rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(self.ln(h))


def make_model(*, d_model: int, layers: int, heads: int, seq_len: int, seed: int):
    """``(graphdef, params)`` of a fresh model (``nnx.split`` by ``nnx.Param``)."""
    model = CharTransformer(d_model=d_model, layers=layers, heads=heads, seq_len=seq_len,
                            rngs=nnx.Rngs(seed))
    return nnx.split(model, nnx.Param)


def loss_fn(graphdef, params, tokens: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy (nats) of ``tokens[:, :-1] -> tokens[:, 1:]``."""
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def num_params(params) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(params)))


def sample(graphdef, params, prompt: str, length: int, seq_len: int, *, seed: int = 0,
           temperature: Optional[float] = 0.8) -> str:
    """Generate ``length`` characters after ``prompt`` (greedy if ``temperature`` is None)."""
    model = nnx.merge(graphdef, params)
    ids = list(encode(prompt)) or [0]
    key = jax.random.PRNGKey(seed)
    step = jax.jit(lambda toks: model(toks)[0, -1])
    for _ in range(length):
        window = np.asarray(ids[-seq_len:], np.int32)
        pad = seq_len - len(window)
        toks = np.concatenate([np.zeros(pad, np.int32), window])[None] if pad else window[None]
        logits = step(jnp.asarray(toks))
        if temperature is None:
            nxt = int(jnp.argmax(logits))
        else:
            key, sub = jax.random.split(key)
            nxt = int(jax.random.categorical(sub, logits / temperature))
        ids.append(nxt)
    return "".join(ALPHABET[i] for i in ids[len(encode(prompt)):])
