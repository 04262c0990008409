/* kvring's C ABI: the C++ client (kvring/client/client.h) behind plain C
 * types, for languages that load a shared library (Python's ctypes, and so
 * any Python 3, with or without numpy or torch), and engines written in C.
 *
 * Conventions:
 *  - Every call returns a status code: 0 is OK, anything else is an
 *    absl/gRPC status code (3 INVALID_ARGUMENT, 5 NOT_FOUND, 8
 *    RESOURCE_EXHAUSTED, 14 UNAVAILABLE, ...). kvring_last_error() gives the
 *    calling thread's message for its last failed call.
 *  - Keys are arrays of uint64 pairs (lo, hi). Block buffers hold whole
 *    blocks of the given layout, back to back.
 *  - `on_device` / `device_buffers`: the buffer is CUDA device memory of the
 *    calling process (an engine's GPU tensors); the client moves the bytes
 *    through pinned host staging, once each way.
 *  - A kvring_client is thread-safe; calls block until done (no callbacks).
 */
#ifndef KVRING_KVRING_C_H_
#define KVRING_KVRING_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVRING_C_API_VERSION 11

typedef struct kvring_client kvring_client;

typedef struct {
  uint32_t block_tokens, layers, kv_heads, head_dim;
  uint32_t dtype; /* 0 f32, 1 f16, 2 bf16 */
} kvring_layout;

typedef struct {
  const char* coordinator; /* host:port */
  const char* token;
  const char* ns;       /* "" or NULL: the tenant's own namespace */
  int use_ucx;          /* the daemons' UCX data plane when they have one */
  const char* quantize; /* ClientOptions::quantize; NULL or "": the tenant's default */
  double rpc_timeout_s; /* <= 0: 10 s */
  const char* tls_ca;
  const char* tls_cert;
  const char* tls_key;
  uint32_t threads;                  /* fan-out threads; 0: 16 */
  int32_t ucx_spin_us;               /* UCX progress threads: busy-poll this long after a message (-1: by core count) */
  int32_t ucx_busy_poll;             /* UCX progress threads never sleep */
  int32_t no_device_delivery;        /* ClientOptions::device_delivery = false (version 2) */
  int64_t device_exchange_min_bytes; /* ClientOptions::device_exchange_min_bytes; < 0: its default (version 3) */
  int32_t ucx_spin_max_us; /* UCX adaptive spin window (UcxLoopOptions::spin_max_us; -1: by core count, 0: off; version
                              6) */
  int32_t node_reply_when_queued; /* ClientOptions::node_reply_when_queued: 0 its default (on), > 0 on, < 0 off
                                     (version 10; in 8-9 nonzero was on, 0 off) */
  int32_t detach_device_steps;    /* ClientOptions::detach_device_steps: > 0 on, else off (version 11) */
} kvring_options;

typedef struct {
  uint64_t blocks, inserted, replicas_written, bytes;
} kvring_put_report;

typedef struct {
  const char* sequence_id;
  uint64_t context_tokens; /* tokens already in kvring on the step's layer */
  uint32_t rows;           /* query rows of this sequence */
  uint32_t append_tokens;  /* tokens whose K/V the step appends */
} kvring_seq;

typedef struct {
  kvring_layout layout;
  const kvring_seq* seqs;
  uint32_t num_seqs;
  const void* q;    /* [num_rows, q_heads, head_dim] in q_dtype, rows grouped by sequence */
  uint32_t q_dtype; /* 0 f32, 1 f16, 2 bf16 */
  uint32_t num_rows, q_heads, head_dim;
  const int64_t* positions; /* [num_rows], host memory */
  const void* new_k;        /* [sum append_tokens, kv_heads, head_dim] in layout.dtype */
  const void* new_v;
  uint32_t layer;
  int causal;
  int64_t window;
  float softmax_scale; /* 0: 1/sqrt(head_dim) */
  int device_buffers;  /* q, new_k, new_v and out/lse are device memory */
  /* With device_buffers (version 7): stream_ordered != 0 orders the step on
   * `stream` (a cudaStream_t; NULL is the legacy default stream) and returns
   * once its last device work is queued there (AttendStep::stream_ordered):
   * no synchronize before the call, and synchronize the stream before the
   * host reads out/lse. */
  int stream_ordered;
  void* stream;
  /* With device_buffers (version 9): the merged O also written into
   * out_cast, device memory of [num_rows, q_heads, head_dim] in
   * out_cast_dtype (1 f16, 2 bf16), the model's attention output in its own
   * dtype (AttendStep::out_cast); NULL: not. out and lse are written as
   * always. */
  void* out_cast;
  uint32_t out_cast_dtype;
} kvring_step_args;

typedef struct {
  int32_t shards, retries;
  uint64_t blocks, bytes_sent, bytes_received;
  uint32_t appended_tokens;
  double seconds, node_seconds, kernel_seconds, copy_seconds, merge_seconds;
  int32_t shards_in_place;         /* shards that attended in this process's GPU memory (CUDA IPC; version 3) */
  int32_t inputs_waited_on_device; /* AttendReport::inputs_waited_on_device (version 7) */
  /* AttendReport's split of `seconds` (version 7). */
  double plan_seconds, stage_seconds, round_trip_seconds, transport_seconds;
  /* Shards that answered once the step's work was queued on their GPU
   * (AttendReport::shards_replied_queued; version 8). */
  int32_t shards_replied_queued;
  /* Shards whose replies the step did not wait for (AttendReport::shards_detached; version 11). */
  int32_t shards_detached;
} kvring_attend_report;

typedef struct {
  char node_id[64], address[64], state[16], backend[24];
  int32_t ok;
  char error[128];
  uint64_t blocks, host_blocks, cold_blocks, pinned_blocks, free_pages, num_pages;
  uint64_t puts, hits, misses, evictions, demotions, promotions, sequences;
  uint64_t cold_stored_bytes, cold_raw_bytes;
  uint64_t hbm_pages, hbm_free_pages, hbm_page_bytes, hbm_blocks, hbm_hits, hbm_misses, hbm_demotions, open_blocks;
  uint64_t device_delivered_bytes; /* Get payload bytes copied straight into callers' GPU memory (version 2) */
  /* The caller's attention sequences on the node (version 4). */
  uint64_t tenant_sequences, tenant_sequence_blocks, tenant_sequence_bytes, tenant_sequence_open_blocks;
  uint64_t tenant_open_bytes;
  uint64_t hbm_shared_pages; /* HBM pages several sequences hold: forks' shared blocks (version 5) */
  /* The caller's full sequence blocks by tier, and its sequences' HBM bytes (version 5). */
  uint64_t tenant_sequence_host_blocks, tenant_sequence_cold_blocks, tenant_sequence_hbm_bytes;
} kvring_node_stats;

int kvring_api_version(void);
/* The calling thread's message for its last failed call ("" if none). */
const char* kvring_last_error(void);

int kvring_connect(const kvring_options* options, kvring_client** out);
void kvring_close(kvring_client* c);
/* The tenant's name / the namespace the client acts in, NUL-terminated into buf. */
int kvring_tenant(kvring_client* c, char* buf, size_t cap);
int kvring_namespace(kvring_client* c, char* buf, size_t cap);
uint64_t kvring_map_version(kvring_client* c);

/* Keys of the full blocks of `tokens` (n_tokens / block_tokens of them) into
 * keys_out, continuing from `parent` (NULL: a sequence start). */
int kvring_chain(kvring_client* c, const char* model, const kvring_layout* layout, const uint32_t* tokens,
                 uint64_t n_tokens, const uint64_t* parent, uint64_t* keys_out);
int kvring_lookup(kvring_client* c, const uint64_t* keys, uint64_t n, uint64_t* held);
/* Puts n blocks (hash placement; or, with sequence_id, blocks
 * [first_block, first_block + n) of an attention sequence). */
int kvring_put(kvring_client* c, const uint64_t* keys, uint64_t n, const void* blocks, int on_device,
               const kvring_layout* layout, const uint64_t* parent, int pin, const char* sequence_id,
               uint64_t first_block, kvring_put_report* report);
/* Reads n blocks into out (n * layout bytes); found[i] = 1 if block i was
 * read, 0 if no replica holds it. Any other failure of a block fails the
 * call. Quantized blocks come back dequantized to the layout's dtype. */
int kvring_get_into(kvring_client* c, const uint64_t* keys, uint64_t n, const kvring_layout* layout, void* out,
                    int on_device, uint8_t* found);
int kvring_pin(kvring_client* c, const uint64_t* keys, uint64_t n, int unpin);
/* An attention step (Client::StepInto): out [num_rows, q_heads, head_dim]
 * and lse [num_rows, q_heads], float32. report may be NULL. */
int kvring_step(kvring_client* c, const kvring_step_args* args, float* out, float* lse, kvring_attend_report* report);
/* Sequence lifecycle (version 4; Client::DeleteSequence / TruncateSequence):
 * every UP node; idempotent. report may be NULL. */
typedef struct {
  int32_t nodes_holding;
  uint64_t blocks_erased, open_blocks_dropped;
} kvring_sequence_report;
int kvring_delete_sequence(kvring_client* c, const char* sequence_id, size_t id_len, kvring_sequence_report* report);
int kvring_truncate_sequence(kvring_client* c, const char* sequence_id, size_t id_len, uint64_t tokens,
                             kvring_sequence_report* report);
/* Forks (version 5; Client::ForkSequence): `sequence_id` starts as the first
 * `tokens` tokens of `source_id`, sharing its full blocks. report may be NULL. */
typedef struct {
  int32_t nodes_holding;
  uint64_t blocks_shared, blocks_copied, shared_chunks;
} kvring_fork_report;
int kvring_fork_sequence(kvring_client* c, const char* source_id, size_t source_len, const char* sequence_id,
                         size_t id_len, uint64_t tokens, kvring_fork_report* report);
/* A sequence started from a prefix-cache chain (version 7;
 * Client::StartSequenceFromPrefix): `keys` are n (lo, hi) pairs of a chain in
 * `layout`; the sequence starts with the cache's hit (report->tokens).
 * report may be NULL. */
typedef struct {
  uint64_t blocks, tokens, blocks_shared, blocks_copied, bytes_copied;
} kvring_prefix_start_report;
int kvring_start_sequence_from_prefix(kvring_client* c, const char* sequence_id, size_t id_len,
                                      const kvring_layout* layout, const uint64_t* keys, uint64_t n,
                                      kvring_prefix_start_report* report);
/* The caller's sequences (version 5; Client::ListSequences): up to `cap`
 * into `out`; *n is how many there are. */
typedef struct {
  char sequence_id[257]; /* NUL-terminated (ids are at most 256 bytes) */
  int32_t nodes;
  uint64_t full_blocks, open_blocks, bytes, shared_blocks, tokens;
  uint32_t block_tokens;
  int32_t forked;                    /* placed with a source's chunks (a fork) */
  uint64_t host_blocks, cold_blocks; /* of full_blocks: in the host tier, only in the cold tier */
} kvring_sequence_info;
int kvring_list_sequences(kvring_client* c, kvring_sequence_info* out, uint32_t cap, uint32_t* n);
/* Up to `cap` nodes' stats; *n is the number of nodes in the map. */
int kvring_stats(kvring_client* c, kvring_node_stats* out, uint32_t cap, uint32_t* n);

/* Exact merge of `parts` partials (out [rows, heads, dim], lse [rows, heads]). */
int kvring_merge(const float* const* outs, const float* const* lses, uint32_t parts, uint32_t rows, uint32_t heads,
                 uint32_t dim, float* out, float* lse);
/* Administration: creates a tenant; its token (shown once) into token_out. */
int kvring_create_tenant(const char* coordinator, const char* admin_token, const char* name,
                         const char* const* shared_namespaces, uint32_t n_shared, uint64_t max_pinned_bytes,
                         const char* kv_encoding, const char* tls_ca, uint64_t sequence_ttl_s /* version 4 */,
                         char* token_out, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* KVRING_KVRING_C_H_ */
