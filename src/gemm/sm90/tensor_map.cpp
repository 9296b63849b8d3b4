#include "gemm/sm90/tensor_map.hpp"

#include <string>

#include "poise/errors.hpp"
#include "runtime/driver_entry_point.hpp"

namespace poise::sm90 {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static const auto fn = reinterpret_cast<EncodeTiledFn>(runtime::driver_entry_point("cuTensorMapEncodeTiled"));
  if (!fn) throw DeviceError("cuTensorMapEncodeTiled is not available from the CUDA driver");
  return fn;
}

}  // namespace

namespace {

CUtensorMap encode(const void* base, CUtensorMapDataType type, int elem_bytes, int64_t rows, int64_t cols,
                   int box_cols, int box_rows, const char* argument_name) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0)
    throw InvalidArgument(argument_name, "must be 16-byte aligned (TMA)");
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * elem_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw DeviceError(std::string("cuTensorMapEncodeTiled failed for ") + argument_name + " (CUresult " +
                      std::to_string(static_cast<int>(r)) + ")");
  return map;
}

}  // namespace

CUtensorMap make_bf16_tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows,
                                 const char* argument_name) {
  return encode(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, rows, cols, 64, box_rows, argument_name);
}

CUtensorMap make_fp8_tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows,
                                const char* argument_name) {
  return encode(base, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, rows, cols / 2, 64, box_rows, argument_name);
}

CUtensorMap make_store_tensor_map(const void* base, bool fp32, int64_t rows, int64_t cols,
                                  const char* argument_name) {
  if (base == nullptr) return CUtensorMap{};
  return fp32 ? encode(base, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, rows, cols, 32, 64, argument_name)
              : encode(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, rows, cols, 64, 64, argument_name);
}

}  // namespace poise::sm90
