// Keeps the GPU busy for a wall-clock time. `python -m epjit.bench` enqueues it between the ranks' start-together
// barrier and the timed work, so the host launches the work while the GPU is still busy and the start event and
// the work run back to back. %globaltimer counts nanoseconds whatever the SM clock: a sleep counted in cycles
// (torch.cuda._sleep) lasts longer on a GPU that clocks lower, and the ranks would start apart.
#include "ptx.cuh"

namespace epjit {

// Not a wait on another agent, so not through timeout_while: it ends on its own after `ns`.
__global__ void spin_for_ns(uint64_t ns) {
    const uint64_t start = ptx::globaltimer_ns();
    while (ptx::globaltimer_ns() - start < ns) {
    }
}

}  // namespace epjit
