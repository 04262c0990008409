"""The engine connector: what an inference engine calls around its forward
pass to use kvring as its KV cache (docs/CONNECTOR.md maps these calls to
vLLM's KV-connector hooks and SGLang's hierarchical cache).

  Connector.lookup(tokens)          how many leading tokens are cached (whole blocks)
  Connector.load(tokens, n)         pull the KV of the first n cached blocks (into numpy)
  Connector.save(tokens, k, v, ..)  store the new full blocks after prefill
  TailPassQ                      decode/prefill by shipping queries (pass-Q) to the
                                    shards holding a long sequence, instead of pulling it

KV arrays here are per layer, [tokens, kv_heads, head_dim] in the layout's
dtype (float16 for the reference engine). A block on the wire is
[layers, 2 (K, V), kv_heads, block_tokens, head_dim].

Not thread-safe per object: one Connector/TailPassQ per engine thread
(the kvring.Client underneath is thread-safe and may be shared).
"""
import numpy as np

import kvring as _kvring
from .engine import partial_attention


def pack_blocks(k_layers, v_layers, first_token, n_blocks, block_tokens):
    """Per-layer K/V [t, KH, D] -> blocks [n, layers, 2, KH, BT, D] for the
    tokens [first_token, first_token + n_blocks * block_tokens)."""
    L = len(k_layers)
    KH, D = k_layers[0].shape[1:]
    out = np.empty((n_blocks, L, 2, KH, block_tokens, D), k_layers[0].dtype)
    for li in range(L):
        for kv, src in ((0, k_layers[li]), (1, v_layers[li])):
            chunk = src[first_token:first_token + n_blocks * block_tokens]
            out[:, li, kv] = chunk.reshape(n_blocks, block_tokens, KH, D).transpose(0, 2, 1, 3)
    return out


def unpack_blocks(blocks):
    """blocks [n, layers, 2, KH, BT, D] -> (k_layers, v_layers), each a list of [n*BT, KH, D]."""
    n, L, _, KH, BT, D = blocks.shape
    k = [blocks[:, li, 0].transpose(0, 2, 1, 3).reshape(n * BT, KH, D) for li in range(L)]
    v = [blocks[:, li, 1].transpose(0, 2, 1, 3).reshape(n * BT, KH, D) for li in range(L)]
    return k, v


class Connector:
    """Prefix caching by content (hash-placed blocks, shared by every request
    with the same prefix in the namespace)."""

    def __init__(self, client, model_id, layout):
        self.client, self.model_id, self.layout = client, model_id, layout
        self.bytes_loaded = 0
        self.bytes_saved = 0

    def keys(self, tokens):
        return self.client.chain(self.model_id, self.layout, np.asarray(tokens, np.uint32))

    def lookup(self, tokens):
        """Number of leading tokens whose KV the cluster holds (a multiple of block_tokens)."""
        keys = self.keys(tokens)
        return self.client.lookup(keys) * self.layout.block_tokens if len(keys) else 0

    def load(self, tokens, n_tokens):
        """KV of the first n_tokens (a multiple of block_tokens, at most what
        lookup() returned): (k_layers, v_layers). Raises kvring.NotFoundError
        if a block was evicted in between (the engine then recomputes)."""
        n = n_tokens // self.layout.block_tokens
        keys = self.keys(tokens)[:n]
        buf = np.empty((n,) + tuple(self.layout.block_shape), self.layout.numpy_dtype)
        found = self.client.get_into(keys, self.layout, buf)
        if not found.all():
            raise _kvring.NotFoundError(f"{int((~found).sum())} of {n} prefix blocks were evicted since lookup")
        self.bytes_loaded += buf.nbytes
        return unpack_blocks(buf)

    def save(self, tokens, k_layers, v_layers, first_token=0):
        """Stores the full blocks of tokens[first_token:] (first_token a block
        boundary) whose KV is in k_layers/v_layers (indexed from token 0)."""
        bt = self.layout.block_tokens
        keys = self.keys(tokens)
        first_block = first_token // bt
        n = len(keys) - first_block
        if n <= 0:
            return 0
        blocks = pack_blocks(k_layers, v_layers, first_block * bt, n, bt)
        parent = keys[first_block - 1] if first_block else None
        rep = self.client.put(keys[first_block:], blocks, self.layout, parent=parent)
        self.bytes_saved += blocks.nbytes
        return rep["inserted"]


class TailPassQ:
    """One long sequence kept in the cluster (placed by sequence over the
    shards) and attended by pass-Q: an attention callback for
    engine.Model.forward. For each layer it sends the rows' queries to the
    shards (kvring.Client.attend), computes the partial over the local tail
    (the tokens not yet in a full block, including the new ones), and merges
    the two exactly. When the last layer has run, full tail blocks are written
    to the cluster (put_sequence) and leave the tail.

    stored_blocks > 0 resumes a sequence already in the cluster. (kvring.hf.PassQSession is transformers'
    pass-Q session: every token's K/V on the shards, none in the engine.)"""

    def __init__(self, client, layout, sequence_id, stored_blocks=0):
        self.client, self.layout, self.seq = client, layout, sequence_id
        self.stored_blocks = stored_blocks
        L, KH, D = layout.layers, layout.kv_heads, layout.head_dim
        dt = layout.numpy_dtype
        self.tail_k = [np.zeros((0, KH, D), dt) for _ in range(L)]
        self.tail_v = [np.zeros((0, KH, D), dt) for _ in range(L)]
        self.bytes_sent = self.bytes_received = 0  # pass-Q traffic so far
        self.bytes_stored = 0
        self.attend_calls = 0

    @property
    def tokens(self):
        return self.stored_blocks * self.layout.block_tokens + len(self.tail_k[0])

    def __call__(self, layer, q, k, v, pos):
        bt = self.layout.block_tokens
        self.tail_k[layer] = np.concatenate([self.tail_k[layer], k])
        self.tail_v[layer] = np.concatenate([self.tail_v[layer], v])
        tail_pos = np.arange(self.stored_blocks * bt, self.stored_blocks * bt + len(self.tail_k[layer]), dtype=np.int64)
        lo, llse = partial_attention(q, self.tail_k[layer], self.tail_v[layer], pos, tail_pos)
        if self.stored_blocks:
            ro, rlse, rep = self.client.attend(self.seq, self.layout, self.stored_blocks * bt, np.ascontiguousarray(q, np.float32), pos,
                                               layer=layer, report=True)
            self.bytes_sent += rep["bytes_sent"]
            self.bytes_received += rep["bytes_received"]
            self.attend_calls += 1
            out, _ = _kvring.merge([ro, lo], [rlse, llse])
        else:
            out = lo
        if layer == self.layout.layers - 1:
            self._flush()
        return out

    def _flush(self):
        bt = self.layout.block_tokens
        n = len(self.tail_k[0]) // bt
        if n == 0:
            return
        blocks = pack_blocks(self.tail_k, self.tail_v, 0, n, bt)
        # Keys of sequence blocks only need to be unique within the sequence
        # (placement is by sequence); derive them from the id and the index.
        keys = self.client.chain("seq:" + self.seq, self.layout,
                                 np.arange(self.stored_blocks * bt, (self.stored_blocks + n) * bt, dtype=np.uint32))
        self.client.put_sequence(self.seq, self.stored_blocks, keys, blocks, self.layout)
        self.bytes_stored += blocks.nbytes
        self.stored_blocks += n
        self.tail_k = [t[n * bt:] for t in self.tail_k]
        self.tail_v = [t[n * bt:] for t in self.tail_v]

    def pull_bytes_per_step(self):
        """What one decode step would move if the engine pulled the stored KV instead."""
        return self.stored_blocks * self.layout.bytes
