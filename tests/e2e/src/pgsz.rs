// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The page size an HCA driver picks for an MR's translation table, and the
//! number of translation entries that follows, from the DMA scatterlist the
//! core received: Linux's `ib_umem_find_best_pgsz()` and
//! `ib_umem_num_dma_blocks()` (drivers/infiniband/core/umem.c,
//! include/rdma/ib_umem.h), with the page sizes mlx5 passes to it.
//!
//! mlx5 (`mlx5_umem_mkc_find_best_pgsz()`, mlx5_ib.h, 7.x) passes
//! GENMASK(max, min) with min = max(log_min_mkey_entity_size, 12) and max =
//! the device's max_mkey_log_entity_size_mtt, 31 when the device reports none
//! (or more than 31 without umr_log_entity_size_5); kernels 5.11 to 6.x passed
//! every size the mkey's 6-bit log_page_size field can hold from 4 KiB
//! (`mlx5_umem_find_best_pgsz(umem, mkc, log_page_size, 0, iova)`: GENMASK(63,
//! 12)). The two choose the same page size for any MR of at most 2 GiB.

/// One DMA segment as the core holds it (after its first/last fix-up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    pub dma: u64,
    pub len: u64,
}

/// mlx5's page sizes for an MTT mkey with the device's default caps: 4 KiB to 2 GiB.
pub const MLX5_MTT_PGSZ: u64 = genmask(31, 12);

/// GENMASK(h, l): bits l..=h set.
pub const fn genmask(h: u32, l: u32) -> u64 {
    (u64::MAX >> (63 - h)) & (u64::MAX << l)
}

/// The kernel's `bits_per(n)`: bits needed to hold n, at least 1.
fn bits_per(n: u64) -> u32 {
    (64 - n.leading_zeros()).max(1)
}

/// `ib_umem_find_best_pgsz(umem, pgsz_bitmap, virt)` for a non-ODP umem of
/// `length` bytes at user address `address` whose DMA scatterlist is `sgl`;
/// `host_page` is the CPU's PAGE_SIZE. 0: no supported size fits.
pub fn best_pgsz(
    sgl: &[Sge],
    address: u64,
    length: u64,
    pgsz_bitmap: u64,
    virt: u64,
    host_page: u64,
) -> u64 {
    let Some(last_va) = length.wrapping_sub(1).checked_add(virt) else {
        return 0;
    };
    let bits = bits_per(virt ^ last_va);
    let mut mask = if bits < 64 {
        pgsz_bitmap & genmask(63, bits)
    } else {
        0
    };
    let (mut curr_base, mut curr_len) = (u64::MAX, 0u64);
    let mut pgoff = address & (host_page - 1);
    let mut va = virt;
    for (i, sg) in sgl.iter().enumerate() {
        // A segment that does not continue the previous one starts a page.
        if curr_base.checked_add(curr_len) != Some(sg.dma) {
            curr_base = sg.dma;
            curr_len = 0;
            mask |= curr_base.wrapping_add(pgoff) ^ va;
            if i != 0 {
                mask |= va;
            }
        }
        curr_len = curr_len.wrapping_add(sg.len);
        va = va.wrapping_add(sg.len).wrapping_sub(pgoff);
        pgoff = 0;
    }
    let mut bitmap = pgsz_bitmap;
    if mask != 0 {
        bitmap &= genmask(mask.trailing_zeros(), 0);
    }
    if bitmap == 0 {
        0
    } else {
        1u64 << (63 - bitmap.leading_zeros())
    }
}

/// `ib_umem_num_dma_blocks()`: translation entries of an MR at `iova` of
/// `length` bytes with pages of `pgsz` bytes.
pub fn num_dma_blocks(iova: u64, length: u64, pgsz: u64) -> u64 {
    if pgsz == 0 {
        return 0;
    }
    let end = (iova + length).div_ceil(pgsz) * pgsz;
    (end - iova / pgsz * pgsz) / pgsz
}

#[cfg(test)]
mod tests {
    use super::*;

    const K4: u64 = 4 << 10;
    const K64: u64 = 64 << 10;
    const M2: u64 = 2 << 20;
    const G1: u64 = 1 << 30;

    fn pages(va: u64, dmas: &[u64], len: u64) -> Vec<Sge> {
        // One 64 KiB segment per GPU page, trimmed by the core's fix-up.
        let mut v: Vec<Sge> = dmas.iter().map(|&dma| Sge { dma, len: K64 }).collect();
        let head = va % K64 / K4 * K4;
        v[0].dma += head;
        v[0].len -= head;
        let total = (va + len).div_ceil(K4) * K4 - va / K4 * K4;
        let extra: u64 = v.iter().map(|s| s.len).sum::<u64>() - total;
        v.last_mut().unwrap().len -= extra;
        v
    }

    fn entries(sgl: &[Sge], va: u64, len: u64) -> (u64, u64) {
        let p = best_pgsz(sgl, va, len, MLX5_MTT_PGSZ, va, K4);
        (p, num_dma_blocks(va, len, p))
    }

    #[test]
    fn one_contiguous_segment_follows_the_va_alignment() {
        let va = 0x7f00_0020_0000; // 2 MiB-aligned, not 1 GiB-aligned
        let sgl = [Sge {
            dma: 0x1_0000_0000,
            len: G1,
        }];
        assert_eq!(entries(&sgl, va, G1), (M2, 512));
        // VA and DMA agree up to 1 GiB: one entry.
        let sgl = [Sge {
            dma: 0x1_4000_0000,
            len: G1,
        }];
        assert_eq!(entries(&sgl, 0x7f00_4000_0000, G1), (G1, 1));
    }

    #[test]
    fn scattered_pages_force_the_gpu_page_size() {
        let va = 0x7f00_0020_0000;
        let n = 32;
        let dmas: Vec<u64> = (0..n).map(|i| 0x10_0000_0000 + (n - i) * 3 * K64).collect();
        let sgl = pages(va, &dmas, n * K64);
        assert_eq!(entries(&sgl, va, n * K64), (K64, n));
    }

    #[test]
    fn adjacent_pages_merge_like_one_segment() {
        let va = 0x7f00_0020_0000;
        let dmas: Vec<u64> = (0..32).map(|i| 0x8000_0000 + i * K64).collect();
        assert_eq!(entries(&pages(va, &dmas, M2), va, M2), (M2, 1));
    }

    #[test]
    fn an_offset_va_limits_the_page_to_the_va_dma_difference() {
        // 2 MiB-aligned + 68 KiB, mapped from the 64 KiB page that holds it.
        let va = 0x7f00_0020_0000 + K64 + K4;
        let sgl = pages(va, &[0x2_0000_0000], K4);
        assert_eq!(entries(&sgl, va, K4), (K4, 1));
        let sgl = pages(va, &[0x2_0001_0000], K4);
        assert_eq!(entries(&sgl, va, K4), (K4, 1));
        // A VA that agrees with its DMA address mod 2 MiB gets 2 MiB pages.
        let len = 16 * M2;
        let sgl = [Sge {
            dma: 0x2_0001_1000,
            len,
        }];
        assert_eq!(entries(&sgl, va, len), (M2, 17));
    }

    #[test]
    fn blocks_count_partial_pages_at_both_ends() {
        assert_eq!(num_dma_blocks(M2, M2, M2), 1);
        assert_eq!(num_dma_blocks(M2 + K64, M2, M2), 2);
        assert_eq!(num_dma_blocks(M2 + K64, M2, K64), 32);
        assert_eq!(num_dma_blocks(M2 + K64 + K4, M2, K64), 33);
        assert_eq!(num_dma_blocks(0, 1, 0), 0);
    }

    #[test]
    fn the_older_mlx5_bitmap_agrees_up_to_2_gib() {
        let va = 0x7f00_4000_0000;
        let sgl = [Sge {
            dma: 0x1_4000_0000,
            len: G1,
        }];
        let new = best_pgsz(&sgl, va, G1, MLX5_MTT_PGSZ, va, K4);
        assert_eq!(best_pgsz(&sgl, va, G1, genmask(63, 12), va, K4), new);
        // Beyond 2 GiB they part: the newer caps stop at 2 GiB pages.
        let sgl = [Sge {
            dma: 0x1_0000_0000,
            len: 4 * G1,
        }];
        let va = 0x7f01_0000_0000;
        assert_eq!(best_pgsz(&sgl, va, 4 * G1, MLX5_MTT_PGSZ, va, K4), 2 * G1);
        assert_eq!(best_pgsz(&sgl, va, 4 * G1, genmask(63, 12), va, K4), 4 * G1);
    }

    #[test]
    fn no_supported_size_is_zero() {
        let sgl = [Sge {
            dma: 0x1000,
            len: K4,
        }];
        assert_eq!(best_pgsz(&sgl, 0x2000, K4, genmask(31, 16), 0x2000, K4), 0);
        assert_eq!(best_pgsz(&sgl, 0, 0, MLX5_MTT_PGSZ, u64::MAX, K4), 0);
    }
}
