"""kvring with torch tensors, CUDA or CPU.

    import kvring, kvring.torch as kt
    kt.put(client, keys, blocks, layout)              # blocks: [n, *layout.block_shape] tensor
    found = kt.get_into(client, keys, layout, pool[i:i + n])   # into a slice of a GPU KV pool
    out, lse = kt.step(client, layout, [("seq", ctx, rows, append)], q, positions, new_k, new_v, layer=l)
    plan = kt.StepPlan(client, layout, ["seq"], q_heads, max_rows=1)  # an engine's per-layer call, prepared once
    out, lse = plan.run(l, [ctx], 1, q, new_k, new_v)

CUDA tensors go to the client as device pointers: queries and appended K/V
cross to the host once, the merged output lands in a device tensor, and
get_into fills the engine's GPU memory from pinned staging with one copy
per block (no numpy in between). CPU tensors are passed in place.
"""
import ctypes
import time

import numpy as np
import torch

from . import Layout, _check, _int, _invalid, _keys, _lib, _native, _parent, _ptr, _real, _text

_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_LAYOUT_DT = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}
_CAST_DT = {torch.float16: 1, torch.bfloat16: 2}  # StepPlan's out=: the C ABI's out_cast_dtype


def layout_dtype(layout):
    """The torch dtype of a layout's elements."""
    return _LAYOUT_DT[layout._dtype]


def _tensor(t, what, nbytes=None, dtype=None):
    if not isinstance(t, torch.Tensor):
        _invalid("%s must be a torch tensor" % what)
    if not t.is_contiguous():
        _invalid("%s must be contiguous" % what)
    if dtype is not None and t.dtype != dtype:
        _invalid("%s must be %s, got %s" % (what, dtype, t.dtype))
    if nbytes is not None and t.numel() * t.element_size() != nbytes:
        _invalid("%s holds %d bytes; %d are needed" % (what, t.numel() * t.element_size(), nbytes))
    return ctypes.c_void_p(t.data_ptr()), 1 if t.is_cuda else 0


def put(client, keys, blocks, layout, parent=None, pin=False, sequence_id=None, first_block=0):
    """Stores len(keys) blocks from `blocks` (a tensor of n * layout.bytes bytes, CUDA or CPU)."""
    k = _keys(keys)
    ptr, dev = _tensor(blocks, "blocks", k.shape[0] * layout.bytes)
    if dev:
        torch.cuda.current_stream(blocks.device).synchronize()  # the client copies from it on its own stream
    p = _parent(parent)
    rep = _native.PutReport()
    c = layout._c()
    _check(_lib.kvring_put(client._h, _ptr(k), k.shape[0], ptr, dev, ctypes.byref(c), _ptr(p), 1 if pin else 0,
                           sequence_id.encode() if sequence_id is not None else None, first_block, ctypes.byref(rep)))
    return {"blocks": rep.blocks, "inserted": rep.inserted, "replicas_written": rep.replicas_written, "bytes": rep.bytes}


def put_sequence(client, sequence_id, first_block, keys, blocks, layout, parent=None):
    return put(client, keys, blocks, layout, parent=parent, sequence_id=sequence_id, first_block=first_block)


def get_into(client, keys, layout, out):
    """Reads len(keys) blocks into `out` (n * layout.bytes bytes, CUDA or CPU); returns a bool array found[i]."""
    k = _keys(keys)
    ptr, dev = _tensor(out, "out", k.shape[0] * layout.bytes)
    found = np.zeros(k.shape[0], np.uint8)
    c = layout._c()
    _check(_lib.kvring_get_into(client._h, _ptr(k), k.shape[0], ctypes.byref(c), ptr, dev, _ptr(found)))
    return found.astype(bool)


def step(client, layout, sequences, q, positions, new_k=None, new_v=None, layer=0, causal=True, softmax_scale=0.0,
         window=0, report=False):
    """One attention step: q [rows, q_heads, head_dim] (bf16/f16/f32), rows grouped by the sequences
    (sequence_id, context_tokens, rows, append_tokens); new_k / new_v [append rows, kv_heads, head_dim] in the
    layout's dtype, on q's device. Returns (out [rows, q_heads, head_dim] f32, lse [rows, q_heads] f32) on q's
    device (and the report dict with report=True)."""
    if q.dim() != 3:
        _invalid("q must have shape (rows, q_heads, head_dim)")
    if q.dtype not in _DT:
        _invalid("q must be float32, float16 or bfloat16")
    q = q.contiguous()
    rows, heads, dim = q.shape
    qp, dev = _tensor(q, "q")
    kp = vp = None
    if new_k is not None or new_v is not None:
        if new_k is None or new_v is None or new_k.shape != new_v.shape:
            _invalid("new_k and new_v come together, with one shape")
        new_k, new_v = new_k.contiguous(), new_v.contiguous()
        if new_k.device != q.device:
            _invalid("new_k / new_v must be on q's device")
        kp, _ = _tensor(new_k, "new_k", dtype=layout_dtype(layout))
        vp, _ = _tensor(new_v, "new_v", dtype=layout_dtype(layout))
    out = torch.empty((rows, heads, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((rows, heads), dtype=torch.float32, device=q.device)
    if dev:
        torch.cuda.current_stream(q.device).synchronize()  # inputs written; the client reads them on its own stream
    pos = positions.cpu().numpy() if isinstance(positions, torch.Tensor) else positions
    rep = client.step_raw(layout, sequences, qp, _DT[q.dtype], (rows, heads, dim), pos, kp, vp, layer=layer,
                          causal=causal, softmax_scale=softmax_scale, window=window, report=True,
                          out=ctypes.c_void_p(out.data_ptr()), lse=ctypes.c_void_p(lse.data_ptr()), device=True) \
        if dev else None
    if not dev:
        o, lo, rep = client.step_raw(layout, sequences, qp, _DT[q.dtype], (rows, heads, dim), pos, kp, vp, layer=layer,
                                     causal=causal, softmax_scale=softmax_scale, window=window, report=True)
        out.copy_(torch.from_numpy(o))
        lse.copy_(torch.from_numpy(lo))
    return (out, lse, rep) if report else (out, lse)


class StepPlan:
    """step() prepared once for an engine's decode loop: a fixed batch of sequences, each appending and attending
    the same number of rows a call, with CUDA tensors on one device. The C structs, the positions array and the
    output buffers are built here and reused, so a call allocates no Python objects but the tensors it returns,
    and checks only what can change from call to call (the tensors' shapes, dtypes, device, contiguity); the
    client checks the rest at its boundary as for step().

    A run is ordered on the current CUDA stream of q's device, like a kernel launched there: it reads its inputs
    after the stream's earlier work (no synchronize is needed before it) and returns once its output's last work
    is queued there (later work on the stream sees it; synchronize before reading it on the host). GPU nodes on
    this host wait on an event recorded on the stream rather than the engine's thread waiting.
    stream_ordered=False: the client synchronizes the stream first and waits for the output (as step() does).

    Not thread-safe: one engine thread drives a plan. The returned (out, lse) are the plan's own buffers: they
    hold the result until the next run() on the same stream (copy them to keep them longer)."""

    def __init__(self, client, layout, sequence_ids, q_heads, max_rows=1, causal=True, softmax_scale=0.0,
                 stream_ordered=True):
        ids = list(sequence_ids)
        if not ids:
            _invalid("a StepPlan needs at least one sequence")
        self._client, self._layout = client, layout
        self._ids = [_text("sequence_id", sid, 256, empty=False) for sid in ids]  # kept alive for the C structs
        self.batch = len(ids)
        self.q_heads = _int("q_heads", q_heads, 1, 4096)
        self.max_rows = _int("max_rows", max_rows, 1, 1 << 20)
        self._dtype = layout_dtype(layout)
        self._seqs = (_native.Seq * self.batch)(*[_native.Seq(sid, 0, 0, 0) for sid in self._ids])
        self._pos = np.zeros(self.batch * self.max_rows, np.int64)
        self._arange = np.arange(self.max_rows, dtype=np.int64)
        self._args = _native.StepArgs(layout._c(), self._seqs, self.batch, None, 2, 0, self.q_heads, layout.head_dim,
                                      self._pos.ctypes.data_as(_native.P(ctypes.c_int64)), None, None, 0,
                                      1 if causal else 0, 0, _real("softmax_scale", softmax_scale, 0, 1e6), 1)
        self.stream_ordered = bool(stream_ordered)
        self._args.stream_ordered = 1 if self.stream_ordered else 0
        self._args_ref = ctypes.byref(self._args)
        self.report = _native.AttendReport()  # the last run's report
        self.call_seconds = 0.0  # the last run's time in the client's C call (its device work queued, not done)
        self._report_ref = ctypes.byref(self.report)
        self._out = {}  # (rows, device) -> (out, lse, out pointer, lse pointer)

    def run(self, layer, contexts, rows, q, new_k, new_v, out=None):
        """Appends `rows` tokens to each sequence on `layer` (sequence b holds contexts[b] tokens there before the
        call) and attends their queries: q [batch * rows, q_heads, head_dim] (bf16/f16/f32), new_k / new_v
        [batch * rows, kv_heads, head_dim] in the layout's dtype, rows grouped by sequence, CUDA tensors on one
        device, contiguous. Returns (out [batch * rows, q_heads, head_dim] f32, lse [batch * rows, q_heads] f32)
        on that device. out: a contiguous bf16 or f16 CUDA tensor of batch * rows * q_heads * head_dim elements on
        that device (any shape), the caller's own: the step's last merge also writes O there in its dtype (no
        conversion after the step), and (out, lse) is returned."""
        B, L = self.batch, self._layout
        if not 0 < rows <= self.max_rows:
            _invalid("rows must be in [1, %d], got %d" % (self.max_rows, rows))
        n = B * rows
        qd = _DT.get(q.dtype)
        if qd is None or q.shape != (n, self.q_heads, L.head_dim) or not q.is_contiguous() or not q.is_cuda:
            _invalid("q must be a contiguous CUDA tensor (%d, %d, %d) of float32/16 or bfloat16, got %s %s" %
                     (n, self.q_heads, L.head_dim, tuple(q.shape), q.dtype))
        kv = (n, L.kv_heads, L.head_dim)
        for t, what in ((new_k, "new_k"), (new_v, "new_v")):
            if t.shape != kv or t.dtype != self._dtype or not t.is_contiguous() or t.device != q.device:
                _invalid("%s must be a contiguous %s tensor %s on q's device, got %s %s" %
                         (what, self._dtype, kv, tuple(t.shape), t.dtype))
        if len(contexts) != B:
            _invalid("contexts: one token count per sequence (%d), got %d" % (B, len(contexts)))
        return self._launch(layer, contexts, rows, n, qd, q.data_ptr(), new_k.data_ptr(), new_v.data_ptr(), q.device,
                            self._cast(out, n, q.device))

    def decode(self, layer, contexts, query, key, value, out=None):
        """run() for one token a sequence, in the attention layout of transformers' models: query
        [batch, q_heads, 1, head_dim], key / value [batch, kv_heads, 1, head_dim] (the layout's dtype), CUDA
        tensors on one device, each contiguous (then their memory is exactly run()'s q, new_k, new_v: no copy).
        Returns run()'s (out [batch, q_heads, head_dim] f32, lse); with out (as for run(), e.g. the model's
        [batch, 1, q_heads, head_dim] attention output), (out, lse)."""
        B, L = self.batch, self._layout
        qd = _DT.get(query.dtype)
        kv = (B, L.kv_heads, 1, L.head_dim)
        if (qd is None or query.shape != (B, self.q_heads, 1, L.head_dim) or key.shape != kv or value.shape != kv
                or key.dtype != self._dtype or value.dtype != self._dtype or not query.is_cuda
                or not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous())
                or key.device != query.device or value.device != query.device):
            _invalid("decode: query (%d, %d, 1, %d) of float32/16 or bfloat16 and key, value %s of %s, contiguous "
                     "CUDA tensors on one device; got %s %s, %s %s, %s %s" %
                     (B, self.q_heads, L.head_dim, kv, self._dtype, tuple(query.shape), query.dtype,
                      tuple(key.shape), key.dtype, tuple(value.shape), value.dtype))
        if len(contexts) != B:
            _invalid("contexts: one token count per sequence (%d), got %d" % (B, len(contexts)))
        return self._launch(layer, contexts, 1, B, qd, query.data_ptr(), key.data_ptr(), value.data_ptr(),
                            query.device, self._cast(out, B, query.device))

    def _cast(self, out, n, device):
        """(out, its C dtype code) for run()'s out, checked; None without one."""
        if out is None:
            return None
        code = _CAST_DT.get(out.dtype)
        if (code is None or out.numel() != n * self.q_heads * self._layout.head_dim or not out.is_contiguous()
                or out.device != device):
            _invalid("out must be a contiguous bfloat16 or float16 tensor of %d elements on %s, got %s %s on %s" %
                     (n * self.q_heads * self._layout.head_dim, device, tuple(out.shape), out.dtype, out.device))
        return out, code

    def _launch(self, layer, contexts, rows, n, qd, q_ptr, k_ptr, v_ptr, device, cast=None):
        L = self._layout
        seqs, pos = self._seqs, self._pos
        for b in range(self.batch):
            c = contexts[b]
            s = seqs[b]
            s.context_tokens, s.rows, s.append_tokens = c, rows, rows
            if rows == 1:  # (a decode step: no slice)
                pos[b] = c
            else:
                np.add(self._arange[:rows], c, out=pos[b * rows:(b + 1) * rows])
        key = (rows, device)
        buf = self._out.get(key)
        if buf is None:
            o = torch.empty((n, self.q_heads, L.head_dim), dtype=torch.float32, device=device)
            lo = torch.empty((n, self.q_heads), dtype=torch.float32, device=device)
            buf = (o, lo, ctypes.c_void_p(o.data_ptr()), ctypes.c_void_p(lo.data_ptr()))
            if rows <= 16:  # decode and draft steps reuse their buffers; prefill chunks of every size do not stay
                self._out[key] = buf
        a = self._args
        a.q, a.q_dtype, a.num_rows, a.layer = q_ptr, qd, n, layer
        a.new_k, a.new_v = k_ptr, v_ptr
        if cast is None:
            a.out_cast = None
        else:
            a.out_cast, a.out_cast_dtype = cast[0].data_ptr(), cast[1]
        if self.stream_ordered:
            a.stream = _current_stream(device)
        else:
            torch.cuda.current_stream(device).synchronize()  # inputs written; the client reads them on its own stream
        t0 = time.perf_counter()
        code = _lib.kvring_step(self._client._h, self._args_ref, buf[2], buf[3], self._report_ref)
        self.call_seconds = time.perf_counter() - t0
        _check(code)
        return (buf[0] if cast is None else cast[0]), buf[1]


def _current_stream(device):
    """The current CUDA stream of `device` (a cudaStream_t as an int): torch's raw accessor where it has one (no
    Stream object per call), else through torch.cuda.current_stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(device).cuda_stream


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


__all__ = ["put", "put_sequence", "get_into", "step", "StepPlan", "layout_dtype", "Layout"]
