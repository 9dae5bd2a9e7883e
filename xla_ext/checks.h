// Operand checks shared by the CPU and CUDA handlers. Every kernel takes flat buffers, optionally
// with leading batch dimensions (what vmap_method="broadcast_all" produces); each check returns an
// ffi::Error naming the target and the argument, and fills a plan of the loop bounds.
#ifndef JAXRING_XLA_EXT_CHECKS_H_
#define JAXRING_XLA_EXT_CHECKS_H_

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jaxring {

namespace ffi = xla::ffi;
using Dims = ffi::AnyBuffer::Dimensions;

template <typename... Args>
ffi::Error InvalidArgument(std::string_view op, const Args&... parts) {
  std::ostringstream os;
  os << op << ": ";
  (os << ... << parts);
  return ffi::Error::InvalidArgument(os.str());
}

inline const char* DTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::PRED: return "bool";
    default: return "an unsupported dtype";
  }
}

inline std::string DimsString(Dims d) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < d.size(); ++i) os << (i ? ", " : "") << d[i];
  os << (d.size() == 1 ? ",)" : ")");
  return os.str();
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A buffer seen as `rows` independent flat rows of `cols` elements.
struct RowLayout {
  int64_t rows = 0;
  int64_t cols = 0;
};

inline ffi::Error CheckDType(std::string_view op, std::string_view arg, ffi::DataType got,
                             std::initializer_list<ffi::DataType> allowed) {
  for (ffi::DataType t : allowed)
    if (t == got) return ffi::Error::Success();
  std::string names;
  for (ffi::DataType t : allowed) names += std::string(names.empty() ? "" : " or ") + DTypeName(t);
  return InvalidArgument(op, arg, " must be ", names, ", got ", DTypeName(got));
}

inline ffi::Error CheckRows(std::string_view op, std::string_view arg, Dims dims, RowLayout* out) {
  if (dims.size() == 0)
    return InvalidArgument(op, arg, " must have rank >= 1 (a flat buffer with optional leading "
                           "batch dimensions), got a scalar");
  out->rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) out->rows *= dims[i];
  out->cols = dims.back();
  return ffi::Error::Success();
}

// `dims` must be lead(ref) + [cols], or exactly lead(ref) when cols < 0.
inline ffi::Error CheckShapeLike(std::string_view op, std::string_view arg, Dims dims,
                                 std::string_view ref_arg, Dims ref, int64_t cols) {
  const size_t lead = ref.size() - 1;
  const size_t want_rank = cols < 0 ? lead : lead + 1;
  bool ok = dims.size() == want_rank;
  for (size_t i = 0; ok && i < lead; ++i) ok = dims[i] == ref[i];
  if (ok && cols >= 0) ok = dims.back() == cols;
  if (ok) return ffi::Error::Success();
  std::ostringstream want;
  want << "(";
  for (size_t i = 0; i < lead; ++i) want << ref[i] << ", ";
  if (cols >= 0) want << cols;
  want << ")";
  return InvalidArgument(op, arg, " has shape ", DimsString(dims), " but ", ref_arg, " has shape ",
                         DimsString(ref), ", so it must have shape ", want.str());
}

#define JR_RETURN_IF_ERROR(expr)                 \
  do {                                           \
    ::xla::ffi::Error jr_err_ = (expr);          \
    if (jr_err_.failure()) return jr_err_;       \
  } while (0)

inline ffi::Error CheckPositive(std::string_view op, std::string_view attr, int64_t v) {
  if (v > 0) return ffi::Error::Success();
  return InvalidArgument(op, attr, " must be a positive integer, got ", v);
}

constexpr std::initializer_list<ffi::DataType> kFloatTypes = {
    ffi::DataType::F32, ffi::DataType::BF16, ffi::DataType::F16};

// Block-quantized operands: codes q (int8, rows x n) and scales (f32, rows x ceil(n/bs)).
struct BlockPlan {
  RowLayout layout;   // rows x n
  int64_t block = 0;  // block size
  int64_t blocks = 0; // blocks per row
};

inline ffi::Error PlanBlocks(std::string_view op, const char* data_arg, const ffi::AnyBuffer& data,
                             std::initializer_list<ffi::DataType> data_types,
                             int64_t block_size, BlockPlan* plan) {
  JR_RETURN_IF_ERROR(CheckPositive(op, "block_size", block_size));
  JR_RETURN_IF_ERROR(CheckDType(op, data_arg, data.element_type(), data_types));
  JR_RETURN_IF_ERROR(CheckRows(op, data_arg, data.dimensions(), &plan->layout));
  plan->block = block_size;
  plan->blocks = CeilDiv(plan->layout.cols, block_size);
  return ffi::Error::Success();
}

// `buf` must have dtype `type` and shape lead(ref) + [cols].
inline ffi::Error CheckOperand(std::string_view op, std::string_view arg, const ffi::AnyBuffer& buf,
                               ffi::DataType type, std::string_view ref_arg,
                               const ffi::AnyBuffer& ref, int64_t cols) {
  JR_RETURN_IF_ERROR(CheckDType(op, arg, buf.element_type(), {type}));
  return CheckShapeLike(op, arg, buf.dimensions(), ref_arg, ref.dimensions(), cols);
}

}  // namespace jaxring

#endif  // JAXRING_XLA_EXT_CHECKS_H_
