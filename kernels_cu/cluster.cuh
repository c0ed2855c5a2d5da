// Thread-block cluster handoffs (sm_90): the few PTX forms the cluster kernels share
// (router.cu router_cluster_*, hc.cu hc_boundary_pre_cluster).
//
// The pattern, and why each piece is where it is:
//   * before its PDL wait a CTA initialises its own mbarriers (one arrival each: the CTA's own
//     arrive.expect_tx of the bytes it will receive), makes the init visible cluster-wide
//     (fence.mbarrier_init.release.cluster) and arrives, relaxed, at the cluster barrier.  None of
//     it touches global memory, so it may precede griddepcontrol.wait;
//   * before its first remote store a CTA waits on that cluster barrier (long satisfied): every
//     CTA of the cluster has started (the CUDA guide's condition for touching another CTA's
//     shared memory) and its mbarriers are initialised;
//   * data moves by st.async into the receiver's shared memory, each store completing its bytes
//     on the receiver's mbarrier: no fence, no flag.  The receiver waits on the mbarrier phase
//     with cluster-scope acquire, so it sees the bytes; since it cannot pass that wait before
//     every byte addressed to it has landed, no CTA exits while a peer still writes into it.
//   * no barrier.cluster.arrive.release anywhere: it compiles to MEMBAR.ALL.GPU (nvdisasm),
//     which waits for the CTA's outstanding global stores.
#pragma once

#include "common.cuh"

namespace memra {

// mbarrier at *bar (this CTA): one arrival expected; then this thread's own arrival carrying
// `bytes` expected transaction bytes (the phase completes when they have all landed); then the
// init made visible to the cluster.  One thread per mbarrier, before the cluster arrive.
DEV void mbar_init_expect(u64* bar, u32 bytes) {
    const u32 a = smem_addr(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a) : "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
DEV void fence_mbarrier_init_cluster() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// the split cluster barrier: every thread of every CTA arrives once (relaxed) and waits once
DEV void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
DEV void cluster_started() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// the shared::cluster address of *local (this CTA's shared memory) in CTA `rank`
DEV u32 mapa_cluster(const void* local, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    return remote;
}

// st.async of 4 / 16 bytes to CTA `rank`'s copy of *local, completing them on its copy of *bar
DEV void st_async_cluster_f32(const float* local, const u64* bar, u32 rank, float v) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(mapa_cluster(local, rank)),
                 "r"(__float_as_uint(v)), "r"(mapa_cluster(bar, rank))
                 : "memory");
}
DEV void st_async_cluster_16(const void* local, const u64* bar, u32 rank, u64 lo, u64 hi) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b64 [%0], {%1, %2}, [%3];" ::"r"(
                     mapa_cluster(local, rank)),
                 "l"(lo), "l"(hi), "r"(mapa_cluster(bar, rank))
                 : "memory");
}

// until phase `parity` of this CTA's mbarrier *bar completes, with cluster-scope acquire (the
// bytes came from other CTAs).  A C++ loop, no PTX label: it may be inlined more than once.
DEV void mbar_wait_cluster(const u64* bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n\t.reg .pred P1;\n\t"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, P1;\n}"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    } while (!done);
}

}  // namespace memra
