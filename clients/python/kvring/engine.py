"""A tiny decoder-only transformer in numpy: the reference "engine" of the
tests and demos. **Its weights are random** (seeded); it is not a trained
model, but it computes what a real one does, layer by layer: token
embedding, RMSNorm, Q/K/V projections with rotary position embedding,
grouped-query attention, an output projection, a SwiGLU MLP, tied output
logits. K and V are kept in float16, as an engine's KV cache would be, so
attention over KV read back from kvring sees exactly the values a local
cache holds.

Attention is a callback, so the same forward pass runs with a local KV cache
(LocalAttention) or with kvring (kvring.connector): the end-to-end tests
check that both give the same next-token logits.
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    d_model: int = 256
    layers: int = 4
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 512
    rope_base: float = 10000.0
    block_tokens: int = 16


def rms_norm(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, base):
    """Rotary embedding on the last axis of x [n, heads, dim] (pairs (2i, 2i+1))."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions.astype(np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out.astype(np.float32)


def partial_attention(q, k, v, q_pos, k_pos):
    """Causal GQA attention of q [n, H, D] over k, v [t, KH, D] (any dtype):
    (out [n, H, D] float32, lse [n, H] float32); rows that see no key give
    out = 0, lse = -inf. Query head h reads kv head h // (H // KH)."""
    n, H, D = q.shape
    t, KH, _ = k.shape
    if t == 0:
        return np.zeros((n, H, D), np.float32), np.full((n, H), -np.inf, np.float32)
    g = H // KH
    kk = np.repeat(k.astype(np.float64), g, axis=1)  # [t, H, D]
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    s = np.einsum("nhd,thd->nht", q.astype(np.float64), kk) / np.sqrt(D)
    mask = k_pos[None, None, :] <= q_pos[:, None, None]
    s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    den = np.sum(p, axis=-1, keepdims=True)
    out = np.einsum("nht,thd->nhd", p, vv) / np.where(den > 0, den, 1.0)
    lse = np.where(den[..., 0] > 0, np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0)) + m_safe[..., 0], -np.inf)
    return out.astype(np.float32), lse.astype(np.float32)


class Model:
    """Random-weight transformer (see the module docstring). Thread-compatible."""

    def __init__(self, config: Config = Config(), seed: int = 0):
        self.cfg = c = config
        r = np.random.default_rng(seed)

        def w(*shape):
            return (r.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.embed = (r.standard_normal((c.vocab, c.d_model)) * 0.5).astype(np.float32)
        self.layers = []
        for _ in range(c.layers):
            self.layers.append(dict(
                attn_norm=np.ones(c.d_model, np.float32), ffn_norm=np.ones(c.d_model, np.float32),
                wq=w(c.d_model, c.q_heads * c.head_dim), wk=w(c.d_model, c.kv_heads * c.head_dim),
                wv=w(c.d_model, c.kv_heads * c.head_dim), wo=w(c.q_heads * c.head_dim, c.d_model),
                w1=w(c.d_model, c.ffn), w3=w(c.d_model, c.ffn), w2=w(c.ffn, c.d_model)))
        self.final_norm = np.ones(c.d_model, np.float32)

    def forward(self, tokens, start_pos, attend):
        """Runs tokens (ids at positions start_pos, start_pos+1, ...) through the
        model. attend(layer, q [n, H, D] f32, k [n, KH, D] f16, v, positions)
        returns the attention output [n, H, D] over everything before and
        including each row (the callback also stores k, v as it sees fit).
        Returns logits [n, vocab] (float32)."""
        c = self.cfg
        tokens = np.asarray(tokens)
        n = len(tokens)
        pos = np.arange(start_pos, start_pos + n, dtype=np.int64)
        x = self.embed[tokens]
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"])
            q = rope((h @ L["wq"]).reshape(n, c.q_heads, c.head_dim), pos, c.rope_base)
            k = rope((h @ L["wk"]).reshape(n, c.kv_heads, c.head_dim), pos, c.rope_base).astype(np.float16)
            v = (h @ L["wv"]).reshape(n, c.kv_heads, c.head_dim).astype(np.float16)
            o = attend(li, q, k, v, pos)
            x = x + o.reshape(n, -1).astype(np.float32) @ L["wo"]
            h = rms_norm(x, L["ffn_norm"])
            a, b = h @ L["w1"], h @ L["w3"]
            x = x + ((a / (1 + np.exp(-a))) * b) @ L["w2"]
        return rms_norm(x, self.final_norm) @ self.embed.T


class LocalAttention:
    """The reference: a local float16 KV cache per layer; attention in float64."""

    def __init__(self, config: Config):
        self.cfg = config
        self.k = [np.zeros((0, config.kv_heads, config.head_dim), np.float16) for _ in range(config.layers)]
        self.v = [np.zeros((0, config.kv_heads, config.head_dim), np.float16) for _ in range(config.layers)]

    @property
    def tokens(self):
        return len(self.k[0])

    def __call__(self, layer, q, k, v, pos):
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])
        kpos = np.arange(len(self.k[layer]), dtype=np.int64)
        return partial_attention(q, self.k[layer], self.v[layer], pos, kpos)[0]


def greedy(model, prompt, steps, attention):
    """Prefills `prompt` then decodes `steps` tokens greedily; returns
    (tokens generated, logits of every step [steps + 1, vocab])."""
    logits = model.forward(prompt, 0, attention)[-1:]
    out, all_logits = [], [logits[0]]
    pos = len(prompt)
    for _ in range(steps):
        t = int(np.argmax(all_logits[-1]))
        out.append(t)
        all_logits.append(model.forward([t], pos, attention)[0])
        pos += 1
    return out, np.stack(all_logits)
