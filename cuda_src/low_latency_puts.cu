// The low-latency kernels with NVSHMEM puts, for a peer without an NVLink pointer or EPJIT_LL_FORCE_PUTS: the
// same source as low_latency.cu, built with -rdc and linked with NVSHMEM's device library.
#define EPJIT_LL_PUTS
#include "low_latency.cu"
