// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The scenarios. Each returns a short detail string on success.

use std::time::{Duration, Instant};

use crate::{
    dev::{Alloc, Core, Gpu},
    hostile, module,
    uapi::*,
    Ctx, Mode,
};

const K64: u64 = 64 << 10;
const M: u64 = 1 << 20;

macro_rules! ensure {
    ($c:expr, $($fmt:tt)*) => {
        if !$c {
            return Err(format!($($fmt)*));
        }
    };
}

/// One scenario.
pub struct Scenario {
    pub name: &'static str,
    pub applies: fn(&Ctx) -> bool,
    pub run: fn(&mut Ctx) -> Result<String, String>,
}

fn always(_: &Ctx) -> bool {
    true
}
fn ours(c: &Ctx) -> bool {
    !c.opts.reference
}
fn invalidating(c: &Ctx) -> bool {
    c.mode.invalidating()
}
fn failslab(c: &Ctx) -> bool {
    ours(c) && std::path::Path::new("/sys/kernel/debug/failslab").exists()
}
fn ours_invalidating(c: &Ctx) -> bool {
    ours(c) && c.mode == Mode::Invalidating
}
/// Ours, in a boot that carries peermem-stat.
fn with_stat(c: &Ctx) -> bool {
    ours(c) && std::path::Path::new(crate::late::STAT).exists()
}
fn ours_invalidating_any(c: &Ctx) -> bool {
    ours(c) && c.mode.invalidating()
}

pub const ALL: &[Scenario] = &[
    Scenario {
        name: "detection_files",
        applies: always,
        run: detection_files,
    },
    Scenario {
        name: "register_dma_sizes",
        applies: always,
        run: register_dma_sizes,
    },
    Scenario {
        name: "several_mrs_one_allocation",
        applies: always,
        run: several_mrs,
    },
    Scenario {
        name: "host_memory_never_claimed",
        applies: always,
        run: host_memory,
    },
    Scenario {
        name: "outside_allocation_refused",
        applies: always,
        run: outside_allocation,
    },
    Scenario {
        name: "two_gpus",
        applies: always,
        run: two_gpus,
    },
    Scenario {
        name: "free_while_registered_munmap",
        applies: always,
        run: free_munmap,
    },
    Scenario {
        name: "free_while_registered_ioctl",
        applies: always,
        run: free_ioctl,
    },
    Scenario {
        name: "cq_umem_non_invalidating",
        applies: always,
        run: cq_umem,
    },
    Scenario {
        name: "memory_peers_statistics",
        applies: always,
        run: memory_peers_stats,
    },
    Scenario {
        name: "process_killed_with_live_mrs",
        applies: always,
        run: kill_process,
    },
    Scenario {
        name: "concurrent_threads",
        applies: always,
        run: concurrent,
    },
    Scenario {
        name: "free_races_deregistration",
        applies: always,
        run: free_races_dereg,
    },
    Scenario {
        name: "allocation_failure_sweep",
        applies: failslab,
        run: allocation_failure_sweep,
    },
    Scenario {
        name: "hostile_caller_fuzz",
        applies: always,
        run: hostile_fuzz,
    },
    Scenario {
        name: "rmmod_refused_while_registered",
        applies: always,
        run: rmmod_refused,
    },
    Scenario {
        name: "bad_input",
        applies: always,
        run: bad_input,
    },
    Scenario {
        name: "provider_failures_injected",
        applies: always,
        run: provider_failures,
    },
    Scenario {
        name: "page_table_versions",
        applies: ours,
        run: page_table_versions,
    },
    Scenario {
        name: "bar1_exhaustion",
        applies: always,
        run: bar1_exhaustion,
    },
    Scenario {
        name: "free_races_pin",
        applies: invalidating,
        run: free_races_pin,
    },
    Scenario {
        name: "slow_free_callback",
        applies: invalidating,
        run: slow_free_callback,
    },
    Scenario {
        name: "one_sg_entry_for_contiguous_1g",
        applies: ours_invalidating,
        run: contiguous_1g,
    },
    Scenario {
        name: "hca_rebind",
        applies: ours_invalidating_any,
        run: hca_rebind,
    },
    Scenario {
        name: "gpu_rebind",
        applies: ours,
        run: gpu_rebind,
    },
    Scenario {
        name: "late_binding",
        applies: ours,
        run: crate::late::late_binding,
    },
    Scenario {
        name: "late_binding_driver_check",
        applies: ours,
        run: crate::late::late_binding_driver_check,
    },
    Scenario {
        name: "late_binding_doctor",
        applies: with_stat,
        run: crate::late::late_binding_doctor,
    },
    Scenario {
        name: "late_binding_core_check",
        applies: ours_invalidating_any,
        run: crate::late::late_binding_core_check,
    },
    Scenario {
        name: "bar1_guard",
        applies: ours,
        run: crate::bar1::bar1_guard,
    },
    Scenario {
        name: "drain_core_restart",
        applies: ours,
        run: crate::drain::drain_core_restart,
    },
    Scenario {
        name: "drain_gpu_restart",
        applies: ours,
        run: crate::drain::drain_gpu_restart,
    },
    Scenario {
        name: "drain_resume",
        applies: ours,
        run: crate::drain::drain_resume,
    },
    Scenario {
        name: "self_upgrade",
        applies: ours,
        run: crate::drain::self_upgrade,
    },
    Scenario {
        name: "pair_table_full",
        applies: ours,
        run: pair_table_full,
    },
    Scenario {
        name: "large_mrs_one_entry",
        applies: ours_invalidating_any,
        run: large_mrs_one_entry,
    },
    Scenario {
        name: "dma_unmap_failure",
        applies: always,
        run: hostile::dma_unmap_failure,
    },
    Scenario {
        name: "persistent_unpin_failure",
        applies: always,
        run: hostile::persistent_unpin_failure,
    },
    Scenario {
        name: "memlock_charged_before_clients",
        applies: always,
        run: hostile::memlock_charged_first,
    },
    Scenario {
        name: "driver_verdicts",
        applies: |c| matches!(c.mode, Mode::Invalidating | Mode::Legacy),
        run: hostile::driver_verdicts,
    },
    Scenario {
        name: "probe_failures",
        applies: ours_invalidating_any,
        run: hostile::probe_failures,
    },
    Scenario {
        name: "views_read_whole",
        applies: |c| ours(c) && c.mode == Mode::Persistent,
        run: hostile::views_read_whole,
    },
    Scenario {
        name: "remap_counts_once",
        applies: |c| ours(c) && c.mode != Mode::Ofed4,
        run: hostile::remap_counts_once,
    },
    Scenario {
        name: "topology_gate",
        applies: always,
        run: hostile::topology_gate,
    },
    Scenario {
        name: "coherent_gpu",
        applies: always,
        run: hostile::coherent_gpu,
    },
    Scenario {
        name: "exit_gpu_fd_first",
        applies: invalidating,
        run: hostile::exit_gpu_first,
    },
    Scenario {
        name: "exit_rdma_fd_first",
        applies: invalidating,
        run: hostile::exit_rdma_first,
    },
    Scenario {
        name: "table_address_reuse",
        applies: invalidating,
        run: hostile::table_address_reuse,
    },
    Scenario {
        name: "rmmod_races_last_callback",
        applies: ours_invalidating_any,
        run: hostile::rmmod_races_last_callback,
    },
    // The C module is known to corrupt memory or deadlock from here on
    // (README, known bugs): its reference runs keep these last.
    Scenario {
        name: "unpin_failure_then_free",
        applies: invalidating,
        run: hostile::unpin_failure_then_free,
    },
    Scenario {
        name: "foreign_process_release",
        applies: invalidating,
        run: hostile::foreign_release,
    },
    Scenario {
        name: "callback_from_kernel_thread",
        applies: invalidating,
        run: hostile::callback_from_kernel_thread,
    },
    Scenario {
        name: "foreign_dereg_then_kernel_thread",
        applies: invalidating,
        run: hostile::foreign_dereg_then_kernel_thread,
    },
    Scenario {
        name: "free_races_registration",
        applies: invalidating,
        run: hostile::free_races_registration,
    },
];

pub(crate) fn pattern(seed: u64, off: u64, n: usize) -> Vec<u8> {
    (0..n as u64)
        .map(|i| {
            let x = (seed ^ (off + i)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            (x >> 56) as u8
        })
        .collect()
}

pub(crate) fn errno_name(e: i32) -> String {
    format!("{} ({})", std::io::Error::from_raw_os_error(e), e)
}

pub(crate) fn expect_err<T>(r: Result<T, i32>, want: i32, what: &str) -> Result<(), String> {
    match r {
        Ok(_) => Err(format!("{what}: succeeded, expected {}", errno_name(want))),
        Err(e) if e == want => Ok(()),
        Err(e) => Err(format!(
            "{what}: got {}, expected {}",
            errno_name(e),
            errno_name(want)
        )),
    }
}

pub(crate) fn stat(name: &str) -> u64 {
    module::stats().get(name).copied().unwrap_or(0)
}

/// Nothing of any registration is left anywhere.
pub fn quiescent(ctx: &Ctx) -> Result<(), String> {
    let ci = ctx.core.info();
    ensure!(
        ci.live_umems == 0,
        "{} umems left in the core",
        ci.live_umems
    );
    if let Some(g) = &ctx.gpu {
        let gi = g.info();
        ensure!(
            gi.live_tables == 0,
            "{} page tables left pinned",
            gi.live_tables
        );
        ensure!(
            gi.live_mappings == 0,
            "{} DMA mappings left",
            gi.live_mappings
        );
        ensure!(
            gi.live_allocs == 0,
            "{} GPU allocations left",
            gi.live_allocs
        );
        ensure!(
            gi.stale_puts == ctx.stale_puts,
            "HARNESS FAILURE: {} uses of page tables the GPU driver had freed",
            gi.stale_puts - ctx.stale_puts
        );
    }
    if !ctx.opts.reference && module::loaded("nvidia_peermem") {
        let s = module::stats();
        ensure!(
            s.get("live_registrations") == Some(&0),
            "live registrations left: {s:?}"
        );
        ensure!(
            s.get("pinned_bytes") == Some(&0),
            "pinned bytes left: {s:?}"
        );
        ensure!(
            s.get("orphaned_pins") == Some(&0) && s.get("stranded_pins") == Some(&0),
            "pins left to free callbacks: {s:?}"
        );
        // Per GPU and per process, exactly nothing is left either.
        let gpus = module::view("gpus")?;
        ensure!(
            gpus.lines()
                .all(|l| l.contains(" live=0 ") && l.contains(" pinned_bytes=0 ")),
            "per-GPU accounting left: {gpus}"
        );
        let procs = module::view("processes")?;
        ensure!(procs.is_empty(), "per-process accounting left: {procs}");
    }
    Ok(())
}

/// The client an MR (`inval`) or a CQ/QP umem (`!inval`) must land on.
fn expected_client(mode: Mode, inval: bool) -> &'static str {
    if mode == Mode::Persistent || inval {
        "nv_mem"
    } else {
        "nv_mem_nc"
    }
}

/// Sample offsets (relative to the MR) of `n` bytes each.
fn samples(ctx: &mut Ctx, len: u64, n: u64) -> Vec<u64> {
    if len <= n {
        return vec![0];
    }
    let mid = ctx.rand() % (len - n);
    let mut v = vec![0, len - n, mid];
    v.sort();
    v.dedup();
    v
}

/// Registers `[a.va + off, + len)`, checks what the core got, moves bytes
/// both ways through the HCA at sampled offsets, deregisters, checks the
/// provider saw exactly one pin and one unpin. Returns the query.
pub(crate) fn reg_verify(
    ctx: &mut Ctx,
    a: &Alloc,
    off: u64,
    len: u64,
    flags: u64,
) -> Result<PmcQuery, String> {
    let addr = a.va + off;
    let n = 256.min(len);
    let offs = samples(ctx, len, n);
    let seed = ctx.rand();
    for &s in &offs {
        a.write(off + s, &pattern(seed, s, n as usize));
    }
    let inval = flags & PMC_REG_INVAL_SUPP != 0;
    let gi0 = ctx.gpu().info();
    let regs0 = stat("registrations");
    let h = ctx
        .core
        .reg(addr, len, flags)
        .map_err(|e| format!("reg {addr:#x}+{len:#x}: {}", errno_name(e)))?;
    let q = ctx.core.query(h).map_err(errno_name)?;
    let gi1 = ctx.gpu().info();
    ensure!(
        q.source == PMC_SRC_PEER,
        "not claimed by a peer client (source {})",
        q.source
    );
    ensure!(q.state == PMC_STATE_MAPPED, "state {} after reg", q.state);
    ensure!(
        q.client_name() == expected_client(ctx.mode, inval),
        "claimed by {}",
        q.client_name()
    );
    ensure!(q.page_size == K64, "get_page_size {}", q.page_size);
    // The SG entries cover the range widened to the guest's pages (16 KiB
    // ones are a quarter of a 64 KiB GPU page).
    let page = crate::page_size();
    let span = (addr + len).div_ceil(page) * page - addr / page * page;
    ensure!(
        q.total_len == span,
        "SG entries cover {:#x} bytes, expected {span:#x}",
        q.total_len
    );
    let (pins, ppins) = (
        gi1.pins - gi0.pins,
        gi1.persistent_pins - gi0.persistent_pins,
    );
    let pinned_with_cb = ctx.mode.invalidating() && inval;
    if !ctx.opts.reference {
        ensure!(
            (pins, ppins) == if pinned_with_cb { (1, 0) } else { (0, 1) },
            "provider pins for one registration: {pins} with callback, {ppins} persistent"
        );
        // One entry where contiguity is guaranteed: our own mapping of BAR
        // runs (invalidating MRs), or a provider mapping without a
        // translating IOMMU (or mapping whole runs).
        if pinned_with_cb || hostile::provider_contiguous() {
            ensure!(q.nmap == 1, "{} SG entries for a contiguous range", q.nmap);
        } else {
            ensure!(
                q.nmap >= 1 && q.nmap <= span.div_ceil(K64) + 1,
                "{} SG entries for {span:#x} bytes",
                q.nmap
            );
        }
        ensure!(
            stat("registrations") == regs0 + 1,
            "registrations counter did not move by one"
        );
        // Invalidating MRs are mapped by the module itself: the GPU
        // driver's dma_map (and its lock) is never taken under the core's
        // mapping lock.
        let maps = gi1.dma_maps - gi0.dma_maps;
        ensure!(
            maps == u64::from(!pinned_with_cb),
            "{maps} nvidia_p2p_dma_map_pages calls for one registration"
        );
    }
    for &s in &offs {
        let got = ctx
            .core
            .dma_read(h, s, n as usize)
            .map_err(|e| format!("DMA read at {s:#x}: {}", errno_name(e)))?;
        ensure!(
            got == pattern(seed, s, n as usize),
            "DMA read at MR+{s:#x} returned other bytes than the CPU wrote"
        );
    }
    let seed2 = ctx.rand();
    for &s in &offs {
        ctx.core
            .dma_write(h, s, &pattern(seed2, s, n as usize))
            .map_err(|e| format!("DMA write at {s:#x}: {}", errno_name(e)))?;
        ensure!(
            a.read(off + s, n as usize) == pattern(seed2, s, n as usize),
            "CPU sees other bytes than the HCA wrote at MR+{s:#x}"
        );
    }
    ctx.core
        .dereg(h)
        .map_err(|e| format!("dereg: {}", errno_name(e)))?;
    let gi2 = ctx.gpu().info();
    ensure!(
        gi2.unpins == gi1.unpins + 1,
        "provider unpins after dereg: {}",
        gi2.unpins - gi1.unpins
    );
    Ok(q)
}

fn detection_files(ctx: &mut Ctx) -> Result<String, String> {
    let v = std::fs::read_to_string("/sys/module/nvidia_peermem/version")
        .map_err(|e| format!("/sys/module/nvidia_peermem/version: {e}"))?;
    let v = v.trim().to_string();
    ensure!(!v.is_empty(), "empty version");
    ensure!(
        module::peer_stat("nv_mem", "version").is_some(),
        "memory_peers/nv_mem/version missing"
    );
    let nc = module::peer_stat("nv_mem_nc", "version").is_some();
    ensure!(
        nc == ctx.mode.invalidating(),
        "memory_peers/nv_mem_nc present: {nc}"
    );
    if !ctx.opts.reference {
        ensure!(
            module::peer_stat("nv_mem", "version").as_deref() == Some(v.as_str()),
            "client version differs from module version"
        );
        // The parameters, in sysfs as NVIDIA's module has them, and only
        // there (no counter repeats one).
        let st = module::stats();
        let want = (
            u64::from(ctx.mode == Mode::Persistent),
            u64::from(ctx.mode.legacy()),
        );
        ensure!(
            !st.is_empty() && st.keys().all(|k| !k.starts_with("param_")),
            "counters {st:?}: none, or a parameter among them"
        );
        let sysfs = module::param;
        let got = (sysfs("persistent_api_support"), sysfs("peerdirect_support"));
        ensure!(
            got == (Some(want.0), Some(want.1)),
            "sysfs parameters {got:?}, expected {want:?}"
        );
        for n in [
            "path_policy",
            "path_accounting",
            "allow_unverified_paths",
            "pair_table_slots",
        ] {
            ensure!(sysfs(n).is_some(), "sysfs parameter {n}: {:?}", sysfs(n));
        }
    }
    Ok(format!("version {v}"))
}

fn register_dma_sizes(ctx: &mut Ctx) -> Result<String, String> {
    let mut cases = vec![
        (K64, 0, K64),
        (2 * M, 0x1234, 2 * M - 0x1234 - 5),
        (4 * M, 3 * K64 + 100, K64),
    ];
    if !ctx.opts.quick {
        cases.push((64 * M, 0, 64 * M));
        let page = crate::page_size();
        cases.push((256 * M, 3 * page + 17, 256 * M - 3 * page - 117));
    }
    let mut out = Vec::new();
    for (size, off, len) in cases {
        let a = ctx
            .gpu()
            .alloc(0, size)
            .map_err(|e| format!("alloc {size}: {}", errno_name(e)))?;
        let q = reg_verify(ctx, &a, off, len, PMC_REG_INVAL_SUPP)?;
        out.push(format!("{}K:{}sge", len >> 10, q.nmap));
        drop(a);
    }
    Ok(out.join(" "))
}

fn several_mrs(ctx: &mut Ctx) -> Result<String, String> {
    let a = ctx.gpu().alloc(0, 4 * M).map_err(errno_name)?;
    let ranges = [(0, M), (512 << 10, 2 * M + 7), (100, 4 * M - 200)];
    let mut hs = Vec::new();
    for (off, len) in ranges {
        hs.push(
            ctx.core
                .reg(a.va + off, len, PMC_REG_INVAL_SUPP)
                .map_err(|e| format!("reg: {}", errno_name(e)))?,
        );
    }
    let seed = ctx.rand();
    // Each MR sees what the others wrote: one memory, three registrations.
    for (i, (off, len)) in ranges.iter().enumerate() {
        let at = len / 2;
        ctx.core
            .dma_write(hs[i], at, &pattern(seed, *off + at, 64))
            .map_err(errno_name)?;
        for (j, (off2, len2)) in ranges.iter().enumerate() {
            let abs = off + at;
            if abs >= *off2 && abs + 64 <= off2 + len2 {
                let got = ctx
                    .core
                    .dma_read(hs[j], abs - off2, 64)
                    .map_err(errno_name)?;
                ensure!(
                    got == pattern(seed, abs, 64),
                    "MR {j} does not see MR {i}'s write"
                );
            }
        }
        ensure!(
            a.read(off + at, 64) == pattern(seed, off + at, 64),
            "CPU does not see MR {i}'s write"
        );
    }
    for &h in [hs[1], hs[0], hs[2]].iter() {
        ctx.core.dereg(h).map_err(errno_name)?;
    }
    Ok("3 overlapping MRs".into())
}

fn host_memory(ctx: &mut Ctx) -> Result<String, String> {
    let acq0 = stat("acquired");
    // SAFETY: fresh anonymous mappings owned by this function.
    let host = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            M as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    // SAFETY: as above.
    let none = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            M as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    ensure!(
        host != libc::MAP_FAILED && none != libc::MAP_FAILED,
        "mmap failed"
    );
    let r = (|| {
        let h = ctx
            .core
            .reg(host as u64, M, PMC_REG_INVAL_SUPP)
            .map_err(|e| format!("host MR: {}", errno_name(e)))?;
        let q = ctx.core.query(h).map_err(errno_name)?;
        ctx.core.dereg(h).map_err(errno_name)?;
        ensure!(
            q.source == PMC_SRC_HOST,
            "host memory went to a peer client ({})",
            q.client_name()
        );
        let declined0 = stat("declined");
        expect_err(
            ctx.core.reg(none as u64, M, PMC_REG_INVAL_SUPP),
            libc::EFAULT,
            "PROT_NONE range",
        )?;
        expect_err(
            ctx.core.reg(0x10000, M, PMC_REG_INVAL_SUPP),
            libc::EFAULT,
            "unmapped range",
        )?;
        if !ctx.opts.reference {
            // Each eligible client is asked (nv_mem and nv_mem_nc for an MR).
            let clients = if ctx.mode.invalidating() { 2 } else { 1 };
            let d = stat("declined") - declined0;
            ensure!(
                d == 2 * clients,
                "declined counter moved by {d}, expected {}",
                2 * clients
            );
        }
        Ok(())
    })();
    // SAFETY: unmapping what we mapped above.
    unsafe {
        libc::munmap(host, M as usize);
        libc::munmap(none, M as usize);
    }
    r?;
    if !ctx.opts.reference {
        ensure!(
            stat("acquired") == acq0,
            "the module claimed non-GPU memory"
        );
    }
    Ok("host MR pinned by the core; PROT_NONE and unmapped ranges: EFAULT".into())
}

/// A free, 64 KiB-aligned stretch of address space of `len` bytes.
fn free_va(len: u64) -> Result<u64, String> {
    // SAFETY: a reservation we unmap right away; only its address is kept.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            (len + K64) as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    ensure!(p != libc::MAP_FAILED, "cannot reserve address space");
    // SAFETY: unmapping the reservation above.
    unsafe { libc::munmap(p, (len + K64) as usize) };
    Ok((p as u64).div_ceil(K64) * K64)
}

fn outside_allocation(ctx: &mut Ctx) -> Result<String, String> {
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    expect_err(
        ctx.core.reg(a.va + M / 2, M, PMC_REG_INVAL_SUPP),
        libc::EFAULT,
        "range past the allocation's end",
    )?;
    expect_err(
        ctx.core.reg(a.va - K64, 2 * K64, PMC_REG_INVAL_SUPP),
        libc::EFAULT,
        "range before the allocation",
    )?;
    // Two allocations back to back in the address space: a range across the
    // boundary touches GPU memory only, yet belongs to no single allocation.
    let base = free_va(2 * M)?;
    let lo = ctx
        .gpu()
        .alloc_at(0, M, Some(base))
        .map_err(|e| format!("alloc at {base:#x}: {}", errno_name(e)))?;
    let at = lo.va + lo.size;
    let hi = ctx
        .gpu()
        .alloc_at(0, M, Some(at))
        .map_err(|e| format!("alloc at {at:#x}: {}", errno_name(e)))?;
    ensure!(hi.va == lo.va + lo.size, "allocations not adjacent");
    expect_err(
        ctx.core.reg(lo.va + M - K64, 2 * K64, PMC_REG_INVAL_SUPP),
        libc::EFAULT,
        "range straddling two allocations",
    )?;
    let gi = ctx.gpu().info();
    ensure!(
        gi.live_tables == 0,
        "a refused range left {} pins",
        gi.live_tables
    );
    // Each on its own is fine.
    reg_verify(ctx, &lo, M - K64, K64, PMC_REG_INVAL_SUPP)?;
    reg_verify(ctx, &hi, 0, K64, PMC_REG_INVAL_SUPP)?;
    drop(a);
    Ok("past the end, before the start, and across two adjacent allocations: EFAULT".into())
}

fn two_gpus(ctx: &mut Ctx) -> Result<String, String> {
    ensure!(
        ctx.gpu().info().gpus >= 2,
        "the testbed has fewer than two GPUs"
    );
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    let b = ctx.gpu().alloc(1, M).map_err(errno_name)?;
    let ha = ctx
        .core
        .reg(a.va, M, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    let hb = ctx
        .core
        .reg(b.va, M, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    let (qa, qb) = (
        ctx.core.query(ha).map_err(errno_name)?,
        ctx.core.query(hb).map_err(errno_name)?,
    );
    ensure!(
        qa.first_dma != qb.first_dma,
        "both GPUs map to the same bus address"
    );
    let seed = ctx.rand();
    ctx.core
        .dma_write(ha, 4096, &pattern(seed, 0, 128))
        .map_err(errno_name)?;
    ctx.core
        .dma_write(hb, 4096, &pattern(seed, 1, 128))
        .map_err(errno_name)?;
    ensure!(
        a.read(4096, 128) == pattern(seed, 0, 128),
        "GPU 0 bytes wrong"
    );
    ensure!(
        b.read(4096, 128) == pattern(seed, 1, 128),
        "GPU 1 bytes wrong"
    );
    ctx.core.dereg(ha).map_err(errno_name)?;
    ctx.core.dereg(hb).map_err(errno_name)?;
    Ok(format!("bus {:#x} and {:#x}", qa.first_dma, qb.first_dma))
}

/// Frees (by `free`) GPU memory under a live MR and checks the outcome.
fn free_under_mr(ctx: &mut Ctx, free: fn(&Gpu, &mut Alloc)) -> Result<String, String> {
    let mut a = ctx.gpu().alloc(0, 2 * M).map_err(errno_name)?;
    let seed = ctx.rand();
    a.write(K64, &pattern(seed, 0, 64));
    let inv0 = stat("invalidations");
    let cb0 = ctx.gpu().info().callbacks;
    let h = ctx
        .core
        .reg(a.va, 2 * M, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    free(ctx.gpu(), &mut a);
    let q = ctx.core.query(h).map_err(errno_name)?;
    let detail = if ctx.mode.invalidating() {
        let want = if ctx.mode.legacy() {
            PMC_STATE_UNMAPPED
        } else {
            PMC_STATE_INVALIDATED
        };
        ensure!(
            q.state == want && q.revoked == 1,
            "after the free: state {} revoked {}",
            q.state,
            q.revoked
        );
        expect_err(
            ctx.core.dma_read(h, K64, 64),
            libc::EACCES,
            "DMA through the invalidated MR",
        )?;
        ensure!(
            ctx.gpu().info().callbacks == cb0 + 1,
            "free callbacks: {}",
            ctx.gpu().info().callbacks - cb0
        );
        if !ctx.opts.reference {
            ensure!(stat("invalidations") == inv0 + 1, "invalidations counter");
            ensure!(
                stat("core_invalidations") >= 1,
                "core invalidate never called"
            );
            ensure!(stat("pinned_bytes") == 0, "pinned bytes after the revoke");
        }
        "MR invalidated, DMA refused"
    } else {
        ensure!(
            q.state == PMC_STATE_MAPPED && q.revoked == 0,
            "persistent MR changed: state {}",
            q.state
        );
        let got = ctx.core.dma_read(h, K64, 64).map_err(errno_name)?;
        ensure!(
            got == pattern(seed, 0, 64),
            "persistent MR lost its bytes after the free"
        );
        ensure!(
            ctx.gpu().info().live_allocs >= 1,
            "freed memory already returned while pinned"
        );
        "memory kept until deregistration"
    };
    ctx.core.dereg(h).map_err(errno_name)?;
    a.unmap();
    Ok(detail.into())
}

fn free_munmap(ctx: &mut Ctx) -> Result<String, String> {
    free_under_mr(ctx, |_, a| a.unmap())
}

fn free_ioctl(ctx: &mut Ctx) -> Result<String, String> {
    free_under_mr(ctx, |g, a| g.free(a).expect("free ioctl"))
}

fn cq_umem(ctx: &mut Ctx) -> Result<String, String> {
    let mut a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    let q = reg_verify(ctx, &a, 0, M, 0)?;
    // Backed by a persistent pin: survives a free.
    let h = ctx.core.reg(a.va, M, 0).map_err(errno_name)?;
    a.unmap();
    let q2 = ctx.core.query(h).map_err(errno_name)?;
    ensure!(
        q2.state == PMC_STATE_MAPPED && q2.revoked == 0,
        "CQ umem changed on free: state {}",
        q2.state
    );
    ctx.core
        .dma_read(h, 0, 64)
        .map_err(|e| format!("DMA after free: {}", errno_name(e)))?;
    ctx.core.dereg(h).map_err(errno_name)?;
    Ok(format!("client {}", q.client_name()))
}

fn memory_peers_stats(ctx: &mut Ctx) -> Result<String, String> {
    let client = "nv_mem";
    let get = |n: &str| {
        module::peer_stat(client, n)
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(u64::MAX)
    };
    let (mrs0, bytes0, dealloc0) = (
        get("num_alloc_mrs"),
        get("num_reg_bytes"),
        get("num_dealloc_mrs"),
    );
    let a = ctx.gpu().alloc(0, 2 * M).map_err(errno_name)?;
    let h1 = ctx
        .core
        .reg(a.va, M, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    let h2 = ctx
        .core
        .reg(a.va + 100, 3000, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    ensure!(
        get("num_alloc_mrs") == mrs0 + 2,
        "num_alloc_mrs {} -> {}",
        mrs0,
        get("num_alloc_mrs")
    );
    ensure!(
        get("num_reg_bytes") == bytes0 + M + 3000,
        "num_reg_bytes {} -> {}",
        bytes0,
        get("num_reg_bytes")
    );
    ctx.core.dereg(h1).map_err(errno_name)?;
    ctx.core.dereg(h2).map_err(errno_name)?;
    ensure!(get("num_dealloc_mrs") == dealloc0 + 2, "num_dealloc_mrs");
    Ok(format!("num_alloc_mrs {}", get("num_alloc_mrs")))
}

fn kill_process(ctx: &mut Ctx) -> Result<String, String> {
    let mut fds = [0i32; 2];
    // SAFETY: a pipe into a local array.
    ensure!(unsafe { libc::pipe(fds.as_mut_ptr()) } == 0, "pipe");
    // SAFETY: the process is single-threaded here; the child only uses
    // async-signal-safe calls and its own fresh handles, then waits to die.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ok = (|| -> Option<()> {
            let g = Gpu::open().ok()?;
            let c = Core::open().ok()?;
            let a = g.alloc(0, 2 * M).ok()?;
            let b = g.alloc(1, M).ok()?;
            c.reg(a.va, M, PMC_REG_INVAL_SUPP).ok()?;
            c.reg(a.va + M, M, 0).ok()?;
            c.reg(b.va, M, PMC_REG_INVAL_SUPP).ok()?;
            std::mem::forget((g, c, a, b));
            Some(())
        })();
        let byte = [if ok.is_some() { 1u8 } else { 0u8 }];
        // SAFETY: writing one byte to our pipe, then sleeping until killed.
        unsafe {
            libc::write(fds[1], byte.as_ptr().cast(), 1);
            loop {
                libc::pause();
            }
        }
    }
    let mut byte = [0u8];
    // SAFETY: reading one byte from our pipe; then reaping the child.
    unsafe {
        libc::read(fds[0], byte.as_mut_ptr().cast(), 1);
        let live = stat("live_registrations");
        libc::kill(pid, libc::SIGKILL);
        let mut st = 0;
        libc::waitpid(pid, &mut st, 0);
        libc::close(fds[0]);
        libc::close(fds[1]);
        ensure!(byte[0] == 1, "the child could not register");
        if !ctx.opts.reference {
            ensure!(
                live == 3,
                "{live} live registrations in the child, expected 3"
            );
        }
    }
    Ok("3 MRs on 2 GPUs released at exit".into())
}

fn concurrent(ctx: &mut Ctx) -> Result<String, String> {
    let threads = 4;
    let iters = if ctx.opts.quick { 4 } else { 12 };
    let mode = ctx.mode;
    let base_seed = ctx.rand();
    let results: Vec<Result<u32, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || -> Result<u32, String> {
                    let g = Gpu::open()?;
                    let c = Core::open()?;
                    let mut x = base_seed ^ ((t as u64 + 1) * 0x1234_5678_9abc);
                    let mut invalidated = 0;
                    for i in 0..iters {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let size = K64 * (1 + x % 16);
                        let mut a = g
                            .alloc((t % 2) as u64, size)
                            .map_err(|e| format!("alloc: {e}"))?;
                        let inval = x & 1 == 0;
                        let flags = if inval { PMC_REG_INVAL_SUPP } else { 0 };
                        let h = c
                            .reg(a.va + (x % 4096), size - 4096, flags)
                            .map_err(|e| format!("reg: {e}"))?;
                        if i % 4 == 0 {
                            c.dma_write(h, 8, &[t as u8; 8])
                                .map_err(|e| format!("dma: {e}"))?;
                            if a.read((x % 4096) + 8, 8) != [t as u8; 8] {
                                return Err("DMA bytes lost".into());
                            }
                        }
                        if x & 2 == 0 {
                            a.unmap();
                            let q = c.query(h).map_err(|e| format!("query: {e}"))?;
                            if mode.invalidating() && inval {
                                if q.revoked != 1 {
                                    return Err("free did not invalidate".into());
                                }
                                invalidated += 1;
                            } else if q.state != PMC_STATE_MAPPED {
                                return Err("persistent MR changed on free".into());
                            }
                            c.dereg(h).map_err(|e| format!("dereg: {e}"))?;
                        } else {
                            c.dereg(h).map_err(|e| format!("dereg: {e}"))?;
                            a.unmap();
                        }
                    }
                    Ok(invalidated)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    let mut inv = 0;
    for r in results {
        inv += r?;
    }
    Ok(format!(
        "{} registrations, {inv} invalidated by frees",
        threads * iters
    ))
}

/// cudaFree and ibv_dereg_mr at the same moment, from two threads: the free
/// callback races the core's unmap/unpin/release (the anchors' "invalid
/// context" and put_pages-vs-callback bugs).
fn free_races_dereg(ctx: &mut Ctx) -> Result<String, String> {
    let rounds = if ctx.opts.quick { 4 } else { 16 };
    let cb0 = ctx.gpu().info().callbacks;
    for i in 0..rounds {
        let mut a = ctx.gpu().alloc(0, 4 * M).map_err(errno_name)?;
        let flags = if i % 4 == 3 { 0 } else { PMC_REG_INVAL_SUPP };
        let h = ctx
            .core
            .reg(a.va + 4096, 3 * M, flags)
            .map_err(errno_name)?;
        let barrier = std::sync::Barrier::new(2);
        let core = &ctx.core;
        let r = std::thread::scope(|s| {
            let t = s.spawn(|| {
                barrier.wait();
                a.unmap();
            });
            barrier.wait();
            for _ in 0..(i % 3) {
                std::hint::spin_loop();
            }
            let r = core.dereg(h);
            t.join().map_err(|_| "free thread panicked".to_string())?;
            r.map_err(errno_name)
        });
        r?;
    }
    let cbs = ctx.gpu().info().callbacks - cb0;
    Ok(format!(
        "{rounds} rounds, {cbs} free callbacks raced a deregistration"
    ))
}

/// The text range of a loaded module, from /proc/kallsyms.
fn module_text(name: &str) -> Result<(u64, u64), String> {
    let ks = std::fs::read_to_string("/proc/kallsyms").map_err(|e| e.to_string())?;
    let tag = format!("[{name}]");
    let addrs: Vec<u64> = ks
        .lines()
        .filter(|l| l.ends_with(&tag))
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let a = u64::from_str_radix(it.next()?, 16).ok()?;
            matches!(it.next()?, "t" | "T").then_some(a)
        })
        .collect();
    let (lo, hi) = (addrs.iter().min(), addrs.iter().max());
    match (lo, hi) {
        (Some(&lo), Some(&hi)) if lo != 0 => Ok((lo, hi + 4096)),
        _ => Err(format!("no text symbols of {name} in /proc/kallsyms")),
    }
}

/// The text of the kernel function `name` (from /proc/kallsyms: its address
/// up to the next symbol's), if the kernel has it.
fn kernel_function(name: &str) -> Option<(u64, u64)> {
    let ks = std::fs::read_to_string("/proc/kallsyms").ok()?;
    let mut start = None;
    let mut addrs = Vec::new();
    for l in ks.lines().filter(|l| !l.ends_with(']')) {
        let mut it = l.split_whitespace();
        let (Some(a), Some(_), Some(n)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        let Ok(a) = u64::from_str_radix(a, 16) else {
            continue;
        };
        if n == name {
            start = Some(a);
        }
        addrs.push(a);
    }
    let start = start.filter(|&a| a != 0)?;
    let end = addrs.into_iter().filter(|&a| a > start).min()?;
    Some((start, end))
}

/// Fails, one registration at a time, the 1st, 2nd, ... memory allocation
/// made with this module on the stack (failslab and fail_page_alloc with a
/// call-site filter on our text, /proc/thread-self/fail-nth), until a
/// registration gets through: every failure must reach user space as a clean
/// errno and leave nothing behind.
fn allocation_failure_sweep(ctx: &mut Ctx) -> Result<String, String> {
    let (lo, hi) = module_text("nvidia_peermem")?;
    // Not DMA-API debug's own bookkeeping of a mapping made under us: it
    // turns itself off for the rest of the boot when that fails, and the
    // later scenarios rely on it.
    let (rlo, rhi) = kernel_function("debug_dma_map_phys").unwrap_or((0, 0));
    for dir in [
        "/sys/kernel/debug/failslab",
        "/sys/kernel/debug/fail_page_alloc",
    ] {
        module::debugfs_write(&format!("{dir}/ignore-gfp-wait"), "N")?;
        module::debugfs_write(&format!("{dir}/require-start"), &lo.to_string())?;
        module::debugfs_write(&format!("{dir}/require-end"), &hi.to_string())?;
        module::debugfs_write(&format!("{dir}/reject-start"), &rlo.to_string())?;
        module::debugfs_write(&format!("{dir}/reject-end"), &rhi.to_string())?;
        module::debugfs_write(&format!("{dir}/verbose"), "0")?;
    }
    let a = ctx.gpu().alloc(0, 8 * M).map_err(errno_name)?;
    let mut errnos = std::collections::BTreeMap::new();
    let mut sites = 0;
    let mut ok = false;
    for n in 1..200 {
        std::fs::write("/proc/thread-self/fail-nth", n.to_string())
            .map_err(|e| format!("fail-nth: {e}"))?;
        let r = ctx.core.reg(a.va + 0x1000, 6 * M, PMC_REG_INVAL_SUPP);
        let left: u32 = std::fs::read_to_string("/proc/thread-self/fail-nth")
            .map_err(|e| e.to_string())?
            .trim()
            .parse()
            .unwrap_or(0);
        std::fs::write("/proc/thread-self/fail-nth", "0").map_err(|e| e.to_string())?;
        match r {
            Ok(h) => {
                ctx.core.dereg(h).map_err(errno_name)?;
                if left != 0 {
                    ok = true; // the n-th allocation was never reached
                    break;
                }
                // An allocation failed and the registration still got
                // through (e.g. a fallback): fine, keep sweeping.
                sites += 1;
            }
            Err(e) => {
                ensure!(
                    left == 0,
                    "registration failed without an injected fault: {}",
                    errno_name(e)
                );
                ensure!(
                    [libc::ENOMEM, libc::EFAULT].contains(&e),
                    "allocation failure {n} reached user space as {}",
                    errno_name(e)
                );
                *errnos.entry(e).or_insert(0) += 1;
                sites += 1;
            }
        }
        let gi = ctx.gpu().info();
        ensure!(
            gi.live_tables == 0 && gi.live_mappings == 0,
            "failure {n} leaked pins or mappings"
        );
        ensure!(ctx.core.info().live_umems == 0, "failure {n} leaked a umem");
    }
    for dir in [
        "/sys/kernel/debug/failslab",
        "/sys/kernel/debug/fail_page_alloc",
    ] {
        module::debugfs_write(&format!("{dir}/require-start"), "0")?;
        module::debugfs_write(&format!("{dir}/require-end"), "0")?;
        module::debugfs_write(&format!("{dir}/reject-start"), "0")?;
        module::debugfs_write(&format!("{dir}/reject-end"), "0")?;
    }
    ensure!(
        !dma_debug_off(),
        "DMA-API debug turned itself off during the sweep"
    );
    ensure!(ok, "the sweep never got a registration through");
    ensure!(sites >= 2, "only {sites} allocation sites reached");
    reg_verify(ctx, &a, 0, M, PMC_REG_INVAL_SUPP)?;
    Ok(format!(
        "{sites} allocation failures injected, user errnos {errnos:?}"
    ))
}

/// What a hostile `ibv_reg_mr` caller can send through the core, at random
/// for a bounded time: addresses anywhere (and near or inside GPU memory),
/// any lengths, bad flags, handles never issued or already freed, DMA with any
/// offset, length and direction. Every answer must be a clean errno (never
/// 524), every success is undone, and nothing is left behind.
fn hostile_fuzz(ctx: &mut Ctx) -> Result<String, String> {
    let secs = if ctx.opts.quick {
        3
    } else {
        ctx.opts.fuzz_secs
    };
    let allowed = [
        libc::EINVAL,
        libc::EFAULT,
        libc::ENOMEM,
        libc::EACCES,
        libc::EOPNOTSUPP,
        libc::ENODEV,
    ];
    let a = ctx.gpu().alloc(0, 4 * M).map_err(errno_name)?;
    let mut live: Vec<u64> = Vec::new();
    let mut dead: Vec<u64> = Vec::new();
    let (mut calls, mut ok) = (0u64, 0u64);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        calls += 1;
        let r = ctx.rand();
        let pick = |x: u64, v: &[u64]| {
            if v.is_empty() {
                x
            } else {
                v[(x % v.len() as u64) as usize]
            }
        };
        let res: Result<(), i32> = match r % 8 {
            0..=3 => {
                let addr = match (r >> 8) % 4 {
                    0 => ctx.rand(),
                    1 => a.va.wrapping_add(ctx.rand() % (8 * M)).wrapping_sub(2 * M),
                    2 => a.va + ctx.rand() % (4 * M),
                    _ => ctx.rand() % (1 << 47),
                };
                let len = match (r >> 16) % 5 {
                    0 => 0,
                    1 => ctx.rand(),
                    2 => 1 + ctx.rand() % (8 * M),
                    3 => u64::MAX - ctx.rand() % 4096,
                    _ => 1 + ctx.rand() % 4096,
                };
                let flags = ctx.rand() % 16;
                match ctx.core.reg(addr, len, flags) {
                    Ok(h) => {
                        ok += 1;
                        // The core reuses freed handle numbers.
                        dead.retain(|&d| d != h);
                        live.push(h);
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            4 => {
                let h = match (r >> 8) % 3 {
                    0 => ctx.rand(),
                    1 => pick(ctx.rand(), &dead),
                    _ => {
                        if live.is_empty() {
                            ctx.rand()
                        } else {
                            let i = (ctx.rand() % live.len() as u64) as usize;
                            live.swap_remove(i)
                        }
                    }
                };
                let r = ctx.core.dereg(h);
                if r.is_ok() {
                    live.retain(|&l| l != h);
                    dead.push(h);
                }
                r
            }
            5 => {
                let h = pick(ctx.rand(), if (r >> 8) % 2 == 0 { &live } else { &dead });
                let mut buf = vec![0u8; 1 + (ctx.rand() % 64) as usize];
                let off = if (r >> 9) % 2 == 0 {
                    ctx.rand()
                } else {
                    ctx.rand() % (4 * M)
                };
                if (r >> 10) % 2 == 0 {
                    ctx.core.dma_read(h, off, buf.len()).map(|_| ())
                } else {
                    buf[0] = 1;
                    ctx.core.dma_write(h, off, &buf)
                }
            }
            _ => {
                let h = pick(ctx.rand(), if (r >> 8) % 2 == 0 { &live } else { &dead });
                ctx.core.query(h).map(|_| ())
            }
        };
        if let Err(e) = res {
            ensure!(e != 524, "ENOTSUPP (524) reached user space (call {calls})");
            ensure!(
                allowed.contains(&e),
                "call {calls} answered {}",
                errno_name(e)
            );
        }
    }
    for h in live {
        ctx.core.dereg(h).map_err(errno_name)?;
    }
    drop(a);
    Ok(format!(
        "{calls} hostile calls in {secs} s, {ok} registrations accepted and undone"
    ))
}

fn rmmod_refused(ctx: &mut Ctx) -> Result<String, String> {
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    let h = ctx
        .core
        .reg(a.va, M, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    let refused = !module::rmmod("nvidia_peermem")?;
    ensure!(refused, "rmmod succeeded with a live registration");
    ensure!(
        ctx.core.query(h).map_err(errno_name)?.state == PMC_STATE_MAPPED,
        "MR disturbed by rmmod"
    );
    ctx.core.dereg(h).map_err(errno_name)?;
    ensure!(
        module::rmmod("nvidia_peermem")?,
        "rmmod refused after deregistration"
    );
    ctx.load()?;
    Ok("refused while live, accepted after".into())
}

fn bad_input(ctx: &mut Ctx) -> Result<String, String> {
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    expect_err(
        ctx.core.reg(a.va, 0, PMC_REG_INVAL_SUPP),
        libc::EINVAL,
        "zero length",
    )?;
    expect_err(
        ctx.core.reg(u64::MAX - 4096, 8192, PMC_REG_INVAL_SUPP),
        libc::EINVAL,
        "overflowing range",
    )?;
    let np0 = stat("fail_not_pci");
    let r = ctx
        .core
        .reg(a.va, M, PMC_REG_INVAL_SUPP | PMC_REG_NON_PCI_DEV);
    if ctx.opts.reference {
        if let Ok(h) = r {
            ctx.core.dereg(h).map_err(errno_name)?;
            return Err("non-PCI dma_device accepted".into());
        }
    } else {
        expect_err(r, libc::EINVAL, "non-PCI dma_device")?;
        ensure!(stat("fail_not_pci") == np0 + 1, "fail_not_pci counter");
    }
    // Still works afterwards.
    reg_verify(ctx, &a, 0, M, PMC_REG_INVAL_SUPP)?;
    Ok("zero length, overflow, non-PCI device refused".into())
}

fn provider_failures(ctx: &mut Ctx) -> Result<String, String> {
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    let pin_fn = if ctx.mode.invalidating() {
        "get_pages"
    } else {
        "get_pages_persistent"
    };
    let mut seen = Vec::new();
    // (function, injected errno, what user space must see from our module)
    let cases: [(&str, i32, i32); 5] = [
        (pin_fn, libc::ENOMEM, libc::ENOMEM),
        (pin_fn, libc::EINVAL, libc::EFAULT),
        // The persistent API refused (MIG, vGPU): "Operation not supported".
        (pin_fn, 524, libc::EOPNOTSUPP),
        ("dma_map_pages", 524, libc::EOPNOTSUPP),
        ("dma_map_pages", libc::ENOMEM, libc::ENOMEM),
    ];
    for (func, inj, want) in cases {
        // Invalidating MRs are mapped by our module itself (no GPU driver
        // lock under the core's mapping lock): the GPU driver's DMA mapping
        // is exercised through the persistent client, for ours.
        let flags = if func == "dma_map_pages" && ctx.mode.invalidating() && !ctx.opts.reference {
            0
        } else {
            PMC_REG_INVAL_SUPP
        };
        module::inject(func, 1, inj)?;
        let r = ctx.core.reg(a.va, M, flags);
        module::inject(func, 0, inj)?;
        if ctx.mode.invalidating() && func == "get_pages" && (inj == libc::EINVAL || inj == 524) {
            // nv_mem declines what its provider calls foreign; the core then
            // asks nv_mem_nc, whose persistent pin succeeds.
            let h = r.map_err(|e| format!("fallback to nv_mem_nc: {}", errno_name(e)))?;
            let q = ctx.core.query(h).map_err(errno_name)?;
            ctx.core.dereg(h).map_err(errno_name)?;
            ensure!(
                q.client_name() == "nv_mem_nc",
                "fallback went to {}",
                q.client_name()
            );
            seen.push(format!("{func}:-{inj}->nv_mem_nc"));
            continue;
        }
        match r {
            Ok(h) => {
                ctx.core.dereg(h).map_err(errno_name)?;
                return Err(format!(
                    "{func} failing with -{inj}: registration succeeded"
                ));
            }
            Err(e) => {
                seen.push(format!("{func}:-{inj}->{e}"));
                if !ctx.opts.reference && e != want {
                    return Err(format!(
                        "{func} failing with -{inj}: user got {}, expected {}",
                        errno_name(e),
                        errno_name(want)
                    ));
                }
                if e == 524 {
                    return Err(format!("{func}: ENOTSUPP (524) leaked to user space"));
                }
            }
        }
        let gi = ctx.gpu().info();
        ensure!(
            gi.live_tables == 0 && gi.live_mappings == 0,
            "{func} failure leaked pins/mappings"
        );
    }
    reg_verify(ctx, &a, 0, M, PMC_REG_INVAL_SUPP)?;
    Ok(seen.join(" "))
}

fn page_table_versions(ctx: &mut Ctx) -> Result<String, String> {
    let mut out = Vec::new();
    let cases: [(&str, Option<i32>); 5] = [
        ("page_table_version=0x00020000", None),
        ("page_table_version=0x00010001", Some(libc::EOPNOTSUPP)),
        ("page_table_version=0x00030000", Some(libc::EOPNOTSUPP)),
        ("dma_mapping_version=0x00010003", Some(libc::EOPNOTSUPP)),
        ("page_size_type=2", Some(libc::EOPNOTSUPP)),
    ];
    for (arg, want) in cases {
        ctx.reload_provider(&[arg])?;
        let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
        match want {
            None => {
                reg_verify(ctx, &a, 0, M, PMC_REG_INVAL_SUPP)?;
                out.push(format!("{arg}: accepted"));
            }
            Some(e) => {
                // Our invalidating MRs never use the GPU driver's DMA
                // mapping: its version is checked on the persistent client.
                let flags = if arg.starts_with("dma_mapping") && ctx.mode.invalidating() {
                    0
                } else {
                    PMC_REG_INVAL_SUPP
                };
                expect_err(ctx.core.reg(a.va, M, flags), e, arg)?;
                let gi = ctx.gpu().info();
                ensure!(
                    gi.live_tables == 0 && gi.live_mappings == 0,
                    "{arg}: refusal leaked"
                );
                out.push(format!("{arg}: refused"));
            }
        }
    }
    ctx.reload_provider(&[])?;
    Ok(out.join(", "))
}

fn bar1_exhaustion(ctx: &mut Ctx) -> Result<String, String> {
    ctx.reload_provider(&["bar1_size_mb=2"])?;
    let a = ctx.gpu().alloc(0, 4 * M).map_err(errno_name)?;
    let h = ctx
        .core
        .reg(a.va, M + K64, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    let r = ctx.core.reg(a.va + 2 * M, 2 * M, PMC_REG_INVAL_SUPP);
    ctx.core.dereg(h).map_err(errno_name)?;
    let got = match r {
        Ok(h2) => {
            ctx.core.dereg(h2).map_err(errno_name)?;
            return Err("registration beyond BAR1 succeeded".into());
        }
        Err(e) => e,
    };
    if !ctx.opts.reference {
        ensure!(
            got == libc::ENOMEM,
            "BAR1 exhausted: user got {}, expected ENOMEM",
            errno_name(got)
        );
    }
    drop(a);
    ctx.reload_provider(&[])?;
    Ok(format!("beyond BAR1: {}", errno_name(got)))
}

fn free_races_pin(ctx: &mut Ctx) -> Result<String, String> {
    let rounds = if ctx.opts.quick { 2 } else { 6 };
    let (mut failed_reg, mut invalidated) = (0, 0);
    for _ in 0..rounds {
        let mut a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
        module::debugfs_write("/sys/kernel/debug/nv_p2p_emu/race_free_on_pin", "1")?;
        match ctx.core.reg(a.va, M, PMC_REG_INVAL_SUPP) {
            Err(e) => {
                ensure!(
                    e == libc::EFAULT || e == libc::EINVAL,
                    "racing free: {}",
                    errno_name(e)
                );
                failed_reg += 1;
            }
            Ok(h) => {
                let t = Instant::now();
                loop {
                    let q = ctx.core.query(h).map_err(errno_name)?;
                    if q.revoked == 1 {
                        break;
                    }
                    ensure!(
                        t.elapsed() < Duration::from_secs(5),
                        "free never invalidated the MR"
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                expect_err(
                    ctx.core.dma_read(h, 0, 16),
                    libc::EACCES,
                    "DMA after racing free",
                )?;
                ctx.core.dereg(h).map_err(errno_name)?;
                invalidated += 1;
            }
        }
        a.unmap();
    }
    module::debugfs_write("/sys/kernel/debug/nv_p2p_emu/race_free_on_pin", "0")?;
    Ok(format!(
        "{failed_reg} registrations lost the race, {invalidated} invalidated right after"
    ))
}

fn slow_free_callback(ctx: &mut Ctx) -> Result<String, String> {
    module::debugfs_write("/sys/kernel/debug/nv_p2p_emu/free_delay_ms", "200")?;
    let r = free_under_mr(ctx, |_, a| a.unmap());
    module::debugfs_write("/sys/kernel/debug/nv_p2p_emu/free_delay_ms", "0")?;
    r
}

fn contiguous_1g(ctx: &mut Ctx) -> Result<String, String> {
    const G: u64 = 1 << 30;
    let a = ctx
        .gpu()
        .alloc(0, G)
        .map_err(|e| format!("alloc 1 GiB: {}", errno_name(e)))?;
    let t = Instant::now();
    let h = ctx
        .core
        .reg(a.va, G, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    let reg_ms = t.elapsed().as_millis();
    let q = ctx.core.query(h).map_err(errno_name)?;
    let seed = ctx.rand();
    ctx.core
        .dma_write(h, G - 64, &pattern(seed, 0, 64))
        .map_err(errno_name)?;
    ensure!(
        a.read(G - 64, 64) == pattern(seed, 0, 64),
        "last bytes of the 1 GiB MR wrong"
    );
    ctx.core.dereg(h).map_err(errno_name)?;
    ensure!(q.nmap == 1, "{} SG entries for 1 GiB contiguous", q.nmap);
    ensure!(q.first_len == G, "first entry {:#x} bytes", q.first_len);
    Ok(format!(
        "1 GiB: {} SG entry (C module: {}); registration {reg_ms} ms",
        q.nmap,
        G / K64
    ))
}

/// Binds (`bind`) or unbinds the HCA from the core's driver.
fn hca_driver(hca: &str, bind: bool) -> Result<(), String> {
    let f = format!(
        "/sys/bus/pci/drivers/peer_mem_core_hca/{}",
        if bind { "bind" } else { "unbind" }
    );
    std::fs::write(&f, hca).map_err(|e| format!("{f} {hca}: {e}"))
}

/// DMA-API debug is built in but has turned itself off (after an allocation
/// of its own failed): it checks nothing any more.
fn dma_debug_off() -> bool {
    std::fs::read_to_string("/sys/kernel/debug/dma-api/disabled").is_ok_and(|v| v.trim() == "Y")
}

/// DMA-API debug's reports of mappings left when a driver let go of its
/// device, so far.
fn leaked_at_unbind() -> usize {
    std::process::Command::new("dmesg")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .matches("pending DMA allocations while released")
                .count()
        })
        .unwrap_or(0)
}

/// The lines of the module's view `name` (sysfs `stats/gpus`, `stats/paths`).
fn view_lines(name: &str) -> Vec<String> {
    module::view(name)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn gpu_lines() -> Vec<String> {
    view_lines("gpus")
}

fn pair_lines() -> Vec<String> {
    view_lines("paths")
}

/// A GPU loses its driver and gets it back while another GPU's
/// registrations go on. The GPU driver's unbind waits until none of the
/// GPU's memory is in use (so the MR on it is revoked first); the GPU's
/// record and pairs go with the unbind, and its first registration after the
/// rebind records it anew (a rebind may bring another BAR): topology verdict
/// and DMA, also for two first registrations at once.
fn gpu_rebind(ctx: &mut Ctx) -> Result<String, String> {
    let mut a0 = ctx.gpu().alloc(0, 2 * M).map_err(errno_name)?;
    let a1 = ctx.gpu().alloc(1, 2 * M).map_err(errno_name)?;
    let h0 = ctx
        .core
        .reg(a0.va, M, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    let gpu0 = gpu_lines()
        .iter()
        .find(|l| l.contains(" live=1 "))
        .and_then(|l| {
            l.split_whitespace()
                .next()?
                .strip_prefix("gpu=")
                .map(str::to_string)
        })
        .ok_or("GPU 0's record not found")?;
    // Both pairs are recorded before the unbind.
    let h1 = ctx
        .core
        .reg(a1.va, M, PMC_REG_INVAL_SUPP)
        .map_err(errno_name)?;
    ctx.core.dereg(h1).map_err(errno_name)?;
    let drv = "/sys/bus/pci/drivers/nv_p2p_emu";
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (traffic, unbound, still_bound) = std::thread::scope(|sc| -> Result<_, String> {
        let traffic = sc.spawn(|| -> Result<u64, String> {
            let core = Core::open()?;
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let h = core.reg(a1.va, M, PMC_REG_INVAL_SUPP).map_err(errno_name)?;
                let b = [n as u8; 64];
                let moved = core.dma_write(h, 0, &b);
                core.dereg(h).map_err(errno_name)?;
                moved.map_err(errno_name)?;
                ensure!(a1.read(0, 64) == b, "GPU 1's DMA went elsewhere");
                n += 1;
            }
            Ok(n)
        });
        // Not scoped: a GPU driver that never lets go must not hang the run.
        let mark = hostile::LogMark::new();
        let (tx, rx) = std::sync::mpsc::channel();
        let (path, bdf) = (format!("{drv}/unbind"), gpu0.clone());
        std::thread::spawn(move || tx.send(std::fs::write(path, bdf)));
        let waiting = || {
            mark.since()
                .iter()
                .any(|l| l.contains("non-zero usage count") && l.contains(&gpu0))
        };
        let t = std::time::Instant::now();
        while !waiting() && t.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let still_bound = waiting() && rx.try_recv().is_err();
        // The GPU memory is freed: the MR is revoked (a persistent pin keeps
        // the memory until its MR goes), the unbind goes on.
        a0.unmap();
        let dereg = (!ctx.mode.invalidating()).then(|| ctx.core.dereg(h0));
        let unbound = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .map_err(|_| {
                "DEADLOCK: the GPU's unbind did not return after its memory was freed".to_string()
            });
        // Whatever happens next, the traffic stops before the scope ends.
        let after = || -> Result<_, String> {
            let unbound = unbound?;
            let gone = (gpu_lines(), pair_lines());
            std::fs::write(format!("{drv}/bind"), &gpu0)
                .map_err(|e| format!("bind {gpu0}: {e}"))?;
            std::thread::sleep(std::time::Duration::from_millis(100));
            Ok((unbound, gone))
        };
        let r = after();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let traffic = traffic.join().map_err(|_| "traffic thread")?;
        let (unbound, gone) = r?;
        // Quiet now. Two first registrations on the rebound GPU at once:
        // one records it (and learns its topology verdict), the other finds
        // that record; both map, and their bytes move.
        let a = ctx.gpu().alloc(0, 2 * M).map_err(errno_name)?;
        let probes = stat("topology_probes");
        let firsts: Vec<Result<(), String>> = std::thread::scope(|sc| {
            let hs: Vec<_> = [0, M]
                .into_iter()
                .map(|off| sc.spawn(move || first_registration(a.va + off)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
                .collect()
        });
        for r in firsts {
            r.map_err(|e| format!("a first registration on GPU 0 after the rebind: {e}"))?;
        }
        let relearnt = stat("topology_probes") - probes;
        for off in [0, 256] {
            ensure!(
                a.read(off * 4096, 64) == [0xa5; 64],
                "DMA through a first registration went elsewhere"
            );
        }
        reg_verify(ctx, &a1, 0, M, PMC_REG_INVAL_SUPP)?;
        reg_verify(ctx, &a, 0, M, PMC_REG_INVAL_SUPP)
            .map_err(|e| format!("GPU 0 after the rebind: {e}"))?;
        Ok(((traffic, gone, relearnt), unbound, (still_bound, dereg)))
    })?;
    let (still_bound, dereg) = still_bound;
    let (ops, (gpus, pairs), relearnt) = traffic;
    let ops = ops.map_err(|e| format!("traffic on GPU 1: {e}"))?;
    unbound.map_err(|e| format!("unbind {gpu0}: {e}"))?;
    match dereg {
        Some(r) => r.map_err(errno_name)?,
        None => ctx.core.dereg(h0).map_err(errno_name)?,
    }
    ensure!(
        still_bound,
        "the GPU driver's unbind did not wait for the memory in use"
    );
    ensure!(
        ops > 0,
        "no registration on GPU 1 during the unbind and rebind"
    );
    ensure!(
        !gpus.iter().any(|l| l.contains(&gpu0)) && !pairs.iter().any(|l| l.contains(&gpu0)),
        "GPU {gpu0} is still recorded after its unbind: {gpus:?} {pairs:?}"
    );
    ensure!(
        gpu_lines().iter().any(|l| l.contains(&gpu0)),
        "GPU {gpu0} not recorded after the rebind"
    );
    if ctx.mode.invalidating() {
        ensure!(relearnt == 1, "{relearnt} topology probes after the rebind");
    }
    Ok(format!(
        "{ops} registrations on GPU 1 meanwhile; GPU {gpu0} recorded anew"
    ))
}

/// One MR of a MiB at `va` through a core file of its own: registered, 64
/// bytes of 0xa5 written through it, deregistered.
fn first_registration(va: u64) -> Result<(), String> {
    let core = Core::open()?;
    let h = core.reg(va, M, PMC_REG_INVAL_SUPP).map_err(errno_name)?;
    let moved = core.dma_write(h, 0, &[0xa5; 64]);
    core.dereg(h).map_err(errno_name)?;
    moved.map_err(errno_name)
}

/// More GPU/HCA pairs than the pair table has slots (`pair_table_slots=1`,
/// two GPUs): the path policy refuses the pair without a slot as it refuses
/// the one with it (never a silent yes), a pair without a slot maps under a
/// policy that allows it, and the slot of a pair whose HCA lost its driver
/// goes to the next pair.
fn pair_table_full(ctx: &mut Ctx) -> Result<String, String> {
    let r = pair_table_steps(ctx);
    let reloaded = ctx.unload().and_then(|()| ctx.load());
    r.and_then(|d| reloaded.map(|()| d))
}

fn pair_table_steps(ctx: &mut Ctx) -> Result<String, String> {
    let hca = hostile::hca_device().ok_or("no HCA bound to the core's driver")?;
    let a = ctx.gpu().alloc(0, M).map_err(errno_name)?;
    let b = ctx.gpu().alloc(1, M).map_err(errno_name)?;
    // PHB paths (the default layout) are worse than PXB: both refused.
    hostile::reload_with(ctx, &["pair_table_slots=1", "path_policy=2"])?;
    expect_err(
        ctx.core.reg(a.va, M, PMC_REG_INVAL_SUPP),
        libc::EPERM,
        "GPU 0, with a slot",
    )?;
    expect_err(
        ctx.core.reg(b.va, M, PMC_REG_INVAL_SUPP),
        libc::EPERM,
        "GPU 1, without a slot",
    )?;
    ensure!(
        stat("fail_path_policy") == 2,
        "{} policy refusals",
        stat("fail_path_policy")
    );
    let lines = pair_lines();
    ensure!(
        lines.len() == 1 && lines[0].contains("policy_refusals=1"),
        "paths with one slot: {lines:?}"
    );
    // A policy that allows every path: the pair without a slot maps.
    hostile::reload_with(ctx, &["pair_table_slots=1"])?;
    ctx.settle()?;
    reg_verify(ctx, &a, 0, M, PMC_REG_INVAL_SUPP)?;
    let first = pair_lines();
    reg_verify(ctx, &b, 0, M, PMC_REG_INVAL_SUPP)?;
    ensure!(
        pair_lines() == first,
        "the pair without a slot took one: {:?}",
        pair_lines()
    );
    // The HCA loses its driver: its pair's slot is free for GPU 1's.
    hca_driver(&hca, false)?;
    let gone = pair_lines();
    hca_driver(&hca, true)?;
    ensure!(gone.is_empty(), "pairs of an unbound HCA left: {gone:?}");
    reg_verify(ctx, &b, 0, M, PMC_REG_INVAL_SUPP)?;
    let reused = pair_lines();
    let gpu_of = |l: &str| l.split_whitespace().next().unwrap_or("").to_string();
    ensure!(
        reused.len() == 1 && first.len() == 1 && gpu_of(&reused[0]) != gpu_of(&first[0]),
        "slot not reused: before {first:?}, after {reused:?}"
    );
    ensure!(
        reused[0].contains("registrations=1 ") && reused[0].contains(" failures=0 "),
        "the reused slot kept the old pair's counts: {}",
        reused[0]
    );
    Ok(format!(
        "policy held without a slot; slot reused: {}",
        gpu_of(&reused[0])
    ))
}

/// Contiguous MRs of 4 MiB, 4 MiB + 64 KiB and 64 MiB are each mapped as one
/// run (one DMA mapping, one scatterlist entry, whether or not an IOMMU
/// translates the HCA's DMA), with their bytes moved; the client reads the
/// page table outside any spinlock, so no section with preemption off grows
/// with the MR.
fn large_mrs_one_entry(ctx: &mut Ctx) -> Result<String, String> {
    let a = ctx.gpu().alloc(0, 64 * M).map_err(errno_name)?;
    let mut seen = Vec::new();
    for len in [4 * M, 4 * M + K64, 64 * M] {
        let q = reg_verify(ctx, &a, 0, len, PMC_REG_INVAL_SUPP)?;
        ensure!(q.nmap == 1, "{} KiB: {} entries", len >> 10, q.nmap);
        seen.push(format!("{}K:{}", len >> 10, q.nmap));
    }
    Ok(seen.join(" "))
}

/// One round of `hca_rebind` with the HCA's current IOMMU setting.
fn rebind_round(ctx: &mut Ctx, hca: &str) -> Result<String, String> {
    let how = if hostile::iommu_translates() {
        "translated"
    } else {
        "untranslated"
    };
    let mut a = ctx.gpu().alloc(0, 2 * M).map_err(errno_name)?;
    let q = reg_verify(ctx, &a, K64, M, PMC_REG_INVAL_SUPP)?;
    ensure!(q.nmap == 1, "{} entries (HCA DMA {how})", q.nmap);
    ensure!(
        !dma_debug_off(),
        "DMA-API debug is off: it would not report a mapping left at unbind"
    );
    // The HCA loses its driver: every MR's mapping went with its MR, so
    // DMA-API debug finds none left on it; its pair's record goes too.
    let leaks0 = leaked_at_unbind();
    hca_driver(hca, false)?;
    let pairs = pair_lines();
    hca_driver(hca, true)?;
    ensure!(
        leaked_at_unbind() == leaks0,
        "DMA-API debug found mappings left on the HCA at unbind"
    );
    ensure!(
        !pairs.iter().any(|l| l.contains(&format!("hca={hca}"))),
        "the HCA's pairs are still recorded after its unbind: {pairs:?}"
    );
    // Rebound: the next MR is mapped anew, and its bytes move.
    let q = reg_verify(ctx, &a, 0, 2 * M, PMC_REG_INVAL_SUPP)?;
    ensure!(
        q.nmap == 1,
        "after the rebind, {} entries (HCA DMA {how})",
        q.nmap
    );
    a.unmap();
    Ok(how.to_string())
}

/// The HCA loses its driver and gets it back: nothing of this module's is
/// left mapped on it, its pairs' records go, and the next MR is mapped
/// anew; also when the IOMMU group's type changed meanwhile (then the same
/// HCA runs translated and untranslated).
fn hca_rebind(ctx: &mut Ctx) -> Result<String, String> {
    let hca = hostile::hca_device().ok_or("no HCA bound to the core's driver")?;
    let mut out = vec![rebind_round(ctx, &hca)?];
    let type_file = format!("/sys/bus/pci/devices/{hca}/iommu_group/type");
    if let Ok(t) = std::fs::read_to_string(&type_file) {
        let orig = t.trim().to_string();
        let other = if matches!(orig.as_str(), "DMA" | "DMA-FQ") {
            "identity"
        } else {
            "DMA"
        };
        let switch = |to: &str| -> Result<(), String> {
            hca_driver(&hca, false)?;
            let set = std::fs::write(&type_file, to).map_err(|e| {
                let group =
                    std::fs::read_dir(format!("/sys/bus/pci/devices/{hca}/iommu_group/devices"))
                        .map(|d| d.filter_map(|e| e.ok()).count())
                        .unwrap_or(0);
                format!("{type_file} <- {to}: {e} ({group} devices in the group)")
            });
            let bound = hca_driver(&hca, true);
            set.and(bound)
        };
        switch(other)?;
        let r = rebind_round(ctx, &hca);
        switch(&orig)?;
        out.push(r?);
        out.push(rebind_round(ctx, &hca)?);
    }
    Ok(out.join("; "))
}
