// The internode kernels with the RDMA leg as NVLink stores (rdma.cuh), for a group of virtual nodes on one host
// whose symmetric region is CUDA IPC memory: the same source as internode.cu, built without NVSHMEM.
#define EPJIT_RDMA_BY_STORES
#include "internode.cu"
