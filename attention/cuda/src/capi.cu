// C ABI over the CUDA launchers (for ctypes). Pointers are device pointers;
// integer arrays are int32 on the device; the stream is a cudaStream_t
// (torch.cuda.current_stream().cuda_stream). Returns cudaError_t as int.
// kvring_cuda_decode's workspace (kvring_cuda_decode_workspace bytes) must be
// zeroed once before its first use (torch.zeros); each call leaves it so.
// Its `flags`: bit 0 PagedKvView::tables_stable (the caller promises that no
// kernel still running writes page_ids, page_pos, seq_page_begin, seq_tokens
// or seq_row_begin); bits 1-2 the QuantDecodeKernel for quantized pages (0
// kAuto, 1 kSixteenRows, 2 kSmallGroups).
#include "kvring/attention/cuda/paged_attention_cuda.h"

using namespace kvring::cuda;

namespace {
PagedKvView Kv(const void* pool, uint64_t stride, int bt, int layers, int kv_heads, int head_dim, int dtype, int layer,
               const int32_t* page_ids, const int32_t* page_pos, const int32_t* seq_page_begin,
               const int32_t* seq_tokens, int num_seqs) {
  PagedKvView v;
  v.pool = pool;
  v.page_stride = stride;
  v.block_tokens = bt;
  v.layers = layers;
  v.kv_heads = kv_heads;
  v.head_dim = head_dim;
  // Low byte: the dtype; the next: the encoding as KvEncoding::Pack() has it
  // (one that does not unpack becomes a codec outside the enum, which
  // CheckViews refuses).
  v.dtype = static_cast<KvType>(dtype & 0xff);
  const uint8_t enc = (dtype >> 8) & 0xff;
  if (!kvring::KvEncoding::Unpack(enc, &v.encoding)) v.encoding.codec = static_cast<kvring::KvCodec>(0xff);
  v.layer = layer;
  v.page_ids = page_ids;
  v.page_pos = page_pos;
  v.seq_page_begin = seq_page_begin;
  v.seq_tokens = seq_tokens;
  v.num_seqs = num_seqs;
  return v;
}
QueryView Q(const void* q, const int32_t* pos, const int32_t* seq_row_begin, int num_rows, int q_heads, int max_rows) {
  QueryView v;
  v.q = q;
  v.positions = pos;
  v.seq_row_begin = seq_row_begin;
  v.num_rows = num_rows;
  v.q_heads = q_heads;
  v.max_rows_per_seq = max_rows;
  return v;
}
}  // namespace

extern "C" {

int kvring_cuda_decode(const void* pool, uint64_t stride, int bt, int layers, int kv_heads, int head_dim, int dtype,
                       int layer, const int32_t* page_ids, const int32_t* page_pos, const int32_t* seq_page_begin,
                       const int32_t* seq_tokens, int num_seqs, const void* q, const int32_t* pos,
                       const int32_t* seq_row_begin, int num_rows, int q_heads, int max_rows, float scale, int causal,
                       int window, int num_splits, void* workspace, uint64_t workspace_bytes, float* out, float* lse,
                       void* stream, int flags) {
  AttnParams p{scale, causal != 0, window};
  PagedKvView kv = Kv(pool, stride, bt, layers, kv_heads, head_dim, dtype, layer, page_ids, page_pos, seq_page_begin,
                      seq_tokens, num_seqs);
  kv.tables_stable = (flags & 1) != 0;
  return PagedDecode(p, Q(q, pos, seq_row_begin, num_rows, q_heads, max_rows), kv, OutputView{out, lse}, num_splits,
                     workspace, workspace_bytes, static_cast<cudaStream_t>(stream),
                     static_cast<QuantDecodeKernel>((flags >> 1) & 3));
}

// DefaultDecodeSplits for sequences of up to max_pages pages of block_tokens tokens.
int kvring_cuda_decode_splits(int num_seqs, int kv_heads, int q_heads, int max_rows, int max_pages, int block_tokens,
                              int sm_count) {
  PagedKvView kv;
  kv.num_seqs = num_seqs;
  kv.kv_heads = kv_heads;
  kv.block_tokens = block_tokens;
  QueryView q;
  q.q_heads = q_heads;
  q.max_rows_per_seq = max_rows;
  return DefaultDecodeSplits(q, kv, max_pages, sm_count);
}

// The same for pages of head_dim and `dtype` (kvring_cuda_decode's packed
// dtype and encoding): the split count kvringd's GPU node uses for them.
int kvring_cuda_decode_splits_for(int num_seqs, int kv_heads, int q_heads, int max_rows, int max_pages,
                                  int block_tokens, int head_dim, int dtype, int sm_count) {
  PagedKvView kv =
      Kv(nullptr, 0, block_tokens, 1, kv_heads, head_dim, dtype, 0, nullptr, nullptr, nullptr, nullptr, num_seqs);
  QueryView q;
  q.q_heads = q_heads;
  q.max_rows_per_seq = max_rows;
  return DefaultDecodeSplits(q, kv, max_pages, sm_count);
}

uint64_t kvring_cuda_decode_workspace(int num_rows, int q_heads, int num_splits, int head_dim) {
  QueryView q;
  q.num_rows = num_rows;
  q.q_heads = q_heads;
  return DecodeWorkspaceBytes(q, num_splits, head_dim);
}

int kvring_cuda_prefill(const void* pool, uint64_t stride, int bt, int layers, int kv_heads, int head_dim, int dtype,
                        int layer, const int32_t* page_ids, const int32_t* page_pos, const int32_t* seq_page_begin,
                        const int32_t* seq_tokens, int num_seqs, const void* q, const int32_t* pos,
                        const int32_t* seq_row_begin, int num_rows, int q_heads, int max_rows, float scale, int causal,
                        int window, float* out, float* lse, void* stream, int kernel) {
  AttnParams p{scale, causal != 0, window};
  return PagedPrefill(p, Q(q, pos, seq_row_begin, num_rows, q_heads, max_rows),
                      Kv(pool, stride, bt, layers, kv_heads, head_dim, dtype, layer, page_ids, page_pos, seq_page_begin,
                         seq_tokens, num_seqs),
                      OutputView{out, lse}, static_cast<cudaStream_t>(stream), static_cast<PrefillKernel>(kernel));
}

// kvring_cuda_prefill over quantized pages through the 16-bit kernels
// (PagedPrefillDequantized): listed_pages entries in page_ids, a workspace of
// kvring_cuda_prefill_dequantized_workspace bytes.
uint64_t kvring_cuda_prefill_dequantized_workspace(int bt, int layers, int kv_heads, int head_dim, int dtype,
                                                   int listed_pages) {
  return DequantizedPrefillWorkspaceBytes(
      Kv(nullptr, 0, bt, layers, kv_heads, head_dim, dtype, 0, nullptr, nullptr, nullptr, nullptr, 0), listed_pages);
}

int kvring_cuda_prefill_dequantized(const void* pool, uint64_t stride, int bt, int layers, int kv_heads, int head_dim,
                                    int dtype, int layer, const int32_t* page_ids, const int32_t* page_pos,
                                    const int32_t* seq_page_begin, const int32_t* seq_tokens, int num_seqs,
                                    int listed_pages, const void* q, const int32_t* pos, const int32_t* seq_row_begin,
                                    int num_rows, int q_heads, int max_rows, float scale, int causal, int window,
                                    void* workspace, uint64_t workspace_bytes, float* out, float* lse, void* stream,
                                    int kernel) {
  AttnParams p{scale, causal != 0, window};
  return PagedPrefillDequantized(p, Q(q, pos, seq_row_begin, num_rows, q_heads, max_rows),
                                 Kv(pool, stride, bt, layers, kv_heads, head_dim, dtype, layer, page_ids, page_pos,
                                    seq_page_begin, seq_tokens, num_seqs),
                                 listed_pages, workspace, workspace_bytes, OutputView{out, lse},
                                 static_cast<cudaStream_t>(stream), static_cast<PrefillKernel>(kernel));
}

int kvring_cuda_merge(const float* out_parts, const float* lse_parts, int num_parts, int rows_heads, int head_dim,
                      float* out, float* lse, void* stream) {
  return MergePartials(out_parts, lse_parts, num_parts, rows_heads, head_dim, OutputView{out, lse},
                       static_cast<cudaStream_t>(stream));
}

}  // extern "C"
