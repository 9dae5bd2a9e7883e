// jaxring._mpi_ext: the streaming ring all-reduce over MPI, one XLA FFI call per all-reduce.
//
// The Python ring over mpi4jax issues one blocking MPI_Sendrecv per hop, and the decode + add +
// encode of a hop runs while the link is idle. Here every hop is split into `pieces`: all
// receives are posted up front, each piece is sent with MPI_Isend as soon as it is encoded, and
// piece j of hop s + 1 leaves while piece j + 1 of hop s is still arriving. The reduce-scatter
// flows straight into the all-gather (a member forwards its own reduced piece as soon as it is
// encoded), so the link never waits for a whole chunk.
//
// Results are bit-identical to jaxring's ring (algorithms/ring.py) with the same codec: the same
// chunk order, the same kernels (cpu_kernels.h), the same order of additions.
//
// Codecs: the output dtype says what travels. F32/BF16/F16: values cast to it (round to nearest
// even), partial sums in f32. S8: blockwise int8 (round half to even, one f32 scale per
// block_size values, the second output). The input is the f32 accumulator, p * c values.
#include <mpi.h>
#include <nanobind/nanobind.h>

#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "numerics.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jaxring {
namespace {

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Result;
using Clock = std::chrono::steady_clock;

// Tags of this module's messages: hop h (0 .. 2(p-1)-1), piece j -> kTagBase + h * pieces + j.
// They travel on a communicator of their own (a Dup made by the caller), so nothing else can
// match them.
constexpr int kTagBase = 100;

struct Wire {
  DataType type;
  int64_t block_size;  // int8 only
  size_t value_bytes() const { return type == DataType::S8 ? 1 : (type == DataType::F32 ? 4 : 2); }
  bool int8() const { return type == DataType::S8; }
  cpu::Wire cast() const {
    return type == DataType::BF16 ? cpu::Wire::kBf16
                                  : (type == DataType::F16 ? cpu::Wire::kF16 : cpu::Wire::kF32);
  }
};

// One piece's encoded bytes: values (and block scales for int8), len values long.
struct Piece {
  void* values;
  float* scales;  // int8 only
};

void Encode(const Wire& w, const float* x, int64_t len, Piece out) {
  if (w.int8()) {
    cpu::QuantizeBlocks(cpu::Wire::kF32, x, len, w.block_size, 0, len / w.block_size, false, 0,
                        static_cast<int8_t*>(out.values), out.scales);
  } else if (w.type == DataType::F32) {
    std::memcpy(out.values, x, len * sizeof(float));
  } else if (w.type == DataType::BF16) {
    auto* o = static_cast<uint16_t*>(out.values);
    for (int64_t i = 0; i < len; ++i) o[i] = F32ToBf16(x[i]);
  } else {
    auto* o = static_cast<uint16_t*>(out.values);
    for (int64_t i = 0; i < len; ++i) o[i] = F32ToF16(x[i]);
  }
}

// partial = decode(in) + local; when out.values is set, out = encode(partial).
void Hop(const Wire& w, Piece in, const float* local, int64_t len, float* partial, Piece out) {
  if (w.int8()) {
    cpu::RingHopInt8Blocks(static_cast<const int8_t*>(in.values), in.scales, local, len,
                           w.block_size, 0, len / w.block_size, false, 0, partial,
                           static_cast<int8_t*>(out.values), out.scales);
  } else {
    cpu::RingHopCastRange(w.cast(), in.values, local, 0, len, partial, out.values);
  }
}

class Ring {
 public:
  Ring(MPI_Comm comm, const Wire& w, int64_t n, int64_t pieces, double timeout_s)
      : comm_(comm), w_(w), pieces_(pieces), timeout_(timeout_s) {
    MPI_Comm_size(comm, &p_);
    MPI_Comm_rank(comm, &r_);
    c_ = n / p_;
    cp_ = c_ / pieces_;
  }

  int p() const { return p_; }

  // x: p * c f32 values; values/scales: the gathered payload (member order).
  ffi::Error Run(const float* x, void* values, float* scales) {
    const int64_t hops = p_ - 1, k = pieces_;
    const size_t vb = w_.value_bytes();
    const int64_t spp = w_.int8() ? cp_ / w_.block_size : 0;  // scales per piece
    // Reduce-scatter wire buffers: hop s receives into recv_[s] and sends send_[s].
    std::vector<char> recv_vals(hops * c_ * vb), send_vals(hops * c_ * vb);
    std::vector<float> recv_scales(hops * k * spp), send_scales(hops * k * spp);
    std::vector<float> partial(cp_);
    auto rs_piece = [&](std::vector<char>& vals, std::vector<float>& sc, int64_t s, int64_t j) {
      return Piece{vals.data() + (s * c_ + j * cp_) * vb,
                   w_.int8() ? sc.data() + (s * k + j) * spp : nullptr};
    };
    // All-gather: chunk q of the output, piece j.
    auto out_piece = [&](int64_t q, int64_t j) {
      return Piece{static_cast<char*>(values) + (q * c_ + j * cp_) * vb,
                   w_.int8() ? scales + q * c_ / w_.block_size + j * spp : nullptr};
    };
    auto chunk = [&](int64_t q) { return ((q % p_) + p_) % p_; };
    const int next = (r_ + 1) % p_, prev = (r_ - 1 + p_) % p_;

    // Post every receive now: hop h, piece j (h < hops: reduce-scatter; else all-gather).
    std::vector<MPI_Request> recvs(2 * hops * k * 2, MPI_REQUEST_NULL);
    std::vector<MPI_Request> sends;
    sends.reserve(2 * hops * k * 2);
    for (int64_t h = 0; h < 2 * hops; ++h) {
      for (int64_t j = 0; j < k; ++j) {
        Piece dst = h < hops ? rs_piece(recv_vals, recv_scales, h, j)
                             : out_piece(chunk(r_ - 1 - (h - hops)), j);
        Post(dst, h, j, prev, &recvs[(h * k + j) * 2], /*send=*/false);
      }
    }
    // Hop 0 sends our chunk r - 1, piece by piece as it is encoded.
    for (int64_t j = 0; j < k; ++j) {
      Piece out = rs_piece(send_vals, send_scales, 0, j);
      Encode(w_, x + chunk(r_ - 1) * c_ + j * cp_, cp_, out);
      sends.resize(sends.size() + 2, MPI_REQUEST_NULL);
      Post(out, 0, j, next, &sends[sends.size() - 2], /*send=*/true);
    }
    // Reduce-scatter hops: receive chunk r - 2 - s from prev, add ours, pass it on (or keep it).
    for (int64_t s = 0; s < hops; ++s) {
      const int64_t q = chunk(r_ - 2 - s);
      for (int64_t j = 0; j < k; ++j) {
        if (auto err = Wait(&recvs[(s * k + j) * 2], prev, s, j); !err.success()) return err;
        const float* local = x + q * c_ + j * cp_;
        const bool last = s == hops - 1;
        // The last hop leaves our reduced chunk r, which the all-gather sends on as its hop 0.
        Piece out = last ? out_piece(r_, j) : rs_piece(send_vals, send_scales, s + 1, j);
        Hop(w_, rs_piece(recv_vals, recv_scales, s, j), local, cp_, partial.data(),
            last ? Piece{nullptr, nullptr} : out);
        if (last) Encode(w_, partial.data(), cp_, out);
        sends.resize(sends.size() + 2, MPI_REQUEST_NULL);
        Post(out, last ? hops : s + 1, j, next, &sends[sends.size() - 2], /*send=*/true);
      }
    }
    // All-gather hops: chunk r - 1 - s arrives in place and is forwarded unless it is the last.
    for (int64_t s = 0; s < hops; ++s) {
      for (int64_t j = 0; j < k; ++j) {
        if (auto err = Wait(&recvs[((hops + s) * k + j) * 2], prev, hops + s, j); !err.success())
          return err;
        if (s + 1 < hops) {
          sends.resize(sends.size() + 2, MPI_REQUEST_NULL);
          Post(out_piece(chunk(r_ - 1 - s), j), hops + s + 1, j, next,
               &sends[sends.size() - 2], /*send=*/true);
        }
      }
    }
    for (size_t i = 0; i < sends.size(); i += 2) {
      if (auto err = Wait(&sends[i], next, -1, -1); !err.success()) return err;
    }
    return ffi::Error::Success();
  }

 private:
  // Posts the values (and scales) of one piece: two requests at req[0], req[1].
  void Post(Piece piece, int64_t h, int64_t j, int peer, MPI_Request* req, bool send) {
    const int tag = kTagBase + static_cast<int>(2 * (h * pieces_ + j));
    const int count = static_cast<int>(cp_ * w_.value_bytes());
    if (send) {
      MPI_Isend(piece.values, count, MPI_BYTE, peer, tag, comm_, &req[0]);
    } else {
      MPI_Irecv(piece.values, count, MPI_BYTE, peer, tag, comm_, &req[0]);
    }
    if (!w_.int8()) return;
    const int sc = static_cast<int>(cp_ / w_.block_size);
    if (send) {
      MPI_Isend(piece.scales, sc, MPI_FLOAT, peer, tag + 1, comm_, &req[1]);
    } else {
      MPI_Irecv(piece.scales, sc, MPI_FLOAT, peer, tag + 1, comm_, &req[1]);
    }
  }

  // Waits for both requests at req[0..1], polling so that a silent peer becomes an error that
  // names it instead of a hang. On error the outstanding requests are left to MPI_Finalize.
  ffi::Error Wait(MPI_Request* req, int peer, int64_t h, int64_t j) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_);
    for (int polls = 0;; ++polls) {
      int done = 0;
      MPI_Testall(2, req, &done, MPI_STATUSES_IGNORE);
      if (done) return ffi::Error::Success();
      if (std::getenv("JR_YIELD")) sched_yield();
      if ((polls & 1023) == 1023 && Clock::now() > deadline) {
        std::string what = h < 0 ? std::string("a send to")
                                 : "hop " + std::to_string(h) + " piece " + std::to_string(j) +
                                       " from";
        return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                          "jaxring MPI streaming ring: rank " + std::to_string(WorldRank(r_)) +
                              " waited " + Seconds(timeout_) + " s for " + what +
                              " rank " + std::to_string(WorldRank(peer)) +
                              " (MPI_COMM_WORLD ranks)");
      }
    }
  }

  static std::string Seconds(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", s);
    return buf;
  }

  int WorldRank(int rank) const {
    MPI_Group mine, world;
    MPI_Comm_group(comm_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int out = -1;
    MPI_Group_translate_ranks(mine, 1, &rank, world, &out);
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    return out;
  }

  MPI_Comm comm_;
  Wire w_;
  int64_t pieces_;
  double timeout_;
  int p_ = 1, r_ = 0;
  int64_t c_ = 0, cp_ = 0;
};

ffi::Error MpiRingAllReduceImpl(AnyBuffer x, Result<AnyBuffer> values, Result<AnyBuffer> scales,
                                int64_t comm_f, int64_t pieces, int64_t block_size,
                                double timeout_s) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    return ffi::Error::InvalidArgument("jaxring MPI streaming ring: MPI is not initialized");
  }
  if (x.element_type() != DataType::F32) {
    return ffi::Error::InvalidArgument("jaxring MPI streaming ring: the input must be f32");
  }
  const DataType wt = values->element_type();
  if (wt != DataType::F32 && wt != DataType::BF16 && wt != DataType::F16 && wt != DataType::S8) {
    return ffi::Error::InvalidArgument(
        "jaxring MPI streaming ring: the wire must be f32, bf16, f16 or int8");
  }
  Wire w{wt, wt == DataType::S8 ? block_size : 1};
  MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(comm_f));
  Ring ring(comm, w, static_cast<int64_t>(x.element_count()), pieces, timeout_s);
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t unit = static_cast<int64_t>(ring.p()) * pieces * w.block_size;
  if (pieces < 1 || w.block_size < 1 || n % unit != 0 ||
      static_cast<int64_t>(values->element_count()) != n ||
      (w.int8() && static_cast<int64_t>(scales->element_count()) != n / w.block_size)) {
    return ffi::Error::InvalidArgument(
        "jaxring MPI streaming ring: " + std::to_string(n) + " values do not split into " +
        std::to_string(ring.p()) + " members x " + std::to_string(pieces) +
        " pieces of whole blocks of " + std::to_string(w.block_size) +
        ", or the outputs do not match");
  }
  return ring.Run(static_cast<const float*>(x.untyped_data()), values->untyped_data(),
                  w.int8() ? static_cast<float*>(scales->untyped_data()) : nullptr);
}

}  // namespace
}  // namespace jaxring

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringMpiRingAllReduce, jaxring::MpiRingAllReduceImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // x (f32 accumulator)
                                  .Ret<xla::ffi::AnyBuffer>()  // gathered values
                                  .Ret<xla::ffi::AnyBuffer>()  // gathered int8 scales
                                  .Attr<int64_t>("comm")       // Fortran handle (MPI_Comm_c2f)
                                  .Attr<int64_t>("pieces")
                                  .Attr<int64_t>("block_size")
                                  .Attr<double>("timeout_s"));

NB_MODULE(_mpi_ext, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jaxring_mpi_ring_all_reduce"] =
        nb::capsule(reinterpret_cast<void*>(JaxringMpiRingAllReduce));
    return targets;
  });
  m.def("mpi_library_version", []() {
    char buf[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(buf, &len);
    return std::string(buf, len);
  });
}
