// The PTX epjit's kernels use, one named one-liner per instruction. Names follow the PTX qualifiers in order
// (`ld.acquire.sys.global.s32` -> ld_acquire_sys_s32). No other file in cuda_src/ may contain `asm`: a test
// checks it, so every memory-ordering decision is spelt in one vocabulary and can be read in one place.
//
// Scopes: `.sys` orders against other GPUs reading/writing our memory over NVLink (and the host); `.gpu` only
// against other SMs of this GPU. Release/acquire pair across GPUs: a `st_release_sys` or `red_add_release_sys`
// by the writer makes every earlier write of that thread visible to a reader whose `ld_acquire_sys` observes it.
#pragma once

#include "types.cuh"

namespace epjit::ptx {

/// Acquire / relaxed loads
__device__ __forceinline__ int ld_acquire_sys_s32(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_acquire_gpu_s32(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_acquire_gpu_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_volatile_s32(const int* p) {
    int v;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_relaxed_sys_s32(const int* p) {
    int v;
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/// Release stores
__device__ __forceinline__ void st_release_sys_s32(int* p, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_gpu_s32(int* p, int v) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys_s32(int* p, int v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

/// Streaming 16-byte loads and stores that leave L1 alone: bulk payload is touched once, and keeping it out of
/// L1 leaves the cache to the compute kernels running beside communication (DeepEP's measured choice).
/// `.nc` (non-coherent, read-only path) is only legal on data no one writes during the kernel.
__device__ __forceinline__ int4 ld_global_nc_L1_no_allocate_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ int4 ld_volatile_global_v4(const int4* p) {
    int4 v;
    asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
// 8 bytes of a ring slot a peer wrote (the FP8 combine's rows: 8 e4m3 channels a lane).
__device__ __forceinline__ uint2 ld_volatile_global_v2(const uint2* p) {
    uint2 v;
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ void st_global_L1_no_allocate_v4(int4* p, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
                 : : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
// Flagged words (low latency's small calls): a reader polls them, so they must not linger in a cache; each
// 8-byte half of the 16 bytes lands whole.
__device__ __forceinline__ void st_volatile_global_v4(int4* p, const int4& v) {
    asm volatile("st.volatile.global.v4.s32 [%0], {%1, %2, %3, %4};"
                 : : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

/// Fences
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void fence_sc_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }

/// Atomics and reductions (system scope: peers on other GPUs update the same word over NVLink)
__device__ __forceinline__ void red_add_release_sys_s32(int* p, int v) {
    asm volatile("red.release.sys.global.add.s32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add_relaxed_sys_s32(int* p, int v) {
    asm volatile("red.relaxed.sys.global.add.s32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add_release_gpu_s32(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add_release_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int atom_add_acq_rel_sys_s32(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.sys.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ int atom_add_acq_rel_gpu_s32(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ int atom_cas_acq_rel_sys_s32(int* p, int expected, int desired) {
    int old;
    asm volatile("atom.acq_rel.sys.global.cas.b32 %0, [%1], %2, %3;"
                 : "=r"(old) : "l"(p), "r"(expected), "r"(desired) : "memory");
    return old;
}

/// Barriers
// Named barrier `id` (1..15; 0 is __syncthreads) over `num_threads` threads (a multiple of 32): lets the warps
// that serve one peer rank synchronise without stopping the rest of the block.
__device__ __forceinline__ void bar_sync(int id, int num_threads) {
    asm volatile("bar.sync %0, %1;" : : "r"(id), "r"(num_threads) : "memory");
}

/// Bulk asynchronous copies (TMA) and their shared-memory barriers
// A bulk load (global -> shared) completes on an mbarrier: the issuing thread declares the bytes it expects
// (arrive.expect_tx), the copy engine counts them down, and a wait on the barrier's phase parity returns when they
// have all landed. A bulk store (shared -> global) joins the thread's current bulk group; wait_group.read<N>
// returns once at most N groups still read their shared source (the buffer may then be refilled), wait_group<N>
// once their writes are done. Addresses in shared memory are 32-bit shared-window offsets (smem_addr).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init_shared_cta_b64(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" : : "r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes initialised mbarriers visible to the copy engine (the async proxy) before any bulk copy names them.
__device__ __forceinline__ void fence_mbarrier_init_release_cluster() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx_shared_cta_b64(uint64_t* bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" : : "r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait_parity_shared_cta_b64(uint64_t* bar, int parity) {
    uint32_t done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.b32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}
__device__ __forceinline__ void cp_async_bulk_shared_global_mbarrier(void* smem_dst, const void* src, int bytes,
                                                                     uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 : : "r"(smem_addr(smem_dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void cp_async_bulk_global_shared_bulk_group(void* dst, const void* smem_src, int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 : : "l"(dst), "r"(smem_addr(smem_src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_bulk_commit_group() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" : : "n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;" : : "n"(N) : "memory");
}

/// Conversions
// Two floats to two e4m3 bytes, round to nearest even, saturating to +-448 (`satfinite`): `hi` lands in the upper
// byte. sm_89 and later.
__device__ __forceinline__ uint16_t cvt_rn_satfinite_e4m3x2_f32(float hi, float lo) {
    uint16_t v;
    asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(v) : "f"(hi), "f"(lo));
    return v;
}

// Two e4m3 bytes to two halves, exactly (every e4m3 value is a half): the upper byte lands in the upper half.
// sm_89 and later.
__device__ __forceinline__ uint32_t cvt_rn_f16x2_e4m3x2(uint16_t v) {
    uint32_t h;
    asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
    return h;
}
// Two floats to two bf16, round to nearest even (subnormals kept, overflow to inf): `hi` lands in the upper half.
// A NaN comes out as the hardware's NaN, not NumPy's 0x7fc0 (pack_bf16x8_rn in bf16.cuh handles that).
__device__ __forceinline__ uint32_t cvt_rn_bf16x2_f32(float hi, float lo) {
    uint32_t v;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
    return v;
}
// A half (its bits) to a float, exactly.
__device__ __forceinline__ float cvt_f32_f16(uint16_t v) {
    float f;
    asm volatile("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}

/// Approximate math: the hardware's fast base-2 logarithm and exponential, as DeepEP's LogFMT uses them
/// (low_latency.cu; relative error about 2^-22; lg2 of 0 is -inf, subnormal inputs are handled), and its reciprocal.
__device__ __forceinline__ float lg2_approx_f32(float x) {
    float v;
    asm("lg2.approx.f32 %0, %1;" : "=f"(v) : "f"(x));
    return v;
}
__device__ __forceinline__ float ex2_approx_f32(float x) {
    float v;
    asm("ex2.approx.f32 %0, %1;" : "=f"(v) : "f"(x));
    return v;
}
// 1 / x within 1 ulp (the FP8 scales' exact reciprocal starts from it: fp8.cuh bf16_block_scale); normal x only
// (ftz: a subnormal input or result is flushed).
__device__ __forceinline__ float rcp_approx_ftz_f32(float x) {
    float v;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(v) : "f"(x));
    return v;
}

/// Programmatic dependent launch (sm_90)
// A kernel launched with programmatic stream serialization (epjit/jit/module.py: launch(programmatic=True)) may
// start while the kernel before it on the stream still runs, once that one's blocks have all triggered or ended;
// griddepcontrol.wait returns when that kernel has finished and its writes are visible. In a kernel launched the
// plain way both are no-ops (the stream already ordered it after its predecessor).
__device__ __forceinline__ void griddepcontrol_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" : : : "memory");
}
__device__ __forceinline__ void griddepcontrol_wait() { asm volatile("griddepcontrol.wait;" : : : "memory"); }

/// Placement
// The SM this thread runs on (channel claims: which blocks share a TPC; profiles: which share a TPC or GPC).
__device__ __forceinline__ uint32_t smid() {
    uint32_t id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

/// Timers
// %globaltimer counts nanoseconds (in coarse ticks) and is the same clock on every SM, so a
// timeout measured with it does not depend on the SM clock or on which SM a block landed on.
__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/// Traps
__device__ __forceinline__ void trap() { asm volatile("trap;"); }

}  // namespace epjit::ptx
