"""kvring inside Hugging Face transformers: its model code, Cache classes and
generate loop, unchanged.

Pass-Q attention (the sequence's KV lives on kvring GPU nodes; the model's
own cache holds nothing):

    import kvring, kvring.hf as khf
    with khf.PassQSession(client, model, ["req-1"]) as sess:   # "kvring" attention while inside
        out = model.generate(ids, past_key_values=sess.cache(), max_new_tokens=32, do_sample=False)

Every attention layer ships its queries and the new tokens' K/V to the
shards (append, then attend: kvring.torch.step) and gets back the exact
merge; PassQCache only counts tokens. Rows are unpadded (one sequence per
batch row, all of one length).

Prefix cache (kvring as the engine's prefix store):

    pc = khf.PrefixCache(client, model, "llama-3-8b")
    out, info = pc.generate(ids, max_new_tokens=16, do_sample=False)

looks the prompt's blocks up, loads the hits into a DynamicCache on the GPU
(kvring.torch.get_into straight into device memory), lets generate prefill
only the rest, and saves the new full blocks afterwards. Blocks evicted
between the lookup and the load are recomputed.
"""
import collections
import time
import warnings

import numpy as np
import torch

from . import Error, InvalidArgumentError, Layout, NotFoundError
from . import torch as kt

ATTENTION_NAME = "kvring"


def layout_for(config, block_tokens=16, layers=None):
    """The block layout of a transformers config's KV (bf16; all layers, or `layers`)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return Layout(block_tokens, layers or c.num_hidden_layers, kv_heads, head_dim, "bf16")


def _set_attention(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers
        model.config._attn_implementation = name


def _attention_modules(model):
    """(layer index, attention module) of every decoder layer."""
    out = []
    for name, m in model.named_modules():
        if hasattr(m, "layer_idx") and hasattr(m, "q_proj") and hasattr(m, "k_proj"):
            out.append((m.layer_idx, m))
    return out


def kvring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [B, Hq, T, D], key/value [B, Hkv, T, D] (the new
    tokens only: PassQCache keeps nothing). Appends key/value to the sequences on kvring and attends;
    returns ([B, T, Hq, D], None)."""
    sess = getattr(module, "kvring_session", None)
    if sess is None:
        raise RuntimeError("kvring attention on a module without a PassQSession (use PassQSession(client, model, ids))")
    return sess.attend(module.layer_idx, query, key, value, scaling), None


def _no_mask(*args, **kwargs):
    """kvring masks causally by position on the shards: no mask tensor is built."""
    return None


def register():
    """Registers the "kvring" attention function (and its mask function) with transformers."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, kvring_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
        AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    except ImportError:  # transformers without mask interfaces
        pass


def _cache_classes():
    from transformers.cache_utils import Cache
    try:
        from transformers.cache_utils import CacheLayerMixin as Base
    except ImportError:
        from transformers.cache_utils import DynamicLayer as Base

    class PassQLayer(Base):
        """Counts a layer's tokens; keeps no K/V (they are on kvring)."""

        is_compileable = False
        is_sliding = False

        def __init__(self, session=None, index=0):
            super().__init__()
            self._length = 0
            self.session, self.index = session, index

        @property
        def length(self):
            # With a session, what kvring holds is the truth (it moves with every step and rollback); the
            # shortest sequence of the batch.
            if self.session is not None:
                return min(self.session.tokens[self.index])
            return self._length

        @length.setter
        def length(self, value):
            self._length = int(value)

        def lazy_initialization(self, key_states):
            self.dtype, self.device = key_states.dtype, key_states.device
            self.keys = torch.empty(0, dtype=self.dtype, device=self.device)
            self.values = torch.empty(0, dtype=self.dtype, device=self.device)
            self.is_initialized = True

        def update(self, key_states, value_states, cache_kwargs=None):
            if not self.is_initialized:
                self.lazy_initialization(key_states)
            if self.session is None:
                self._length += key_states.shape[-2]
            return key_states, value_states

        def get_mask_sizes(self, cache_position):
            # The query length: newer transformers pass it, older its cache_position tensor.
            q = cache_position if isinstance(cache_position, int) else cache_position.shape[0]
            return self.length + q, 0

        def get_seq_length(self):
            return self.length

        def get_max_cache_shape(self):
            return -1

        def get_max_length(self):  # older transformers' name of get_max_cache_shape
            return -1

    # Any other abstract method this transformers version declares: a layer
    # with nothing stored has nothing to do for it.
    for name in getattr(PassQLayer, "__abstractmethods__", ()):
        setattr(PassQLayer, name, lambda self, *a, **k: None)
    PassQLayer.__abstractmethods__ = frozenset()

    class PassQCache(Cache):
        """A transformers Cache for pass-Q sequences: it only counts tokens. crop() (what assisted generation calls
        when it rejects draft tokens) cuts the session's sequences back on kvring too."""

        def __init__(self, num_layers, session=None, start=0):
            super().__init__(layers=[PassQLayer(session, i) for i in range(num_layers)])
            if session is None:
                for layer in self.layers:
                    layer.length = start
            self.session = session

        def crop(self, max_length):
            # transformers passes a length to keep (an int), or, from assisted generation in 5.x, minus the
            # number of rejected tokens as a 0-d tensor: there crop(tensor(0)) means nothing was rejected, not
            # "keep nothing".
            n = int(max_length)
            length = max(layer.length for layer in self.layers)
            if n < 0 or (isinstance(max_length, torch.Tensor) and n == 0):
                n = length + n
            n = max(0, n)
            if n >= length:
                return
            if self.session is not None:
                self.session.truncate(n)
            else:
                for layer in self.layers:
                    layer.length = min(layer.length, n)

    return PassQCache


class PassQSession:
    """Pass-Q attention for one batch of sequences (one per batch row) of `model` over `client`."""

    def __init__(self, client, model, sequence_ids, block_tokens=16, max_rows_per_step=2048, keep=False,
                 start_tokens=0, fork_of=None, prefix_of=None, prepared=True, timing=False):
        """keep=False: end() (and leaving a `with` block) deletes the session's sequences from kvring; keep=True
        leaves them for a later session over the same ids, which passes start_tokens (an int, or one per sequence:
        the tokens each already holds). fork_of=(source_id, tokens) (or one pair per sequence) starts each sequence
        as a fork of the first `tokens` tokens of a sequence kvring holds (a shared context stored once: no copy of
        its full blocks); the session then starts at that length. prefix_of=(model_name, token_ids) starts each
        sequence from the prefix cache: the chain of token_ids' full blocks (client.chain(model_name, ...), in this
        session's layout) as far as kvring holds it (Client.start_sequence_from_prefix: blocks a node holds are
        shared, not copied); the session then starts at the hit's length (prefix_tokens), and generate computes
        only the rest of the prompt. prepared=False sends each step through
        kvring.torch.step (built from scratch per call) instead of a kvring.torch.StepPlan made once: slower, for
        comparison only.

        Steps on CUDA tensors are ordered on the current stream (kvring.torch.StepPlan): the engine's thread does not
        wait for the GPU before or after a step. decode_steps holds the latest single-token steps as (seconds of the
        engine's thread in the step; the client's, the node's and the kernel's seconds from the step's report; the
        seconds in the client's C call: NaN for prepared=False; then the report's split of the client's seconds:
        plan, stage, round trip, transport (of the round trip), merge; and the fraction of shards that answered
        with their work still queued on their GPU, the stream waiting for it). timing=True also records CUDA events around each
        decode step: device_step_seconds() gives each one's span on the stream, from its inputs ready to its output
        ready (what the engine's GPU waits for a step)."""
        register()
        self.client, self.model = client, model
        self.ids = list(sequence_ids)
        if fork_of is not None:
            forks = list(fork_of) if isinstance(fork_of, list) else [fork_of] * len(self.ids)
            if len(forks) != len(self.ids) or any(not isinstance(f, tuple) or len(f) != 2 for f in forks):
                raise InvalidArgumentError("fork_of: a (source_id, tokens) pair, or one per sequence")
            for sid, (src, n) in zip(self.ids, forks):
                client.fork_sequence(src, sid, n)
            start_tokens = [int(n) for _, n in forks]
        self.layout = layout_for(model.config, block_tokens)
        self.prefix_tokens = 0
        if prefix_of is not None:
            if fork_of is not None or not isinstance(prefix_of, tuple) or len(prefix_of) != 2:
                raise InvalidArgumentError("prefix_of: a (model_name, token_ids) pair, and no fork_of beside it")
            name, ids = prefix_of
            ids = [int(t) for t in (ids.flatten().tolist() if hasattr(ids, "flatten") else ids)]
            # (the prompt's last token stays for generate to compute: it needs one)
            full = (len(ids) - 1) // block_tokens * block_tokens
            keys = client.chain(name, self.layout, ids[:full]) if full else []
            hits = [client.start_sequence_from_prefix(sid, keys, self.layout)["tokens"] if full else 0
                    for sid in self.ids]
            self.prefix_tokens = min(hits)
            start_tokens = hits
        # Rows a sequence sends per step: a node takes at most 4096 query rows a request (the whole batch's).
        self.max_rows = max(1, min(max_rows_per_step, 4096 // max(1, len(self.ids))))
        self.keep = keep
        self.ended = False
        self.truncations = 0  # sequences rolled back on kvring (rejected drafts)
        start = list(start_tokens) if isinstance(start_tokens, (list, tuple)) else [int(start_tokens)] * len(self.ids)
        if len(start) != len(self.ids) or any(t < 0 for t in start):
            raise InvalidArgumentError("start_tokens: one non-negative count per sequence")
        self.tokens = [list(start) for _ in range(self.layout.layers)]  # per layer, per sequence
        self.steps = 0
        self.bytes_sent = self.bytes_received = 0
        self.shard_steps = self.shard_steps_in_place = 0  # shard requests, and those served in this GPU's memory
        self.seconds = 0.0
        self.prepared = prepared
        self._plan = None
        self.decode_steps = collections.deque(maxlen=1 << 16)
        self.timing = timing
        self._step_events = collections.deque(maxlen=1 << 16)
        self.previous_attention = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if self.previous_attention == ATTENTION_NAME:
            self.previous_attention = "sdpa"
        for _, m in _attention_modules(model):
            m.kvring_session = self
        _set_attention(model, ATTENTION_NAME)

    def cache(self):
        """A PassQCache for generate(past_key_values=...), at the session's length (its crop() truncates here)."""
        return _cache_classes()(self.layout.layers, session=self, start=min(min(t) for t in self.tokens))

    def truncate(self, tokens):
        """Rolls every sequence (or each its own: a list) back to `tokens` on every layer: rejected draft tokens,
        an edited turn. The next step appends at that position."""
        want = list(tokens) if isinstance(tokens, (list, tuple)) else [int(tokens)] * len(self.ids)
        if len(want) != len(self.ids) or any(t < 0 for t in want):
            raise InvalidArgumentError("truncate: one non-negative length per sequence")
        for b, sid in enumerate(self.ids):
            if all(self.tokens[layer][b] <= want[b] for layer in range(self.layout.layers)):
                continue
            self.client.truncate_sequence(sid, want[b])
            self.truncations += 1
            for layer in range(self.layout.layers):
                self.tokens[layer][b] = min(self.tokens[layer][b], want[b])

    def end(self):
        """Detaches, then (unless keep) deletes the session's sequences from kvring. Idempotent."""
        if self.ended:
            return
        self.detach()
        self.ended = True
        if not self.keep:
            for sid in self.ids:
                try:
                    self.client.delete_sequence(sid)
                except Error as e:  # a node down: the sequence stays; deleting it again later is safe
                    warnings.warn("kvring: sequence %r was not deleted: %s" % (sid, e))

    def detach(self):
        """Gives the model back its attention implementation (as it was when the session started)."""
        for _, m in _attention_modules(self.model):
            if getattr(m, "kvring_session", None) is self:
                del m.kvring_session
        _set_attention(self.model, self.previous_attention)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.end()

    def attend(self, layer, query, key, value, scaling):
        B, Hq, T, D = query.shape
        if B != len(self.ids):
            raise InvalidArgumentError(f"batch of {B} rows but the session has {len(self.ids)} sequences")
        if self.prepared and query.is_cuda:
            return self._attend_planned(layer, query, key, value, scaling)
        q = query.transpose(1, 2).contiguous()   # [B, T, Hq, D]
        k = key.transpose(1, 2).contiguous()     # [B, T, Hkv, D]
        v = value.transpose(1, 2).contiguous()
        if k.dtype != torch.bfloat16:
            k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
        out = torch.empty((B, T, Hq, D), dtype=torch.float32, device=query.device)
        if query.is_cuda:
            torch.cuda.current_stream(query.device).synchronize()  # timed from inputs ready, as the prepared path
        t0 = time.perf_counter()
        # Chunks of at most max_rows rows a sequence (a long prompt is a chunked prefill).
        for c0 in range(0, T, self.max_rows):
            c1 = min(T, c0 + self.max_rows)
            n = c1 - c0
            spec, pos = [], []
            for b, sid in enumerate(self.ids):
                ctx = self.tokens[layer][b]
                spec.append((sid, ctx, n, n))
                pos.append(torch.arange(ctx, ctx + n))
            qs = q[:, c0:c1].reshape(B * n, Hq, D)
            ks = k[:, c0:c1].reshape(B * n, -1, D)
            vs = v[:, c0:c1].reshape(B * n, -1, D)
            o, _, rep = kt.step(self.client, self.layout, spec, qs, torch.cat(pos), ks, vs, layer=layer,
                                softmax_scale=float(scaling or 0.0), report=True)
            out[:, c0:c1] = o.view(B, n, Hq, D)
            self._account(self.tokens[layer], n, rep["bytes_sent"], rep["bytes_received"], rep["shards"],
                          rep["shards_in_place"])
        result = out.to(query.dtype)
        dt = time.perf_counter() - t0
        self.seconds += dt
        if T == 1:
            self.decode_steps.append((dt, rep["seconds"], rep["node_seconds"], rep["kernel_seconds"], float("nan"),
                                      rep["plan_seconds"], rep["stage_seconds"], rep["round_trip_seconds"],
                                      rep["transport_seconds"], rep["merge_seconds"],
                                      rep["shards_replied_queued"] / max(1, rep["shards"])))
        return result

    def _attend_planned(self, layer, query, key, value, scaling):
        """attend() through the session's StepPlan: a decode step (T = 1) in the model's contiguous tensors goes
        to StepPlan.decode as it is (no transpose, no copy), and nothing is allocated but the result in the
        model's dtype."""
        B, Hq, T, D = query.shape
        scale = float(scaling or 0.0)
        if self._plan is None or self._plan[0] != (Hq, scale):
            self._plan = ((Hq, scale), kt.StepPlan(self.client, self.layout, self.ids, Hq, max_rows=self.max_rows,
                                                   softmax_scale=scale))
        plan = self._plan[1]
        timed = self.timing and T == 1
        if timed:
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        tokens = self.tokens[layer]
        rep = plan.report
        if T == 1 and key.dtype == torch.bfloat16 and query.is_contiguous() and key.is_contiguous() \
                and value.is_contiguous():
            # A decode step as the model hands it over: its memory is the step's rows as they are, and the
            # step's merge writes the output in the model's dtype (no conversion after it).
            if query.dtype in kt._CAST_DT:
                result = torch.empty((B, 1, Hq, D), dtype=query.dtype, device=query.device)
                plan.decode(layer, tokens, query, key, value, out=result)
            else:
                o, _ = plan.decode(layer, tokens, query, key, value)
                result = o.view(B, 1, Hq, D).to(query.dtype)
            self._account(tokens, 1, rep.bytes_sent, rep.bytes_received, rep.shards, rep.shards_in_place)
        else:
            q = query.transpose(1, 2)  # [B, T, Hq, D]
            k = key.transpose(1, 2)
            v = value.transpose(1, 2)
            if T > 1:
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            if k.dtype != torch.bfloat16:
                k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
            if T <= self.max_rows:
                rows = (q.reshape(B * T, Hq, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D))
                if query.dtype in kt._CAST_DT:  # (the step's merge writes the model's dtype)
                    result = torch.empty((B, T, Hq, D), dtype=query.dtype, device=query.device)
                    plan.run(layer, tokens, T, *rows, out=result)
                else:
                    o, _ = plan.run(layer, tokens, T, *rows)
                    result = o.view(B, T, Hq, D).to(query.dtype)
                self._account(tokens, T, rep.bytes_sent, rep.bytes_received, rep.shards, rep.shards_in_place)
            else:  # a long prompt: a chunked prefill
                result = torch.empty((B, T, Hq, D), dtype=query.dtype, device=query.device)
                for c0 in range(0, T, self.max_rows):
                    n = min(T, c0 + self.max_rows) - c0
                    o, _ = plan.run(layer, tokens, n, q[:, c0:c0 + n].reshape(B * n, Hq, D),
                                    k[:, c0:c0 + n].reshape(B * n, -1, D), v[:, c0:c0 + n].reshape(B * n, -1, D))
                    result[:, c0:c0 + n] = o.view(B, n, Hq, D)
                    self._account(tokens, n, rep.bytes_sent, rep.bytes_received, rep.shards, rep.shards_in_place)
        dt = time.perf_counter() - t0
        self.seconds += dt
        if T == 1:
            self.decode_steps.append((dt, rep.seconds, rep.node_seconds, rep.kernel_seconds, plan.call_seconds,
                                      rep.plan_seconds, rep.stage_seconds, rep.round_trip_seconds,
                                      rep.transport_seconds, rep.merge_seconds,
                                      rep.shards_replied_queued / max(1, rep.shards)))
        if timed:
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
            self._step_events.append((e0, e1))
        return result

    def device_step_seconds(self):
        """With timing=True: each recorded decode step's span on its CUDA stream (inputs ready -> output ready),
        seconds. Waits for the device."""
        if self._step_events:
            self._step_events[-1][1].synchronize()
        return [a.elapsed_time(b) * 1e-3 for a, b in self._step_events]

    def _account(self, tokens, n, sent, received, shards, in_place):
        """One step done: each sequence of `tokens` (one layer's counts) is n longer; the step's traffic counted."""
        for b in range(len(tokens)):
            tokens[b] += n
        self.steps += 1
        self.bytes_sent += sent
        self.bytes_received += received
        self.shard_steps += shards
        self.shard_steps_in_place += in_place


def _dynamic_cache(model):
    """The DynamicCache generate() would make for the model (built from its config where this transformers takes
    one: the layer types it declares)."""
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # a transformers whose DynamicCache takes no config
        return DynamicCache()


def blocks_from_cache(cache, layout, b0, b1):
    """Blocks [b0, b1) of a transformers cache's tokens (batch row 0), in kvring's layout
    [b1 - b0, layers, 2, kv_heads, block_tokens, head_dim] (on the cache's device): what Put and PutSequence take."""
    bt = layout.block_tokens
    parts = []
    for l in range(layout.layers):
        keys, values = cache.layers[l].keys, cache.layers[l].values  # [1, Hkv, S, D]
        kk = keys[0, :, b0 * bt:b1 * bt].reshape(layout.kv_heads, b1 - b0, bt, -1).permute(1, 0, 2, 3)
        vv = values[0, :, b0 * bt:b1 * bt].reshape(layout.kv_heads, b1 - b0, bt, -1).permute(1, 0, 2, 3)
        parts.append(torch.stack([kk, vv], dim=1))
    return torch.stack(parts, dim=1).contiguous()


class PrefixCache:
    """kvring as a transformers engine's prefix cache (hash-placed blocks, one chain per model)."""

    def __init__(self, client, model, model_id, block_tokens=16):
        self.client, self.model, self.model_id = client, model, model_id
        self.layout = layout_for(model.config, block_tokens)
        self.bt = block_tokens
        self.last_load_split = {}

    def _blocks_to_cache(self, blocks):
        """[n, layers, 2, kv_heads, bt, D] blocks -> a DynamicCache holding their n * bt tokens."""
        from transformers import DynamicCache
        cache = _dynamic_cache(self.model)
        n = blocks.shape[0]
        for l in range(self.layout.layers):
            k = blocks[:, l, 0].permute(1, 0, 2, 3).reshape(1, self.layout.kv_heads, n * self.bt, self.layout.head_dim)
            v = blocks[:, l, 1].permute(1, 0, 2, 3).reshape(1, self.layout.kv_heads, n * self.bt, self.layout.head_dim)
            cache.update(k.contiguous(), v.contiguous(), l)
        return cache

    def load(self, input_ids):
        """(DynamicCache of the longest held prefix, or None; blocks loaded; keys of the prompt). last_load_split
        then holds the load's seconds by part: chain (the prompt's keys), lookup, get_into (the blocks into this
        device), to_cache (the blocks into the DynamicCache's per-layer tensors)."""
        split = self.last_load_split = {}
        t = [time.perf_counter()]

        def mark(part):
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            now = time.perf_counter()
            split[part] = now - t[0]
            t[0] = now

        tokens = input_ids[0].tolist()
        keys = self.client.chain(self.model_id, self.layout, np.asarray(tokens, np.uint32))
        mark("chain")
        # Leave at least one token for generate to prefill.
        usable = min(len(keys), (len(tokens) - 1) // self.bt)
        held = self.client.lookup(keys[:usable]) if usable else 0
        mark("lookup")
        if held == 0:
            return None, 0, keys
        blocks = torch.empty((held,) + self.layout.block_shape, dtype=torch.bfloat16, device=input_ids.device)
        found = kt.get_into(self.client, keys[:held], self.layout, blocks.view(-1))
        mark("get_into")
        if not found.all():  # evicted since the lookup: keep the prefix that came back, recompute the rest
            held = int(np.argmin(found))
            if held == 0:
                return None, 0, keys
            blocks = blocks[:held]
        cache = self._blocks_to_cache(blocks)
        mark("to_cache")
        return cache, held, keys

    def save(self, cache, token_ids, held):
        """Stores the full blocks of `token_ids` from block `held` on, from the cache's K/V."""
        keys = self.client.chain(self.model_id, self.layout, np.asarray(token_ids, np.uint32))
        n = min(len(keys), cache.get_seq_length() // self.bt)
        if n <= held:
            return 0
        blocks = blocks_from_cache(cache, self.layout, held, n)
        kt.put(self.client, keys[held:n], blocks.view(-1), self.layout, parent=keys[held - 1] if held else None)
        return n - held

    def generate(self, input_ids, **kwargs):
        """model.generate with the prompt's cached prefix loaded and the new full blocks saved.
        Returns (generate's output, {"held_blocks", "saved_blocks", "load_s", "load_split_s" (load's parts, as
        last_load_split), "generate_s", "save_s"})."""
        from transformers import DynamicCache
        def now():
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            return time.perf_counter()
        t0 = now()
        cache, held, _ = self.load(input_ids)
        t1 = now()
        if cache is None:
            cache = _dynamic_cache(self.model)
        out = self.model.generate(input_ids, past_key_values=cache, **kwargs)
        t2 = now()
        seq = out.sequences if hasattr(out, "sequences") else out
        saved = self.save(cache, seq[0].tolist(), held)
        t3 = now()
        return out, {"held_blocks": held, "saved_blocks": saved, "load_s": t1 - t0,
                     "load_split_s": dict(self.last_load_split), "generate_s": t2 - t1, "save_s": t3 - t2}


__all__ = ["PassQSession", "PrefixCache", "register", "kvring_attention", "layout_for", "NotFoundError"]
