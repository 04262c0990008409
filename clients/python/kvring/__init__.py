"""kvring: the Python client of a kvring KV-cache cluster.

    import kvring
    c = kvring.Client("127.0.0.1:7400", token)
    layout = kvring.Layout(block_tokens=16, layers=32, kv_heads=8, head_dim=128, dtype="bf16")
    keys = c.chain("llama-3-8b", layout, tokens)      # (n, 2) uint64: one key per full block
    held = c.lookup(keys)                              # longest cached prefix, in blocks
    c.put(keys[held:], blocks[held:], layout, parent=keys[held - 1] if held else None)
    found = c.get_into(keys[:held], layout, pool)      # straight into your array

The package is pure Python over kvring's C ABI (libkvring_c.so, loaded with
ctypes), so it imports under any Python 3 with numpy: Debian's, or a GPU
host's next to torch (kvring.torch takes torch tensors, CUDA or CPU;
kvring.hf plugs kvring into Hugging Face transformers). Submodules:
kvring.connector (what an engine calls: lookup/load/attend/save) and
kvring.engine (a tiny numpy transformer for tests and demos). Errors raise
kvring.Error subclasses named after the status code.
"""
import ctypes

import numpy as np

from . import _native
from ._native import lib as _lib

__all__ = [
    "Client", "Layout", "merge", "create_tenant", "Error", "InvalidArgumentError", "NotFoundError",
    "AlreadyExistsError", "PermissionDeniedError", "UnauthenticatedError", "ResourceExhaustedError",
    "FailedPreconditionError", "UnavailableError", "DeadlineExceededError", "DataLossError",
]


class Error(RuntimeError):
    """A kvring call failed; .code is the status code's name (e.g. "NOT_FOUND")."""

    code = "UNKNOWN"


class InvalidArgumentError(Error): pass          # noqa: E701
class NotFoundError(Error): pass                 # noqa: E701
class AlreadyExistsError(Error): pass            # noqa: E701
class PermissionDeniedError(Error): pass         # noqa: E701
class UnauthenticatedError(Error): pass          # noqa: E701
class ResourceExhaustedError(Error): pass        # noqa: E701
class FailedPreconditionError(Error): pass       # noqa: E701
class UnavailableError(Error): pass              # noqa: E701
class DeadlineExceededError(Error): pass         # noqa: E701
class DataLossError(Error): pass                 # noqa: E701


_CODES = {
    1: ("CANCELLED", Error), 2: ("UNKNOWN", Error), 3: ("INVALID_ARGUMENT", InvalidArgumentError),
    4: ("DEADLINE_EXCEEDED", DeadlineExceededError), 5: ("NOT_FOUND", NotFoundError),
    6: ("ALREADY_EXISTS", AlreadyExistsError), 7: ("PERMISSION_DENIED", PermissionDeniedError),
    8: ("RESOURCE_EXHAUSTED", ResourceExhaustedError), 9: ("FAILED_PRECONDITION", FailedPreconditionError),
    10: ("ABORTED", Error), 11: ("OUT_OF_RANGE", Error), 12: ("UNIMPLEMENTED", Error), 13: ("INTERNAL", Error),
    14: ("UNAVAILABLE", UnavailableError), 15: ("DATA_LOSS", DataLossError), 16: ("UNAUTHENTICATED", UnauthenticatedError),
}


def _raise(code, message):
    name, cls = _CODES.get(code, ("UNKNOWN", Error))
    e = cls(message)
    e.code = name
    raise e


def _check(code):
    if code != 0:
        _raise(code, _lib.kvring_last_error().decode(errors="replace"))


def _invalid(message):
    _raise(3, message)


_DTYPES = {"f32": 0, "float32": 0, "fp32": 0, "f16": 1, "float16": 1, "fp16": 1, "bf16": 2, "bfloat16": 2}
_DTYPE_NAMES = {0: "f32", 1: "f16", 2: "bf16"}
_DTYPE_SIZE = {0: 4, 1: 2, 2: 2}


class Layout:
    """Shape of one KV block: block_tokens x layers x (K, V) x kv_heads x head_dim, in dtype."""

    def __init__(self, block_tokens=16, layers=1, kv_heads=8, head_dim=128, dtype="bf16"):
        if dtype not in _DTYPES:
            _invalid("dtype '%s': expected bf16, f16 or f32" % (dtype,))
        for name, v, hi in (("block_tokens", block_tokens, 256), ("layers", layers, 256), ("kv_heads", kv_heads, 256),
                            ("head_dim", head_dim, 512)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1 or v > hi:
                _invalid("layout: %s must be an integer in [1, %d], got %r" % (name, hi, v))
        if head_dim % 8:
            _invalid("layout: head_dim must be a multiple of 8 in [8, 512]")
        self.block_tokens, self.layers, self.kv_heads, self.head_dim = int(block_tokens), int(layers), int(kv_heads), int(head_dim)
        self._dtype = _DTYPES[dtype]
        if self.bytes > (64 << 20):
            _invalid("layout: block is larger than 64 MiB")

    @property
    def dtype(self):
        return _DTYPE_NAMES[self._dtype]

    @property
    def bytes(self):
        return self.layers * 2 * self.kv_heads * self.block_tokens * self.head_dim * _DTYPE_SIZE[self._dtype]

    @property
    def numpy_dtype(self):
        return {0: np.dtype(np.float32), 1: np.dtype(np.float16), 2: np.dtype(np.uint16)}[self._dtype]

    @property
    def block_shape(self):
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    def _c(self):
        return _native.Layout_(self.block_tokens, self.layers, self.kv_heads, self.head_dim, self._dtype)

    def __eq__(self, other):
        return isinstance(other, Layout) and self._c_tuple() == other._c_tuple()

    def __hash__(self):
        return hash(self._c_tuple())

    def _c_tuple(self):
        return (self.block_tokens, self.layers, self.kv_heads, self.head_dim, self._dtype)

    def __repr__(self):
        return "Layout(block_tokens=%d, layers=%d, kv_heads=%d, head_dim=%d, dtype='%s')" % (
            self.block_tokens, self.layers, self.kv_heads, self.head_dim, self.dtype)


def _keys(keys, what="keys"):
    try:
        k = np.ascontiguousarray(keys, dtype=np.uint64)
    except (TypeError, ValueError) as e:
        _invalid("%s must be a uint64 array of shape (n, 2) holding (lo, hi): %s" % (what, e))
    if k.ndim == 1 and k.shape == (2,) and what == "parent":
        k = k.reshape(1, 2)
    if k.ndim != 2 or k.shape[1] != 2:
        _invalid("%s must be a uint64 array of shape (n, 2) holding (lo, hi), got shape %s" % (what, k.shape))
    return k


def _parent(parent):
    if parent is None:
        return None
    p = _keys(parent, "parent")
    if p.shape[0] != 1:
        _invalid("parent must be one key (lo, hi), got %d" % p.shape[0])
    return p


def _ptr(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None and a.size else None


def _blocks(blocks, n, layout, writable=False):
    """A C-contiguous uint8 view of n blocks of layout."""
    if isinstance(blocks, np.ndarray):
        if not blocks.flags.c_contiguous:
            _invalid("blocks must be a C-contiguous array")
        if writable and not blocks.flags.writeable:
            _invalid("the output array is read-only")
        b = blocks.reshape(-1).view(np.uint8)
    else:
        try:
            mv = memoryview(blocks)
        except TypeError:
            _invalid("blocks must be a numpy array or a buffer (bytes, bytearray, memoryview)")
        if writable and mv.readonly:
            _invalid("the output buffer is read-only")
        if not mv.c_contiguous:
            _invalid("blocks must be a C-contiguous buffer")
        b = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    if b.nbytes != n * layout.bytes:
        _invalid("blocks hold %d bytes; %d blocks of this layout need %d" % (b.nbytes, n, n * layout.bytes))
    return b


class Client:
    """A connection to a kvring cluster (thread-safe; calls release the GIL)."""

    def __init__(self, coordinator, token, namespace="", use_ucx=True, quantize="", rpc_timeout=10.0, tls_ca="",
                 tls_cert="", tls_key="", threads=0, ucx_spin_us=-1, ucx_busy_poll=False, device_delivery=True,
                 device_exchange_min_bytes=-1):
        o = _native.Options(coordinator.encode(), token.encode(), namespace.encode(), 1 if use_ucx else 0,
                            quantize.encode(), float(rpc_timeout), tls_ca.encode(), tls_cert.encode(),
                            tls_key.encode(), int(threads), int(ucx_spin_us), 1 if ucx_busy_poll else 0,
                            0 if device_delivery else 1, int(device_exchange_min_bytes))
        h = ctypes.c_void_p()
        self._h = None
        _check(_lib.kvring_connect(ctypes.byref(o), ctypes.byref(h)))
        self._h = h

    def close(self):
        if self._h:
            _lib.kvring_close(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _str(self, f):
        buf = ctypes.create_string_buffer(512)
        _check(f(self._h, buf, 512))
        return buf.value.decode()

    @property
    def tenant(self):
        return self._str(_lib.kvring_tenant)

    @property
    def namespace(self):
        return self._str(_lib.kvring_namespace)

    @property
    def map_version(self):
        return _lib.kvring_map_version(self._h)

    def chain(self, model, layout, tokens, parent=None):
        """Keys (n, 2) of the full blocks of `tokens`, continuing from `parent` (default: a sequence start)."""
        t = np.ascontiguousarray(tokens, dtype=np.uint32)
        if t.ndim != 1:
            _invalid("tokens must be a 1-D array of token ids")
        out = np.zeros((len(t) // layout.block_tokens, 2), np.uint64)
        p = _parent(parent)
        c = layout._c()
        _check(_lib.kvring_chain(self._h, model.encode(), ctypes.byref(c), _ptr(t), len(t), _ptr(p), _ptr(out)))
        return out

    def lookup(self, keys):
        """Length of the longest held prefix of `keys`."""
        k = _keys(keys)
        held = ctypes.c_uint64()
        _check(_lib.kvring_lookup(self._h, _ptr(k), k.shape[0], ctypes.byref(held)))
        return held.value

    def _put(self, keys, blocks, layout, parent, pin, sequence_id, first_block):
        k = _keys(keys)
        b = _blocks(blocks, k.shape[0], layout)
        p = _parent(parent)
        rep = _native.PutReport()
        c = layout._c()
        _check(_lib.kvring_put(self._h, _ptr(k), k.shape[0], _ptr(b), 0, ctypes.byref(c), _ptr(p), 1 if pin else 0,
                               sequence_id.encode() if sequence_id is not None else None, first_block, ctypes.byref(rep)))
        return {"blocks": rep.blocks, "inserted": rep.inserted, "replicas_written": rep.replicas_written, "bytes": rep.bytes}

    def put(self, keys, blocks, layout, parent=None, pin=False):
        return self._put(keys, blocks, layout, parent, pin, None, 0)

    def put_sequence(self, sequence_id, first_block, keys, blocks, layout, parent=None):
        return self._put(keys, blocks, layout, parent, False, sequence_id, first_block)

    def get_into(self, keys, layout, out):
        """Reads blocks into `out` (C-contiguous, writable, n * layout.bytes bytes); returns found[i] (bool array).
        Errors other than NOT_FOUND raise. Quantized blocks come back dequantized to the layout's dtype."""
        k = _keys(keys)
        b = _blocks(out, k.shape[0], layout, writable=True)
        found = np.zeros(k.shape[0], np.uint8)
        c = layout._c()
        _check(_lib.kvring_get_into(self._h, _ptr(k), k.shape[0], ctypes.byref(c), _ptr(b), 0, _ptr(found)))
        return found.astype(bool)

    def get(self, keys, layout):
        """All blocks, as an array (n, layers, 2, kv_heads, block_tokens, head_dim); a missing block raises NotFoundError."""
        k = _keys(keys)
        out = np.empty((k.shape[0],) + layout.block_shape, layout.numpy_dtype)
        found = self.get_into(k, layout, out)
        for i, f in enumerate(found):
            if not f:
                _raise(5, "block %d (%016x%016x) is not held" % (i, int(k[i, 1]), int(k[i, 0])))
        return out

    def pin(self, keys):
        k = _keys(keys)
        _check(_lib.kvring_pin(self._h, _ptr(k), k.shape[0], 0))

    def unpin(self, keys):
        k = _keys(keys)
        _check(_lib.kvring_pin(self._h, _ptr(k), k.shape[0], 1))

    def step(self, layout, sequences, q, positions, new_k=None, new_v=None, layer=0, causal=True, softmax_scale=0.0,
             window=0, report=False):
        """One attention step over a batch: `sequences` is a list of (sequence_id, context_tokens, rows,
        append_tokens); q (rows, q_heads, head_dim) float32/float16 (or uint16 bf16 bits: pass q_dtype via
        step_raw), rows grouped by sequence; new_k / new_v (append rows, kv_heads, head_dim) in the layout's dtype.
        Returns (out, lse[, report])."""
        qa = np.ascontiguousarray(q)
        if qa.ndim != 3:
            _invalid("q must have shape (rows, q_heads, head_dim)")
        qd = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.uint16): 2}.get(qa.dtype)
        if qd is None:
            qa = qa.astype(np.float32)
            qd = 0
        kv = [np.ascontiguousarray(x) if x is not None else None for x in (new_k, new_v)]
        return self.step_raw(layout, sequences, _ptr(qa), qd, qa.shape, positions, _ptr(kv[0]), _ptr(kv[1]), layer,
                             causal, softmax_scale, window, report)

    def step_raw(self, layout, sequences, q_ptr, q_dtype, q_shape, positions, k_ptr, v_ptr, layer=0, causal=True,
                 softmax_scale=0.0, window=0, report=False, out=None, lse=None, device=False):
        """step() on raw pointers (device pointers with device=True: then out/lse must be given, as device pointers)."""
        rows, heads, dim = (int(x) for x in q_shape)
        seqs = (_native.Seq * len(sequences))()
        keep = []
        for i, (sid, ctx, r, app) in enumerate(sequences):
            b = sid.encode()
            keep.append(b)
            seqs[i] = _native.Seq(b, int(ctx), int(r), int(app))
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if pos.ndim != 1 or pos.shape[0] != rows:
            _invalid("positions must be a 1-D int64 array with one entry per query row")
        a = _native.StepArgs(layout._c(), seqs, len(sequences), q_ptr, q_dtype, rows, heads, dim,
                             pos.ctypes.data_as(_native.P(ctypes.c_int64)), k_ptr, v_ptr, int(layer),
                             1 if causal else 0, int(window), float(softmax_scale), 1 if device else 0)
        rep = _native.AttendReport()
        if device:
            _check(_lib.kvring_step(self._h, ctypes.byref(a), out, lse, ctypes.byref(rep)))
            return rep.as_dict() if report else None
        o = np.empty((rows, heads, dim), np.float32)
        lo = np.empty((rows, heads), np.float32)
        _check(_lib.kvring_step(self._h, ctypes.byref(a), _ptr(o), _ptr(lo), ctypes.byref(rep)))
        return (o, lo, rep.as_dict()) if report else (o, lo)

    def attend(self, sequence_id, layout, num_tokens, q, positions, layer=0, causal=True, softmax_scale=0.0, window=0,
               report=False):
        """(out [rows, q_heads, head_dim] f32, lse [rows, q_heads] f32) of q over the first num_tokens tokens of the
        sequence; with report=True also a dict of what it took."""
        qa = np.asarray(q)
        if qa.ndim != 3:
            _invalid("q must have shape (rows, q_heads, head_dim)")
        return self.step(layout, [(sequence_id, num_tokens, qa.shape[0], 0)], qa, positions, layer=layer,
                         causal=causal, softmax_scale=softmax_scale, window=window, report=report)

    def stats(self):
        n = ctypes.c_uint32()
        cap = 256
        arr = (_native.NodeStats * cap)()
        _check(_lib.kvring_stats(self._h, arr, cap, ctypes.byref(n)))
        return [arr[i].as_dict() for i in range(min(n.value, cap))]


def merge(outs, lses):
    """Exact merge of attention partials: lists of out [rows, heads, dim] and lse [rows, heads] -> (out, lse)."""
    if not outs or len(outs) != len(lses):
        _invalid("merge needs as many lse as out arrays (at least one)")
    os_ = [np.ascontiguousarray(o, np.float32) for o in outs]
    ls = [np.ascontiguousarray(x, np.float32) for x in lses]
    if os_[0].ndim != 3:
        _invalid("out arrays must have shape (rows, heads, dim)")
    rows, heads, dim = os_[0].shape
    for i, (o, x) in enumerate(zip(os_, ls)):
        if o.shape != (rows, heads, dim) or x.shape != (rows, heads):
            _invalid("partial %d does not have the shape of partial 0" % i)
    po = (ctypes.c_void_p * len(os_))(*[o.ctypes.data for o in os_])
    pl = (ctypes.c_void_p * len(ls))(*[x.ctypes.data for x in ls])
    out = np.empty((rows, heads, dim), np.float32)
    lse = np.empty((rows, heads), np.float32)
    _check(_lib.kvring_merge(po, pl, len(os_), rows, heads, dim, _ptr(out), _ptr(lse)))
    return out, lse


def create_tenant(coordinator, admin_token, name, shared_namespaces=(), max_pinned_bytes=0, kv_encoding="", tls_ca=""):
    """Administration: creates a tenant; returns its token (shown once)."""
    names = [s.encode() for s in shared_namespaces]
    arr = (ctypes.c_char_p * max(1, len(names)))(*names)
    buf = ctypes.create_string_buffer(256)
    _check(_lib.kvring_create_tenant(coordinator.encode(), admin_token.encode(), name.encode(), arr, len(names),
                                     int(max_pinned_bytes), kv_encoding.encode(), tls_ca.encode(), buf, 256))
    return buf.value.decode()
