// hisparse_cupy: the planned copy's measuring instance (hisparse_cupy.testing.probe.copy_probe).
//
// planned_copy_probe<SrcT, DstT, R>(PlannedCopyProbeParams): planned_copy's body (cu/plan.cu)
//   with the measuring settings compiled in: skipped entries are counted in *bad (when given),
//   dry_run does all the work but moves no bytes, spin_cycles > 0 delays each row by that many
//   clock cycles (a warp waits R times that before its R rows). A RawModule of its own, built
//   only when a probe is used: the production module holds no probe instance.
#include "plan.cu"

namespace hs {

template <typename SrcT, typename DstT, int R>
__global__ void __launch_bounds__(COPY_WARPS * 32)
    planned_copy_probe(const PlannedCopyProbeParams p) {
  planned_copy_body<SrcT, DstT, R, true>(p.copy,
                                         CopyProbe{p.bad, p.spin_cycles, p.dry_run != 0});
}

}  // namespace hs
