// SPDX-License-Identifier: GPL-2.0 OR MIT

//! What a node feels, for `make bench`: the HCA's translation entries for
//! each registration (`bench-tpt`), and registration cost and kernel memory
//! with up to a million live registrations (`bench-scale`). Same output as
//! `bench` (`BENCH {...}` lines).

use std::time::Instant;

use crate::bench::{emit, errno, kernel_mem, median};
use crate::dev::{Alloc, Core, Gpu};
use crate::pgsz::{best_pgsz, num_dma_blocks, Sge, MLX5_MTT_PGSZ};
use crate::uapi::PMC_REG_INVAL_SUPP;

const K64: u64 = 64 << 10;
const M2: u64 = 2 << 20;
const MODES: [(&str, u64); 2] = [("invalidating", PMC_REG_INVAL_SUPP), ("persistent", 0)];
const SIZES: [(u64, &str); 4] = [(K64, "64K"), (M2, "2M"), (64 << 20, "64M"), (1 << 30, "1G")];
/// The unaligned start: 68 KiB past a 2 MiB boundary (a sub-buffer of a
/// cudaMalloc range, host-page aligned, in the allocation's second GPU page).
const UNALIGNED: u64 = K64 + 4096;

/// A "cudaMalloc" of `size` bytes whose VA is 2 MiB-aligned and no more
/// (2 MiB past a 4 MiB boundary): the alignment the CUDA VA allocator
/// promises for such ranges, without luck from a larger one.
fn alloc_2m_aligned(g: &Gpu, size: u64) -> Result<Alloc, String> {
    let span = size + 8 * M2;
    // SAFETY: an anonymous reservation, unmapped at once; only its address is used.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err("reserve VA".into());
    }
    // SAFETY: the reservation just made.
    unsafe { libc::munmap(p, span as usize) };
    let at = (p as u64).div_ceil(4 * M2) * 4 * M2 + M2;
    g.alloc_at(0, size, Some(at)).map_err(errno)
}

/// Page size and translation entries mlx5 would use for MR `h`, from the
/// scatterlist the core holds, with the MR's address as the IOVA (ibv_reg_mr).
fn translation(c: &Core, h: u64) -> Result<(u64, u64, u64), String> {
    let (sgl, addr, len) = c.sgl(h).map_err(errno)?;
    let sgl: Vec<Sge> = sgl
        .iter()
        .map(|s| Sge {
            dma: s.dma,
            len: s.len,
        })
        .collect();
    let pgsz = best_pgsz(&sgl, addr, len, MLX5_MTT_PGSZ, addr, crate::page_size());
    Ok((pgsz, num_dma_blocks(addr, len, pgsz), sgl.len() as u64))
}

/// `bench-tpt <impl>`: per mode, size and alignment, the page size, the
/// translation entries and the SG entries of one registration.
pub fn run_tpt(imp: &str) -> Result<(), String> {
    let g = Gpu::open()?;
    let c = Core::open()?;
    let a = alloc_2m_aligned(&g, (1 << 30) + M2)?;
    for (mode, f) in MODES {
        for (size, sname) in SIZES {
            for (align, off) in [("2M-aligned", 0), ("unaligned", UNALIGNED)] {
                let h = c.reg(a.va + off, size, f).map_err(errno)?;
                let r = translation(&c, h);
                c.dereg(h).map_err(errno)?;
                let (pgsz, entries, sges) = r?;
                let key = format!("{mode}/{sname}/{align}");
                emit(imp, "zero", "tpt_page_size", &key, pgsz as f64);
                emit(imp, "zero", "tpt_entries", &key, entries as f64);
                emit(imp, "zero", "tpt_sg_entries", &key, sges as f64);
            }
        }
    }
    Ok(())
}

/// Registers `n` more 64 KiB MRs at `va` into `hs`.
fn hold(c: &Core, va: u64, f: u64, n: u64, hs: &mut Vec<u64>) -> Result<(), String> {
    for _ in 0..n {
        hs.push(
            c.reg(va, K64, f)
                .map_err(|e| format!("{} live: {}", hs.len(), errno(e)))?,
        );
    }
    Ok(())
}

/// Median register and deregister times (µs) of one more 64 KiB MR.
fn timed_ops(c: &Core, va: u64, f: u64) -> Result<(f64, f64), String> {
    let (mut reg, mut dereg) = (Vec::new(), Vec::new());
    for i in 0..220 {
        let t = Instant::now();
        let h = c.reg(va, K64, f).map_err(errno)?;
        let r = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        c.dereg(h).map_err(errno)?;
        // The first 20 untimed: code and caches warm.
        if i >= 20 {
            reg.push(r);
            dereg.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok((median(&mut reg), median(&mut dereg)))
}

/// One mode of `bench-scale`: the live count grows through `counts`.
fn scale_mode(
    imp: &str,
    c: &Core,
    g: &Gpu,
    a: &Alloc,
    mode: (&str, u64),
    counts: &[u64],
) -> Result<(), String> {
    let (name, f) = mode;
    let mut hs = Vec::with_capacity(counts.iter().copied().max().unwrap_or(0) as usize);
    // Warm the caches once with the smallest hold, unmeasured (see bench.rs).
    hold(c, a.va, f, counts.first().copied().unwrap_or(0), &mut hs)?;
    hs.drain(..).try_for_each(|h| c.dereg(h)).map_err(errno)?;
    let (m0, p0) = (kernel_mem(), g.info().provider_bytes as i64);
    let mut res = Ok(());
    for &n in counts {
        let t = Instant::now();
        res = hold(c, a.va, f, n.saturating_sub(hs.len() as u64), &mut hs);
        if res.is_err() {
            break;
        }
        let fill_s = t.elapsed().as_secs_f64();
        let (m1, p1) = (kernel_mem(), g.info().provider_bytes as i64);
        let per = |v: i64| v as f64 / n as f64;
        let key = format!("{name}/{n}");
        emit(
            imp,
            "zero",
            "scale_kernel_bytes_per_mr_total",
            &key,
            per(m1.pages - m0.pages),
        );
        emit(
            imp,
            "zero",
            "scale_provider_bytes_per_mr",
            &key,
            per(p1 - p0),
        );
        emit(
            imp,
            "zero",
            "scale_kernel_bytes_per_mr_without_provider",
            &key,
            per(m1.pages - m0.pages - (p1 - p0)),
        );
        emit(imp, "zero", "scale_fill_s", &key, fill_s);
        let (r, d) = timed_ops(c, a.va + K64, f)?;
        emit(imp, "zero", "scale_register_us", &key, r);
        emit(imp, "zero", "scale_deregister_us", &key, d);
    }
    let t = Instant::now();
    let n = hs.len();
    hs.drain(..).try_for_each(|h| c.dereg(h)).map_err(errno)?;
    emit(
        imp,
        "zero",
        "scale_teardown_s",
        &format!("{name}/{n}"),
        t.elapsed().as_secs_f64(),
    );
    res
}

/// `bench-scale <impl> <counts>`: per mode, register and deregister time and
/// kernel memory per registration with `counts` (ascending) 64 KiB MRs live,
/// all on one GPU page (the driver pins a range as often as it is asked,
/// each pin with its own page table; pins of one page share its BAR1
/// mapping); the timed ones on the next page.
pub fn run_scale(imp: &str, counts: &[u64]) -> Result<(), String> {
    let g = Gpu::open()?;
    let c = Core::open()?;
    let a = g.alloc(0, 2 * K64).map_err(errno)?;
    for mode in MODES {
        scale_mode(imp, &c, &g, &a, mode, counts)?;
    }
    Ok(())
}
