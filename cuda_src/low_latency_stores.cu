// The low-latency kernels with their put path as NVLink stores (rdma.cuh), for EPJIT_RDMA_BY_STORES with forced
// puts: the same source as low_latency.cu, built without NVSHMEM (the put path's staging and ordering checked with
// no NVSHMEM to start).
#define EPJIT_RDMA_BY_STORES
#include "low_latency.cu"
