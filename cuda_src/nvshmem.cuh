// The only way into NVSHMEM's device API. NVSHMEM_ENABLE_ALL_DEVICE_INLINING must come first: without it the
// device library's transfer-dispatch symbols are referenced with NVRTC's `unsigned long long` uint64_t while
// libnvshmem_device.a was built with `unsigned long`, and nvJitLink leaves one unresolved.
#pragma once

#define NVSHMEM_ENABLE_ALL_DEVICE_INLINING
#include <nvshmem.h>
#include <nvshmemx.h>
