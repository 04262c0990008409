// Device helpers shared by the attention kernels (internal): one include for
// all of them. Each concept has its own header:
//   device_ptx.cuh     PTX wrappers (cp.async, mma, mbarriers, TMA, PDL, fences) and vector types
//   page_access.cuh    plane offsets, token positions and counts in the page pool
//   prefill_cta.cuh    a prefill CTA's row range and visible keys
//   decode_cta.cuh     a decode CTA's work and the split merge
//   dispatch.cuh       the launchers' dispatch from a view's head dim, type and encoding to the kernels' templates
#pragma once

#include "decode_cta.cuh"
#include "device_ptx.cuh"
#include "dispatch.cuh"
#include "kvring/attention/cuda/paged_attention_cuda.h"
#include "page_access.cuh"
#include "prefill_cta.cuh"
