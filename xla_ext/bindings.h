// The operands, results and attributes of every target, written once for the CPU and CUDA
// handlers so that both decode the same call frame: each binding is templated on the platform
// context (ffi::ThreadPool, ffi::PlatformStream<cudaStream_t>, or void for none).
#ifndef JAXRING_XLA_EXT_BINDINGS_H_
#define JAXRING_XLA_EXT_BINDINGS_H_

#include <cstdint>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jaxring::bindings {

namespace ffi = xla::ffi;
using Buf = ffi::AnyBuffer;

template <class Ctx>
auto Bind() {
  if constexpr (std::is_void_v<Ctx>) {
    return ffi::Ffi::Bind();
  } else {
    return ffi::Ffi::Bind().Ctx<Ctx>();
  }
}

template <class Ctx>
auto QuantizeInt8() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // x
      .template Arg<Buf>()  // seed
      .template Ret<Buf>()  // q
      .template Ret<Buf>()  // scales
      .template Attr<int64_t>("block_size")
      .template Attr<bool>("stochastic");
}

template <class Ctx>
auto DequantizeInt8() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // q
      .template Arg<Buf>()  // scales
      .template Ret<Buf>()  // x
      .template Attr<int64_t>("block_size");
}

template <class Ctx>
auto RingHopInt8() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // q
      .template Arg<Buf>()  // scales
      .template Arg<Buf>()  // partial
      .template Arg<Buf>()  // seed
      .template Ret<Buf>()  // new_partial
      .template Ret<Buf>()  // q_out
      .template Ret<Buf>()  // scales_out
      .template Attr<int64_t>("block_size")
      .template Attr<bool>("stochastic");
}

template <class Ctx>
auto RingHopInt8Last() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // q
      .template Arg<Buf>()  // scales
      .template Arg<Buf>()  // partial
      .template Ret<Buf>()  // new_partial
      .template Attr<int64_t>("block_size");
}

template <class Ctx>
auto RingHopCast() {
  return Bind<Ctx>()
      .template Arg<Buf>()   // recv
      .template Arg<Buf>()   // partial
      .template Ret<Buf>()   // new_partial
      .template Ret<Buf>();  // out
}

template <class Ctx>
auto RingHopCastLast() {
  return Bind<Ctx>()
      .template Arg<Buf>()   // recv
      .template Arg<Buf>()   // partial
      .template Ret<Buf>();  // new_partial
}

template <class Ctx>
auto ChunkNorms() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // x
      .template Ret<Buf>()  // norms
      .template Attr<int64_t>("chunk_size");
}

template <class Ctx>
auto GatherChunks() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // x
      .template Arg<Buf>()  // idx
      .template Ret<Buf>()  // packed
      .template Attr<int64_t>("chunk_size");
}

template <class Ctx>
auto ScatterAddChunks() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // x
      .template Arg<Buf>()  // idx
      .template Arg<Buf>()  // packed
      .template Ret<Buf>()  // x + scattered packed
      .template Attr<int64_t>("chunk_size");
}

// The fp4 codec's targets take the int8 ones' operands (packed uint8 codes for int8 codes).
template <class Ctx>
auto QuantizeFp4() { return QuantizeInt8<Ctx>(); }
template <class Ctx>
auto DequantizeFp4() { return DequantizeInt8<Ctx>(); }
template <class Ctx>
auto RingHopFp4() { return RingHopInt8<Ctx>(); }
template <class Ctx>
auto RingHopFp4Last() { return RingHopInt8Last<Ctx>(); }

// Windowed variants (CPU only): the f32 operand is `base`, read from the int32 scalar `offset` on.
template <class Ctx>
auto QuantizeInt8At() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // base
      .template Arg<Buf>()  // offset
      .template Arg<Buf>()  // seed
      .template Ret<Buf>()  // q
      .template Ret<Buf>()  // scales
      .template Attr<int64_t>("block_size")
      .template Attr<bool>("stochastic");
}

template <class Ctx>
auto RingHopInt8At() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // q
      .template Arg<Buf>()  // scales
      .template Arg<Buf>()  // base
      .template Arg<Buf>()  // offset
      .template Arg<Buf>()  // seed
      .template Ret<Buf>()  // new_partial
      .template Ret<Buf>()  // q_out
      .template Ret<Buf>()  // scales_out
      .template Attr<int64_t>("block_size")
      .template Attr<bool>("stochastic");
}

template <class Ctx>
auto RingHopInt8LastAt() {
  return Bind<Ctx>()
      .template Arg<Buf>()  // q
      .template Arg<Buf>()  // scales
      .template Arg<Buf>()  // base
      .template Arg<Buf>()  // offset
      .template Ret<Buf>()  // new_partial
      .template Attr<int64_t>("block_size");
}

template <class Ctx>
auto RingHopCastAt() {
  return Bind<Ctx>()
      .template Arg<Buf>()   // recv
      .template Arg<Buf>()   // base
      .template Arg<Buf>()   // offset
      .template Ret<Buf>()   // new_partial
      .template Ret<Buf>();  // out
}

template <class Ctx>
auto RingHopCastLastAt() {
  return Bind<Ctx>()
      .template Arg<Buf>()   // recv
      .template Arg<Buf>()   // base
      .template Arg<Buf>()   // offset
      .template Ret<Buf>();  // new_partial
}

template <class Ctx>
auto QuantizeFp4At() { return QuantizeInt8At<Ctx>(); }
template <class Ctx>
auto RingHopFp4At() { return RingHopInt8At<Ctx>(); }
template <class Ctx>
auto RingHopFp4LastAt() { return RingHopInt8LastAt<Ctx>(); }

}  // namespace jaxring::bindings

#endif  // JAXRING_XLA_EXT_BINDINGS_H_
