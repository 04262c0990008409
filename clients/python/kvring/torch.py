"""kvring with torch tensors, CUDA or CPU.

    import kvring, kvring.torch as kt
    kt.put(client, keys, blocks, layout)              # blocks: [n, *layout.block_shape] tensor
    found = kt.get_into(client, keys, layout, pool[i:i + n])   # into a slice of a GPU KV pool
    out, lse = kt.step(client, layout, [("seq", ctx, rows, append)], q, positions, new_k, new_v, layer=l)

CUDA tensors go to the client as device pointers: queries and appended K/V
cross to the host once, the merged output lands in a device tensor, and
get_into fills the engine's GPU memory from pinned staging with one copy
per block (no numpy in between). CPU tensors are passed in place.
"""
import ctypes

import numpy as np
import torch

from . import Layout, _check, _invalid, _keys, _lib, _native, _parent, _ptr

_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_LAYOUT_DT = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}


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


__all__ = ["put", "put_sequence", "get_into", "step", "layout_dtype", "Layout"]
