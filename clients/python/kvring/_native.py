"""ctypes declarations of kvring's C ABI (clients/c/include/kvring/kvring_c.h).

The shared library libkvring_c.so sits beside this file (the build puts it
there; bench/gpu/pack.sh carries it, with the libraries it needs, to a GPU
host). ctypes releases the GIL around every call, so network calls from many
Python threads overlap.
"""
import ctypes
import os

c_u32, c_u64, c_i64, c_int, c_float, c_double = (ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int,
                                                   ctypes.c_float, ctypes.c_double)
c_void_p, c_char_p, c_size_t = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
P = ctypes.POINTER


class Layout_(ctypes.Structure):
    _fields_ = [("block_tokens", c_u32), ("layers", c_u32), ("kv_heads", c_u32), ("head_dim", c_u32), ("dtype", c_u32)]


class Options(ctypes.Structure):
    _fields_ = [("coordinator", c_char_p), ("token", c_char_p), ("ns", c_char_p), ("use_ucx", c_int),
                ("quantize", c_char_p), ("rpc_timeout_s", c_double), ("tls_ca", c_char_p), ("tls_cert", c_char_p),
                ("tls_key", c_char_p), ("threads", c_u32), ("ucx_spin_us", ctypes.c_int32), ("ucx_busy_poll", ctypes.c_int32),
                ("no_device_delivery", ctypes.c_int32), ("device_exchange_min_bytes", ctypes.c_int64),
                ("ucx_spin_max_us", ctypes.c_int32), ("node_reply_when_queued", ctypes.c_int32),
                ("detach_device_steps", ctypes.c_int32)]


class PutReport(ctypes.Structure):
    _fields_ = [("blocks", c_u64), ("inserted", c_u64), ("replicas_written", c_u64), ("bytes", c_u64)]


class Seq(ctypes.Structure):
    _fields_ = [("sequence_id", c_char_p), ("context_tokens", c_u64), ("rows", c_u32), ("append_tokens", c_u32)]


class StepArgs(ctypes.Structure):
    _fields_ = [("layout", Layout_), ("seqs", P(Seq)), ("num_seqs", c_u32), ("q", c_void_p), ("q_dtype", c_u32),
                ("num_rows", c_u32), ("q_heads", c_u32), ("head_dim", c_u32), ("positions", P(c_i64)),
                ("new_k", c_void_p), ("new_v", c_void_p), ("layer", c_u32), ("causal", c_int), ("window", c_i64),
                ("softmax_scale", c_float), ("device_buffers", c_int), ("stream_ordered", c_int),
                ("stream", c_void_p), ("out_cast", c_void_p), ("out_cast_dtype", c_u32)]


class AttendReport(ctypes.Structure):
    _fields_ = [("shards", ctypes.c_int32), ("retries", ctypes.c_int32), ("blocks", c_u64), ("bytes_sent", c_u64),
                ("bytes_received", c_u64), ("appended_tokens", c_u32), ("seconds", c_double),
                ("node_seconds", c_double), ("kernel_seconds", c_double), ("copy_seconds", c_double),
                ("merge_seconds", c_double), ("shards_in_place", ctypes.c_int32),
                ("inputs_waited_on_device", ctypes.c_int32), ("plan_seconds", c_double),
                ("stage_seconds", c_double), ("round_trip_seconds", c_double), ("transport_seconds", c_double),
                ("shards_replied_queued", ctypes.c_int32), ("shards_detached", ctypes.c_int32)]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class SequenceReport(ctypes.Structure):
    _fields_ = [("nodes_holding", ctypes.c_int32), ("blocks_erased", c_u64), ("open_blocks_dropped", c_u64)]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class PrefixStartReport(ctypes.Structure):
    _fields_ = [("blocks", c_u64), ("tokens", c_u64), ("blocks_shared", c_u64), ("blocks_copied", c_u64),
                ("bytes_copied", c_u64)]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class ForkReport(ctypes.Structure):
    _fields_ = [("nodes_holding", ctypes.c_int32), ("blocks_shared", c_u64), ("blocks_copied", c_u64),
                ("shared_chunks", c_u64)]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class SequenceInfo(ctypes.Structure):
    _fields_ = ([("sequence_id", ctypes.c_char * 257), ("nodes", ctypes.c_int32)] +
                [(n, c_u64) for n in ("full_blocks", "open_blocks", "bytes", "shared_blocks", "tokens")] +
                [("block_tokens", ctypes.c_uint32), ("forked", ctypes.c_int32), ("host_blocks", c_u64),
                 ("cold_blocks", c_u64)])

    def as_dict(self):
        d = {name: getattr(self, name) for name, _ in self._fields_}
        d["sequence_id"] = self.sequence_id.decode("utf-8", "replace")
        d["forked"] = bool(self.forked)
        return d


class NodeStats(ctypes.Structure):
    _fields_ = ([("node_id", ctypes.c_char * 64), ("address", ctypes.c_char * 64), ("state", ctypes.c_char * 16),
                 ("backend", ctypes.c_char * 24), ("ok", ctypes.c_int32), ("error", ctypes.c_char * 128)] +
                [(n, c_u64) for n in ("blocks", "host_blocks", "cold_blocks", "pinned_blocks", "free_pages",
                                      "num_pages", "puts", "hits", "misses", "evictions", "demotions", "promotions",
                                      "sequences", "cold_stored_bytes", "cold_raw_bytes", "hbm_pages",
                                      "hbm_free_pages", "hbm_page_bytes", "hbm_blocks", "hbm_hits", "hbm_misses",
                                      "hbm_demotions", "open_blocks", "device_delivered_bytes", "tenant_sequences",
                                      "tenant_sequence_blocks", "tenant_sequence_bytes",
                                      "tenant_sequence_open_blocks", "tenant_open_bytes", "hbm_shared_pages",
                                      "tenant_sequence_host_blocks", "tenant_sequence_cold_blocks",
                                      "tenant_sequence_hbm_bytes")])

    def as_dict(self):
        d = {}
        for name, _ in self._fields_:
            v = getattr(self, name)
            d[name] = v.decode() if isinstance(v, bytes) else v
        d["ok"] = bool(d["ok"])
        return d


def _load():
    here = os.path.dirname(os.path.abspath(__file__))
    lib = ctypes.CDLL(os.path.join(here, "libkvring_c.so"))
    sig = {
        "kvring_api_version": (c_int, []),
        "kvring_last_error": (c_char_p, []),
        "kvring_connect": (c_int, [P(Options), P(c_void_p)]),
        "kvring_close": (None, [c_void_p]),
        "kvring_tenant": (c_int, [c_void_p, c_char_p, c_size_t]),
        "kvring_namespace": (c_int, [c_void_p, c_char_p, c_size_t]),
        "kvring_map_version": (c_u64, [c_void_p]),
        "kvring_chain": (c_int, [c_void_p, c_char_p, P(Layout_), c_void_p, c_u64, c_void_p, c_void_p]),
        "kvring_lookup": (c_int, [c_void_p, c_void_p, c_u64, P(c_u64)]),
        "kvring_put": (c_int, [c_void_p, c_void_p, c_u64, c_void_p, c_int, P(Layout_), c_void_p, c_int, c_char_p,
                               c_u64, P(PutReport)]),
        "kvring_get_into": (c_int, [c_void_p, c_void_p, c_u64, P(Layout_), c_void_p, c_int, c_void_p]),
        "kvring_pin": (c_int, [c_void_p, c_void_p, c_u64, c_int]),
        "kvring_step": (c_int, [c_void_p, P(StepArgs), c_void_p, c_void_p, P(AttendReport)]),
        "kvring_stats": (c_int, [c_void_p, P(NodeStats), c_u32, P(c_u32)]),
        "kvring_delete_sequence": (c_int, [c_void_p, c_char_p, c_size_t, P(SequenceReport)]),
        "kvring_truncate_sequence": (c_int, [c_void_p, c_char_p, c_size_t, c_u64, P(SequenceReport)]),
        "kvring_start_sequence_from_prefix": (c_int, [c_void_p, c_char_p, c_size_t, P(Layout_), c_void_p, c_u64,
                                                      P(PrefixStartReport)]),
        "kvring_fork_sequence": (c_int, [c_void_p, c_char_p, c_size_t, c_char_p, c_size_t, c_u64, P(ForkReport)]),
        "kvring_list_sequences": (c_int, [c_void_p, P(SequenceInfo), c_u32, P(c_u32)]),
        "kvring_merge": (c_int, [P(c_void_p), P(c_void_p), c_u32, c_u32, c_u32, c_u32, c_void_p, c_void_p]),
        "kvring_create_tenant": (c_int, [c_char_p, c_char_p, c_char_p, P(c_char_p), c_u32, c_u64, c_char_p, c_char_p,
                                         c_u64, c_char_p, c_size_t]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
    if lib.kvring_api_version() != 11:
        raise ImportError("libkvring_c.so speaks C API version %d; this package needs 11" % lib.kvring_api_version())
    return lib


lib = _load()
