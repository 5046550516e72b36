// A user mask modifier (cuflash.MaskMod) evaluated over the attention kernel's own tiles, once per shape: each
// tile's state, 0 (every element hidden: never visited), 1 (some hidden: its elements are tested) or 2 (none
// hidden: untested), from which cuflash/block_sparse.py builds the tile lists (ProgParams). One CTA per tile and
// (batch, head); its warps take rows, lanes columns.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/programmable.cuh"

template <int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32)
mask_tiles_kernel(const MaskTilesParams t, const ProgParams pp) {
    using Mods = typename Variant::Mods;
    static_assert(Mods::kMaskMod, "mask_tiles_kernel evaluates a mask modifier");
    const int n_tile = blockIdx.x, m_tile = blockIdx.y;
    const int batch = blockIdx.z / t.heads, head = blockIdx.z % t.heads;
    const int row0 = m_tile * kBlockM, col0 = n_tile * kBlockN;
    const int rows = min(kBlockM, t.seqlen_q - row0), cols = min(kBlockN, t.seqlen_k - col0);
    const Mods mods(pp);
    bool any = false, all = true;
    for (int r = threadIdx.x >> 5; r < rows; r += kNWarps) {
        for (int c = threadIdx.x & 31; c < cols; c += 32) {
            const bool visible = mods.mask_mod(batch, head, row0 + r, col0 + c);
            any |= visible;
            all &= visible;
        }
    }
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    if (threadIdx.x == 0) t.state[(static_cast<i64>(blockIdx.z) * t.m_tiles + m_tile) * t.n_tiles + n_tile] =
        any ? (all ? 2 : 1) : 0;
}
