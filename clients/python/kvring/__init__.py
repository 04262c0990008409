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
import functools
import math

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


# Every argument is checked here before it crosses into C: ctypes would wrap
# an out-of-range integer silently (2**32 + 1 -> 1, -1 -> 2**64 - 1) and cut a
# string at its first NUL.
_U32, _U64, _I64 = (1 << 32) - 1, (1 << 64) - 1, (1 << 63) - 1


def _int(name, v, lo=0, hi=_I64):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        _invalid("%s must be an integer, got %s" % (name, type(v).__name__))
    v = int(v)
    if v < lo or v > hi:
        _invalid("%s must be in [%d, %d], got %d" % (name, lo, hi, v))
    return v


def _real(name, v, lo, hi, lo_open=False):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        _invalid("%s must be a number, got %s" % (name, type(v).__name__))
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        _invalid("%s must be a finite number in %s%g, %g], got %r" % (name, "(" if lo_open else "[", lo, hi, v))
    return v


def _flag(name, v):
    if not isinstance(v, (bool, int, np.integer, np.bool_)):
        _invalid("%s must be a bool, got %s" % (name, type(v).__name__))
    return bool(v)


def _text(name, v, max_bytes=4096, empty=True):
    """str -> bytes for C; NUL characters are refused (C would cut the string there)."""
    if not isinstance(v, str):
        _invalid("%s must be a str, got %s" % (name, type(v).__name__))
    if "\0" in v:
        _invalid("%s must not contain NUL characters" % name)
    b = v.encode()
    if not empty and not b:
        _invalid("%s must not be empty" % name)
    if len(b) > max_bytes:
        _invalid("%s is %d bytes; at most %d" % (name, len(b), max_bytes))
    return b


def _layout(v):
    if not isinstance(v, Layout):
        _invalid("layout must be a kvring.Layout, got %s" % type(v).__name__)
    return v


def _ints_array(name, v, dtype, lo, hi):
    """A 1-D integer array, values in [lo, hi], as `dtype` (no silent wrap)."""
    try:
        a = np.asarray(v)
    except (TypeError, ValueError) as e:
        _invalid("%s must be a 1-D integer array: %s" % (name, e))
    if a.dtype == object or a.dtype.kind not in "iu" or a.ndim != 1:
        if not (a.size == 0 and a.ndim == 1):
            _invalid("%s must be a 1-D integer array, got %s of shape %s" % (name, a.dtype, a.shape))
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        _invalid("%s must hold integers in [%d, %d]" % (name, lo, hi))
    return np.ascontiguousarray(a, dtype=dtype)


def _api(f):
    """Any stray Python error from a bad argument becomes kvring.InvalidArgumentError."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except Error:
            raise
        except (TypeError, ValueError, AttributeError, OverflowError, IndexError, KeyError,
                ctypes.ArgumentError) as e:
            err = InvalidArgumentError("%s: bad argument: %s" % (f.__name__, e))
            err.code = "INVALID_ARGUMENT"
            raise err from e
    return wrapper


_DTYPES = {"f32": 0, "float32": 0, "fp32": 0, "f16": 1, "float16": 1, "fp16": 1, "bf16": 2, "bfloat16": 2}
_DTYPE_NAMES = {0: "f32", 1: "f16", 2: "bf16"}
_DTYPE_SIZE = {0: 4, 1: 2, 2: 2}


class Layout:
    """Shape of one KV block: block_tokens x layers x (K, V) x kv_heads x head_dim, in dtype."""

    def __init__(self, block_tokens=16, layers=1, kv_heads=8, head_dim=128, dtype="bf16"):
        if not isinstance(dtype, str) or dtype not in _DTYPES:
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
        a = np.asarray(keys)
    except (TypeError, ValueError) as e:
        _invalid("%s must be a uint64 array of shape (n, 2) holding (lo, hi): %s" % (what, e))
    if a.size and (a.dtype == object or a.dtype.kind not in "iu"):
        _invalid("%s must be an unsigned integer array of shape (n, 2), got %s" % (what, a.dtype))
    if a.size and a.dtype.kind == "i" and int(a.min()) < 0:
        _invalid("%s must not hold negative numbers" % what)
    k = np.ascontiguousarray(a, dtype=np.uint64)
    if k.ndim == 1 and k.shape == (2,) and what == "parent":
        k = k.reshape(1, 2)
    if k.ndim != 2 or k.shape[1] != 2:
        _invalid("%s must be a uint64 array of shape (n, 2) holding (lo, hi), got shape %s" % (what, k.shape))
    return k


def _sequences(sequences):
    """[(sequence_id, context_tokens, rows, append_tokens)] checked: (bytes id, ints in range)."""
    if not isinstance(sequences, (list, tuple)) or not sequences:
        _invalid("sequences must be a non-empty list of (sequence_id, context_tokens, rows, append_tokens)")
    out = []
    for i, s in enumerate(sequences):
        if not isinstance(s, (list, tuple)) or len(s) != 4:
            _invalid("sequence %d must be (sequence_id, context_tokens, rows, append_tokens), got %r" % (i, s))
        sid = s[0]
        if isinstance(sid, bytes):
            sid = sid.decode(errors="strict")
        out.append((_text("sequence_id", sid, 256, empty=False), _int("context_tokens", s[1], 0, 1 << 40),
                    _int("rows", s[2], 0, 1 << 20), _int("append_tokens", s[3], 0, 1 << 20)))
    return out


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
                 device_exchange_min_bytes=-1, ucx_spin_max_us=-1, node_reply_when_queued=None,
                 detach_device_steps=False):
        self._hp = None
        o = _native.Options(_text("coordinator", coordinator, 1024, empty=False), _text("token", token, 4096),
                            _text("namespace", namespace, 256), 1 if _flag("use_ucx", use_ucx) else 0,
                            _text("quantize", quantize, 64), _real("rpc_timeout", rpc_timeout, 0, 86400, lo_open=True),
                            _text("tls_ca", tls_ca), _text("tls_cert", tls_cert), _text("tls_key", tls_key),
                            _int("threads", threads, 0, 4096), _int("ucx_spin_us", ucx_spin_us, -1, 1000000),
                            1 if _flag("ucx_busy_poll", ucx_busy_poll) else 0,
                            0 if _flag("device_delivery", device_delivery) else 1,
                            _int("device_exchange_min_bytes", device_exchange_min_bytes, -1, 1 << 62),
                            _int("ucx_spin_max_us", ucx_spin_max_us, -1, 1000000),
                            0 if node_reply_when_queued is None
                            else 1 if _flag("node_reply_when_queued", node_reply_when_queued) else -1,
                            1 if _flag("detach_device_steps", detach_device_steps) else 0)
        h = ctypes.c_void_p()
        _check(_lib.kvring_connect(ctypes.byref(o), ctypes.byref(h)))
        self._hp = h

    @property
    def _h(self):
        """The C handle; kvring.FailedPreconditionError once the client is closed."""
        if not getattr(self, "_hp", None):
            _raise(9, "the client is closed")
        return self._hp

    @property
    def closed(self):
        return not getattr(self, "_hp", None)

    def close(self):
        if getattr(self, "_hp", None):
            _lib.kvring_close(self._hp)
            self._hp = None

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
        h = self._h
        m = _text("model", model, 1024)
        layout = _layout(layout)
        t = _ints_array("tokens", tokens, np.uint32, 0, _U32)
        out = np.zeros((len(t) // layout.block_tokens, 2), np.uint64)
        p = _parent(parent)
        c = layout._c()
        _check(_lib.kvring_chain(h, m, ctypes.byref(c), _ptr(t), len(t), _ptr(p), _ptr(out)))
        return out

    def lookup(self, keys):
        """Length of the longest held prefix of `keys`."""
        k = _keys(keys)
        held = ctypes.c_uint64()
        _check(_lib.kvring_lookup(self._h, _ptr(k), k.shape[0], ctypes.byref(held)))
        return held.value

    def _put(self, keys, blocks, layout, parent, pin, sequence_id, first_block):
        h = self._h
        layout = _layout(layout)
        pin = _flag("pin", pin)
        sid = _text("sequence_id", sequence_id, 256, empty=False) if sequence_id is not None else None
        first_block = _int("first_block", first_block, 0, 1 << 40)
        k = _keys(keys)
        b = _blocks(blocks, k.shape[0], layout)
        p = _parent(parent)
        rep = _native.PutReport()
        c = layout._c()
        _check(_lib.kvring_put(h, _ptr(k), k.shape[0], _ptr(b), 0, ctypes.byref(c), _ptr(p), 1 if pin else 0, sid,
                               first_block, ctypes.byref(rep)))
        return {"blocks": rep.blocks, "inserted": rep.inserted, "replicas_written": rep.replicas_written, "bytes": rep.bytes}

    def put(self, keys, blocks, layout, parent=None, pin=False):
        return self._put(keys, blocks, layout, parent, pin, None, 0)

    def put_sequence(self, sequence_id, first_block, keys, blocks, layout, parent=None):
        return self._put(keys, blocks, layout, parent, False, sequence_id, first_block)

    def get_into(self, keys, layout, out):
        """Reads blocks into `out` (C-contiguous, writable, n * layout.bytes bytes); returns found[i] (bool array).
        Errors other than NOT_FOUND raise. Quantized blocks come back dequantized to the layout's dtype."""
        self._h
        layout = _layout(layout)
        k = _keys(keys)
        b = _blocks(out, k.shape[0], layout, writable=True)
        found = np.zeros(k.shape[0], np.uint8)
        c = layout._c()
        _check(_lib.kvring_get_into(self._h, _ptr(k), k.shape[0], ctypes.byref(c), _ptr(b), 0, _ptr(found)))
        return found.astype(bool)

    def get(self, keys, layout):
        """All blocks, as an array (n, layers, 2, kv_heads, block_tokens, head_dim); a missing block raises NotFoundError."""
        self._h
        layout = _layout(layout)
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
        self._h
        layout = _layout(layout)
        seqs = _sequences(sequences)
        rows = sum(x[2] for x in seqs)
        appended = sum(x[3] for x in seqs)
        if not isinstance(q, np.ndarray):
            _invalid("q must be a numpy array of shape (rows, q_heads, head_dim)")
        qa = np.ascontiguousarray(q)
        if qa.ndim != 3 or qa.shape[0] != rows or qa.shape[2] != layout.head_dim or qa.shape[1] < 1 or \
                qa.shape[1] % layout.kv_heads:
            _invalid("q must have shape (%d rows, a multiple of %d q_heads, %d), got %s" % (
                rows, layout.kv_heads, layout.head_dim, qa.shape))
        qd = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.uint16): 2}.get(qa.dtype)
        if qd is None:
            if qa.dtype.kind != "f":
                _invalid("q must hold floats (float32/float16, or uint16 bf16 bits), got %s" % qa.dtype)
            qa = qa.astype(np.float32)
            qd = 0
        kv = []
        for name, x in (("new_k", new_k), ("new_v", new_v)):
            if appended == 0:
                if x is not None and np.asarray(x).size:
                    _invalid("%s given but the sequences append no tokens" % name)
                kv.append(None)
                continue
            want = (appended, layout.kv_heads, layout.head_dim)
            if not isinstance(x, np.ndarray):
                _invalid("%s must be a numpy array of shape %s in the layout's dtype (%s)" % (name, want, layout.dtype))
            if x.shape != want:
                _invalid("%s has shape %s; %d appended tokens of this layout need %s" % (name, x.shape, appended, want))
            if x.dtype != layout.numpy_dtype:
                _invalid("%s is %s; the layout's dtype %s needs %s" % (name, x.dtype, layout.dtype, layout.numpy_dtype))
            kv.append(np.ascontiguousarray(x))
        return self.step_raw(layout, seqs, _ptr(qa), qd, qa.shape, positions, _ptr(kv[0]), _ptr(kv[1]), layer,
                             causal, softmax_scale, window, report)

    def step_raw(self, layout, sequences, q_ptr, q_dtype, q_shape, positions, k_ptr, v_ptr, layer=0, causal=True,
                 softmax_scale=0.0, window=0, report=False, out=None, lse=None, device=False):
        """step() on raw pointers (device pointers with device=True: then out/lse must be given, as device pointers).
        The caller vouches that the pointers hold q_shape queries and the appended K/V in the layout's dtype."""
        h = self._h
        layout = _layout(layout)
        if not isinstance(q_shape, (tuple, list)) or len(q_shape) != 3:
            _invalid("q_shape must be (rows, q_heads, head_dim)")
        rows, heads, dim = (_int("q_shape", x, 0, _U32) for x in q_shape)
        q_dtype = _int("q_dtype", q_dtype, 0, 2)
        sequences = _sequences(sequences)
        seqs = (_native.Seq * len(sequences))()
        keep = []
        for i, (sid, ctx, r, app) in enumerate(sequences):
            keep.append(sid)
            seqs[i] = _native.Seq(sid, ctx, r, app)
        if sum(x[2] for x in sequences) != rows:
            _invalid("the sequences have %d query rows; q_shape says %d" % (sum(x[2] for x in sequences), rows))
        if sum(x[3] for x in sequences) and (not k_ptr or not v_ptr):
            _invalid("appending tokens needs new_k and new_v")
        pos = _ints_array("positions", positions, np.int64, 0, (1 << 40))
        if pos.ndim != 1 or pos.shape[0] != rows:
            _invalid("positions must be a 1-D int64 array with one entry per query row")
        a = _native.StepArgs(layout._c(), seqs, len(sequences), q_ptr, q_dtype, rows, heads, dim,
                             pos.ctypes.data_as(_native.P(ctypes.c_int64)), k_ptr, v_ptr,
                             _int("layer", layer, 0, layout.layers - 1), 1 if _flag("causal", causal) else 0,
                             _int("window", window, 0, 1 << 40), _real("softmax_scale", softmax_scale, 0, 1e6),
                             1 if device else 0)
        rep = _native.AttendReport()
        if device:
            _check(_lib.kvring_step(h, ctypes.byref(a), out, lse, ctypes.byref(rep)))
            return rep.as_dict() if report else None
        o = np.empty((rows, heads, dim), np.float32)
        lo = np.empty((rows, heads), np.float32)
        _check(_lib.kvring_step(h, ctypes.byref(a), _ptr(o), _ptr(lo), ctypes.byref(rep)))
        return (o, lo, rep.as_dict()) if report else (o, lo)

    def attend(self, sequence_id, layout, num_tokens, q, positions, layer=0, causal=True, softmax_scale=0.0, window=0,
               report=False):
        """(out [rows, q_heads, head_dim] f32, lse [rows, q_heads] f32) of q over the first num_tokens tokens of the
        sequence; with report=True also a dict of what it took."""
        if not isinstance(q, np.ndarray) or q.ndim != 3:
            _invalid("q must be a numpy array of shape (rows, q_heads, head_dim)")
        qa = q
        return self.step(layout, [(sequence_id, num_tokens, qa.shape[0], 0)], qa, positions, layer=layer,
                         causal=causal, softmax_scale=softmax_scale, window=window, report=report)

    def delete_sequence(self, sequence_id):
        """Ends an attention sequence on every node: its blocks (every tier), open blocks, records and their
        charge to the tenant's budget. Idempotent. Returns {nodes_holding, blocks_erased, open_blocks_dropped}."""
        h = self._h
        sid = _text("sequence_id", sequence_id, 256, empty=False)
        rep = _native.SequenceReport()
        _check(_lib.kvring_delete_sequence(h, sid, len(sid), ctypes.byref(rep)))
        return rep.as_dict()

    def truncate_sequence(self, sequence_id, tokens):
        """Cuts an attention sequence back to its first `tokens` tokens on every layer (speculative decoding's
        rejected drafts, an edited turn): the next append at `tokens` is a new token. Idempotent."""
        h = self._h
        sid = _text("sequence_id", sequence_id, 256, empty=False)
        rep = _native.SequenceReport()
        _check(_lib.kvring_truncate_sequence(h, sid, len(sid), _int("tokens", tokens, 0, 1 << 40), ctypes.byref(rep)))
        return rep.as_dict()

    def fork_sequence(self, source_id, sequence_id, tokens):
        """Starts `sequence_id` as the first `tokens` tokens of `source_id` without copying them: the fork's chunks
        that hold them are placed with the source's, their full blocks shared (neither side's delete or truncate
        takes the other's bytes), only the partly filled block at the fork point copied. Appends to either side never
        change the other. Returns {nodes_holding, blocks_shared, blocks_copied, shared_chunks}."""
        h = self._h
        src = _text("source_id", source_id, 256, empty=False)
        sid = _text("sequence_id", sequence_id, 256, empty=False)
        rep = _native.ForkReport()
        _check(_lib.kvring_fork_sequence(h, src, len(src), sid, len(sid), _int("tokens", tokens, 1, 1 << 40),
                                         ctypes.byref(rep)))
        return rep.as_dict()

    def start_sequence_from_prefix(self, sequence_id, keys, layout):
        """Starts `sequence_id` from a prefix-cache chain (`keys`, e.g. client.chain(model, layout, tokens), of
        blocks put by hash placement): the sequence's first blocks are the chain's blocks the cache holds (its
        hit). A node that holds a block records it by key (no bytes move; the block stays the prefix cache's);
        the others get its bytes. Returns {blocks, tokens, blocks_shared, blocks_copied, bytes_copied}: the
        engine appends or prefills from `tokens` on. AlreadyExistsError when the sequence holds tokens."""
        h = self._h
        sid = _text("sequence_id", sequence_id, 256, empty=False)
        k = _keys(keys)
        rep = _native.PrefixStartReport()
        _check(_lib.kvring_start_sequence_from_prefix(h, sid, len(sid), ctypes.byref(_layout(layout)._c()),
                                                      _ptr(k), k.shape[0], ctypes.byref(rep)))
        return rep.as_dict()

    def list_sequences(self):
        """The caller's attention sequences over every node, by id: a list of dicts {sequence_id, nodes,
        full_blocks, open_blocks, bytes, shared_blocks, tokens, block_tokens, forked, host_blocks, cold_blocks}
        (replicas count in the block and byte figures; shared_blocks: those another sequence on the same node holds
        too; host_blocks / cold_blocks: the full blocks in the host tier / only in the cold tier)."""
        h = self._h
        n = ctypes.c_uint32()
        _check(_lib.kvring_list_sequences(h, None, 0, ctypes.byref(n)))
        while True:
            cap = max(1, n.value)
            arr = (_native.SequenceInfo * cap)()
            _check(_lib.kvring_list_sequences(h, arr, cap, ctypes.byref(n)))
            if n.value <= cap:
                return [arr[i].as_dict() for i in range(n.value)]

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


def create_tenant(coordinator, admin_token, name, shared_namespaces=(), max_pinned_bytes=0, kv_encoding="", tls_ca="",
                  sequence_ttl_s=0):
    """Administration: creates a tenant; returns its token (shown once). sequence_ttl_s: its attention sequences idle
    this long are deleted (0: never)."""
    if isinstance(shared_namespaces, str) or not isinstance(shared_namespaces, (list, tuple)):
        _invalid("shared_namespaces must be a list of names")
    names = [_text("shared namespace", x, 256, empty=False) for x in shared_namespaces]
    arr = (ctypes.c_char_p * max(1, len(names)))(*names)
    buf = ctypes.create_string_buffer(256)
    _check(_lib.kvring_create_tenant(_text("coordinator", coordinator, 1024, empty=False),
                                     _text("admin_token", admin_token), _text("name", name, 256, empty=False), arr,
                                     len(names), _int("max_pinned_bytes", max_pinned_bytes, 0, _I64),
                                     _text("kv_encoding", kv_encoding, 64), _text("tls_ca", tls_ca),
                                     _int("sequence_ttl_s", sequence_ttl_s, 0, 1 << 40), buf, 256))
    return buf.value.decode()


# Every public call converts a stray Python error from a bad argument into
# kvring.InvalidArgumentError.
for _name in ("__init__", "chain", "lookup", "put", "put_sequence", "get_into", "get", "pin", "unpin", "step",
              "step_raw", "attend", "stats", "delete_sequence", "truncate_sequence"):
    setattr(Client, _name, _api(getattr(Client, _name)))
for _name in ("tenant", "namespace", "map_version"):
    setattr(Client, _name, property(_api(getattr(Client, _name).fget)))
Layout.__init__ = _api(Layout.__init__)
merge = _api(merge)
create_tenant = _api(create_tenant)
