// The FFI handler symbols, one per target and platform (defined in cpu_handlers.cc and
// cpu_fp4_handlers.cc and, when CUDA is built, cuda_handlers.cu and cuda_fp4.cu). ext.cc hands
// them to Python.
#ifndef JAXRING_XLA_EXT_HANDLERS_H_
#define JAXRING_XLA_EXT_HANDLERS_H_

#include "xla/ffi/api/api.h"

// X(target name, symbol stem): the target is registered as "jaxring_<name>".
#define JAXRING_FOR_EACH_TARGET(X)            \
  X("quantize_int8", JaxringQuantizeInt8)     \
  X("dequantize_int8", JaxringDequantizeInt8) \
  X("ring_hop_int8", JaxringRingHopInt8)      \
  X("ring_hop_int8_last", JaxringRingHopInt8Last) \
  X("ring_hop_cast", JaxringRingHopCast)      \
  X("ring_hop_cast_last", JaxringRingHopCastLast) \
  X("chunk_norms", JaxringChunkNorms)         \
  X("gather_chunks", JaxringGatherChunks)     \
  X("scatter_add_chunks", JaxringScatterAddChunks) \
  X("quantize_fp4", JaxringQuantizeFp4)       \
  X("dequantize_fp4", JaxringDequantizeFp4)   \
  X("ring_hop_fp4", JaxringRingHopFp4)        \
  X("ring_hop_fp4_last", JaxringRingHopFp4Last)

// In-process collectives (cpu_inprocess.cc): CPU only, a transport rather than a kernel.
#define JAXRING_FOR_EACH_INPROCESS_TARGET(X)               \
  X("local_reduce_scatter", JaxringLocalReduceScatter) \
  X("local_all_gather", JaxringLocalAllGather)         \
  X("local_all_gather_decode", JaxringLocalAllGatherDecode)

// The ring's kernels with the local chunk read in place (cpu_handlers.cc, cpu_fp4_handlers.cc):
// CPU only; on other platforms the wrappers slice and call the kernels above.
#define JAXRING_FOR_EACH_WINDOW_TARGET(X)               \
  X("quantize_int8_at", JaxringQuantizeInt8At)         \
  X("ring_hop_int8_at", JaxringRingHopInt8At)          \
  X("ring_hop_int8_last_at", JaxringRingHopInt8LastAt) \
  X("ring_hop_cast_at", JaxringRingHopCastAt)          \
  X("ring_hop_cast_last_at", JaxringRingHopCastLastAt) \
  X("quantize_fp4_at", JaxringQuantizeFp4At)           \
  X("ring_hop_fp4_at", JaxringRingHopFp4At)            \
  X("ring_hop_fp4_last_at", JaxringRingHopFp4LastAt)

// Host-only handlers (launches.cc): registered for CPU and CUDA alike, whatever was built.
#define JAXRING_FOR_EACH_HOST_TARGET(X) X("launch_mark", JaxringLaunchMark)

// Their instantiate stage, and the type of the state it makes (a call site), which Python
// registers with XLA before the targets (cpu_rendezvous.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxringLocalCallSiteCpu);
namespace jaxring {
const void* CallSiteTypeId();    // XLA_FFI_TypeId*
const void* CallSiteTypeInfo();  // const XLA_FFI_TypeInfo*
}  // namespace jaxring

#define JAXRING_DECLARE_CPU(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(stem##Cpu);
JAXRING_FOR_EACH_TARGET(JAXRING_DECLARE_CPU)
JAXRING_FOR_EACH_INPROCESS_TARGET(JAXRING_DECLARE_CPU)
JAXRING_FOR_EACH_WINDOW_TARGET(JAXRING_DECLARE_CPU)
JAXRING_FOR_EACH_HOST_TARGET(JAXRING_DECLARE_CPU)
#undef JAXRING_DECLARE_CPU
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxringLaunchMarkCuda);

#ifdef JAXRING_WITH_CUDA
#define JAXRING_DECLARE_CUDA(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(stem##Cuda);
JAXRING_FOR_EACH_TARGET(JAXRING_DECLARE_CUDA)
#undef JAXRING_DECLARE_CUDA
#endif

#endif  // JAXRING_XLA_EXT_HANDLERS_H_
