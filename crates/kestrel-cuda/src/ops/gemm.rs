//! The tile geometry of `kernels/gemm.cu`, the tensor-core products that `linear.rs`
//! (quantised projections of many tokens) and `moe.rs` (grouped expert GEMMs and `moe_sort`)
//! launch, and how many pieces a thread of its `dequant_*` takes. These numbers are written here only: the module is compiled with them as `-D`
//! definitions, and `gemm.cu` checks its shared-memory layouts against the sizes computed here.

use kestrel_cuda_rt::ModuleSource;

use super::common::op_module;

/// Rows (tokens) of a tile.
pub(crate) const GT_ROWS: usize = 128;
/// Output columns of a tile's B matrix.
pub(crate) const GT_COLS: usize = 64;
/// The K step: values of a row each step loads.
pub(crate) const GT_K: usize = 64;
/// Threads of a tile block (eight warps; two warpgroups on `wgmma`).
pub(crate) const GT_THREADS: u32 = 256;
/// Shared row of a staged operand in bf16 values: 16 bytes of padding against bank conflicts.
const GT_STRIDE: usize = GT_K + 8;
/// The most experts `moe_sort` handles: one thread each, one block.
pub(crate) const SORT_MAX_EXPERTS: usize = 1024;
/// Pieces of eight values a thread of `dequant_*` takes.
pub(crate) const DQ_PIECES: usize = 4;

/// Shared memory of an `mma.sync` tile with `nb` B matrices (`MmaTile::SMEM`): two steps of A
/// and B in padded rows.
pub(crate) const fn mma_smem(nb: usize) -> usize {
    2 * (GT_ROWS + nb * GT_COLS) * GT_STRIDE * 2
}

/// Shared memory of a `wgmma` tile (`WgTile::SMEM`): two steps of 128 x 64 A and B tiles, plus
/// room to align them to 1,024 bytes.
pub(crate) const WG_SMEM: usize = 2 * 2 * GT_ROWS * GT_K * 2 + 1024;

pub(crate) const MODULE: ModuleSource = op_module(
    "gemm",
    include_str!("../../kernels/gemm.cu"),
    &[
        ("GT_ROWS", GT_ROWS as i64),
        ("GT_COLS", GT_COLS as i64),
        ("GT_K", GT_K as i64),
        ("GT_THREADS", GT_THREADS as i64),
        ("SORT_THREADS", SORT_MAX_EXPERTS as i64),
        ("GT_MMA_SMEM_1", mma_smem(1) as i64),
        ("GT_MMA_SMEM_2", mma_smem(2) as i64),
        ("GT_WG_SMEM", WG_SMEM as i64),
        ("DQ_PIECES", DQ_PIECES as i64),
    ],
);
