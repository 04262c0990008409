"""What the device-machine benchmarks share (attention_bench.py,
decode_trace.py): the kernels' C API through ctypes, and the paged KV inputs
they time. Llama-3-8B heads: 32 q heads, 8 kv heads, head_dim 128, bf16."""
import ctypes

try:
    import torch
except ImportError:  # decode_trace.py --from-json reports without torch
    torch = None

HQ, HKV, D = 32, 8, 128


def load_lib(path):
    """The C API (attention/cuda/src/capi.cu) with its argument types set."""
    lib = ctypes.CDLL(path)
    I, U64, F32, VP = ctypes.c_int, ctypes.c_uint64, ctypes.c_float, ctypes.c_void_p
    lib.kvring_cuda_decode.argtypes = [VP, U64, I, I, I, I, I, I, VP, VP, VP, VP, I, VP, VP, VP, I, I, I, F32, I, I, I, VP,
                                       U64, VP, VP, VP, I]
    lib.kvring_cuda_prefill.argtypes = [VP, U64, I, I, I, I, I, I, VP, VP, VP, VP, I, VP, VP, VP, I, I, I, F32, I, I, VP,
                                        VP, VP, I]
    lib.kvring_cuda_prefill_dequantized.argtypes = [VP, U64, I, I, I, I, I, I, VP, VP, VP, VP, I, I, VP, VP, VP, I, I, I,
                                                    F32, I, I, VP, U64, VP, VP, VP, I]
    lib.kvring_cuda_prefill_dequantized_workspace.argtypes = [I, I, I, I, I, I]
    lib.kvring_cuda_prefill_dequantized_workspace.restype = U64
    lib.kvring_cuda_decode_splits.argtypes = [I, I, I, I, I, I, I]
    if hasattr(lib, "kvring_cuda_decode_splits_for"):  # (builds before 2026-12-07 lack it)
        lib.kvring_cuda_decode_splits_for.argtypes = [I, I, I, I, I, I, I, I, I]
    lib.kvring_cuda_decode_workspace.argtypes = [I, I, I, I]
    lib.kvring_cuda_decode_workspace.restype = U64
    if hasattr(lib, "kvring_cuda_decode_trace"):  # diagnostic builds (-DKVRING_DECODE_TRACE)
        lib.kvring_cuda_decode_trace.argtypes = [VP, I]
    return lib


class Paged:
    """KV of B sequences of L tokens as bf16 pages [page][K|V][kv_head][bt][D],
    at shuffled page ids (or in order), positions 0 .. L - 1."""

    def __init__(self, B, L, bt=16, shuffle=True, device="cuda", hkv=HKV, d=D):
        dev = torch.device(device)
        self.B, self.L, self.bt, self.hkv, self.d = B, L, bt, hkv, d
        self.pages_per_seq = (L + bt - 1) // bt
        n = B * self.pages_per_seq
        self.pool = torch.randn(n, 2, hkv, bt, d, dtype=torch.bfloat16, device=dev)
        perm = (torch.randperm(n, device=dev) if shuffle else torch.arange(n, device=dev)).to(torch.int32)
        self.page_ids = perm.contiguous()
        self.page_pos = (torch.arange(self.pages_per_seq, device=dev, dtype=torch.int32) * bt).repeat(B).contiguous()
        self.seq_page_begin = (torch.arange(B + 1, device=dev, dtype=torch.int32) * self.pages_per_seq).contiguous()
        self.seq_tokens = torch.full((B,), L, dtype=torch.int32, device=dev)
        self.stride = 2 * hkv * bt * d * 2

    def dense(self):
        """[B, HKV, L, D] K and V in position order (what SDPA reads)."""
        hkv, d = self.hkv, self.d
        pg = self.pool[self.page_ids.long()].view(self.B, self.pages_per_seq, 2, hkv, self.bt, d)
        k = pg[:, :, 0].permute(0, 2, 1, 3, 4).reshape(self.B, hkv, -1, d)[:, :, : self.L]
        v = pg[:, :, 1].permute(0, 2, 1, 3, 4).reshape(self.B, hkv, -1, d)[:, :, : self.L]
        return k.contiguous(), v.contiguous()

    def kv_args(self):
        """The KV view's arguments of kvring_cuda_decode / kvring_cuda_prefill (layer 0 of 1, bf16)."""
        return [self.pool.data_ptr(), self.stride, self.bt, 1, self.hkv, self.d, 0, 0, self.page_ids.data_ptr(),
                self.page_pos.data_ptr(), self.seq_page_begin.data_ptr(), self.seq_tokens.data_ptr(), self.B]
