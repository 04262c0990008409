// CUDA partial attention over the HBM page pool (Hopper, sm_90): one include
// for all of it. Each concept has its own header:
//   attention_views_cuda.h    the views (pages, queries, outputs) and the contract
//   paged_decode_cuda.h       PagedDecode (flash-decoding over pages)
//   paged_prefill_cuda.h      PagedPrefill (tensor cores)
//   merge_cuda.h              MergePartials, MergeInto
//   pack_layer_pages_cuda.h   PackLayerPages, LayerSliceBytes, Iota
#pragma once

#include "kvring/attention/cuda/attention_views_cuda.h"
#include "kvring/attention/cuda/merge_cuda.h"
#include "kvring/attention/cuda/pack_layer_pages_cuda.h"
#include "kvring/attention/cuda/paged_decode_cuda.h"
#include "kvring/attention/cuda/paged_prefill_cuda.h"
