// Fixed-width integer types for NVRTC, which ships no C++ standard library headers: CCCL's <cuda/std/...>
// provides them in cuda::std; kernels use the familiar global names.
#pragma once

#include <cuda/std/cstddef>
#include <cuda/std/cstdint>

using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint16_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uint8_t;
