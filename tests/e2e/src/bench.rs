// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `peermem-e2e bench`: one implementation's numbers for `make bench`.
//!
//! Times are taken in the guest with CLOCK_MONOTONIC around the ioctls;
//! provider calls come from the emulated driver's counters, kernel memory from
//! /proc/meminfo and /proc/zoneinfo after `vm.stat_refresh`. Prints one JSON object per line (`BENCH {...}`), which
//! scripts/bench pairs across implementations and rounds.

use std::time::Instant;

use crate::{dev::Core, dev::Gpu, uapi::*};

const K64: u64 = 64 << 10;
const M: u64 = 1 << 20;

pub(crate) fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Kernel memory counters, in bytes, taken after folding the per-CPU vmstat
/// deltas into the global counters (`vm.stat_refresh`).
#[derive(Clone, Copy, Default)]
pub(crate) struct KernelMem {
    /// Slab memory (SReclaimable + SUnreclaim).
    slab: i64,
    /// vmalloc space in use.
    vmalloc: i64,
    /// Every page not free, not counting free pages parked on the per-CPU
    /// lists (those would otherwise swamp small deltas): slab, vmalloc and
    /// raw page allocations such as scatterlist chunks.
    pub(crate) pages: i64,
}

/// Empties every slab cache's per-CPU and per-node caches of free objects
/// (`/sys/kernel/slab/*/shrink`: sheaves, barn, per-CPU partial slabs) and
/// frees its empty slabs. Freed objects parked there keep their pages
/// counted, and a cache shared with the rest of the kernel (kmalloc-*)
/// parks more of them than a module's own cache: without this, the pages a
/// hold needs depend on how many freed objects each cache happened to park.
fn shrink_slabs() {
    let Ok(dir) = std::fs::read_dir("/sys/kernel/slab") else {
        return;
    };
    for e in dir.filter_map(|e| e.ok()) {
        // Aliases are symlinks to the same cache: shrink each cache once.
        if e.file_type().is_ok_and(|t| t.is_symlink()) {
            continue;
        }
        let _ = std::fs::write(e.path().join("shrink"), "1");
    }
}

pub(crate) fn kernel_mem() -> KernelMem {
    shrink_slabs();
    // Best effort: stat_refresh can refuse with EINVAL when a counter is
    // transiently negative; the fold has happened anyway.
    let _ = std::fs::write("/proc/sys/vm/stat_refresh", "1");
    let s = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<i64>().ok())
            .unwrap_or(0)
            * 1024
    };
    // Free pages on the per-CPU lists: "count: N" in each zone's pagesets.
    let pcp: i64 = std::fs::read_to_string("/proc/zoneinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("count:"))
        .filter_map(|v| v.trim().parse::<i64>().ok())
        .sum();
    KernelMem {
        slab: field("Slab:"),
        vmalloc: field("VmallocUsed:"),
        pages: field("MemTotal:") - field("MemFree:") - pcp * crate::page_size() as i64,
    }
}

/// Turns the harness's time accounting on or off (both modules).
fn set_timing(on: bool) -> Result<(), String> {
    for m in ["nv_p2p_emu", "peer_mem_core"] {
        let p = format!("/sys/module/{m}/parameters/bench_timing");
        std::fs::write(&p, if on { "1" } else { "0" }).map_err(|e| format!("{p}: {e}"))?;
    }
    Ok(())
}

/// Nanoseconds the emulated core has spent inside client callbacks.
fn client_ns() -> f64 {
    std::fs::read_to_string("/sys/module/peer_mem_core/parameters/client_ns")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN)
}

pub(crate) fn emit(imp: &str, cost: &str, metric: &str, key: &str, value: f64) {
    println!("BENCH {{\"impl\":\"{imp}\",\"cost\":\"{cost}\",\"metric\":\"{metric}\",\"key\":\"{key}\",\"value\":{value}}}");
}

/// Live registrations held for the memory figures: enough that the per-MR
/// share stands well above page granularity and background noise.
fn live_for(size: u64) -> usize {
    match size {
        s if s <= K64 => 4000,
        s if s <= 2 * M => 1000,
        s if s <= 64 * M => 128,
        _ => 32,
    }
}

pub(crate) fn errno(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

/// Runs the workload for implementation `imp` ("ours" or "C").
pub fn run(imp: &str, cost: &str, live_counts: &[u64]) -> Result<(), String> {
    let g = Gpu::open()?;
    let c = Core::open()?;
    let flags = [("invalidating", PMC_REG_INVAL_SUPP), ("persistent", 0)];
    let sizes: [(u64, usize, &str); 4] = [
        (K64, 40, "64K"),
        (2 * M, 20, "2M"),
        (64 * M, 11, "64M"),
        (1 << 30, 11, "1G"),
    ];
    let a = g.alloc(0, 1 << 30).map_err(errno)?;
    for (fname, f) in flags {
        for (size, reps, sname) in sizes {
            let key = format!("{fname}/{sname}");
            let (mut reg, mut dereg) = (Vec::new(), Vec::new());
            // Untimed first: the first registrations after loading a module
            // run code QEMU has not translated yet, and fill the caches.
            for _ in 0..reps.div_ceil(4) {
                let h = c.reg(a.va, size, f).map_err(errno)?;
                c.dereg(h).map_err(errno)?;
            }
            let i0 = g.info();
            let mut nmap = 0;
            for _ in 0..reps {
                let t = Instant::now();
                let h = c.reg(a.va, size, f).map_err(errno)?;
                reg.push(t.elapsed().as_secs_f64() * 1e6);
                nmap = c.query(h).map_err(errno)?.nmap;
                let t = Instant::now();
                c.dereg(h).map_err(errno)?;
                dereg.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let i1 = g.info();
            let pins =
                (i1.pins + i1.persistent_pins - i0.pins - i0.persistent_pins) as f64 / reps as f64;
            emit(imp, cost, "register_us", &key, median(&mut reg));
            emit(imp, cost, "deregister_us", &key, median(&mut dereg));
            // A second pass with the harness clocks on: the client's own time,
            // inside its callbacks (the core's clock) minus inside the
            // provider's calls (the provider's clock). A pass of its own
            // because clock reads are slow under TCG.
            // The floor (provider + core, which no client removes): the
            // same pass's end-to-end time minus the client's own time.
            // Like for like: the same plus the provider's time inside its
            // DMA-mapping calls (nvidia_p2p_dma_[un]map_pages), the mapping
            // work the C module leaves to the GPU driver and ours does itself
            // in invalidating mode (dma_map_resource, inside our own time).
            let (mut reg_own, mut dereg_own) = (Vec::new(), Vec::new());
            let (mut reg_map, mut dereg_map) = (Vec::new(), Vec::new());
            let (mut reg_floor, mut dereg_floor) = (Vec::new(), Vec::new());
            set_timing(true)?;
            let own = || {
                let i = g.info();
                let cl = client_ns();
                (cl - i.provider_ns as f64, i.provider_map_ns as f64)
            };
            for _ in 0..reps {
                let (o0, m0) = own();
                let t = Instant::now();
                let h = c.reg(a.va, size, f).map_err(errno)?;
                let wall = t.elapsed().as_secs_f64() * 1e6;
                let (o1, m1) = own();
                reg_own.push((o1 - o0) / 1e3);
                reg_map.push((o1 - o0 + m1 - m0) / 1e3);
                reg_floor.push(wall - (o1 - o0) / 1e3);
                let t = Instant::now();
                c.dereg(h).map_err(errno)?;
                let wall = t.elapsed().as_secs_f64() * 1e6;
                let (o2, m2) = own();
                dereg_own.push((o2 - o1) / 1e3);
                dereg_map.push((o2 - o1 + m2 - m1) / 1e3);
                dereg_floor.push(wall - (o2 - o1) / 1e3);
            }
            set_timing(false)?;
            emit(
                imp,
                cost,
                "register_own_with_mapping_us",
                &key,
                median(&mut reg_map),
            );
            emit(
                imp,
                cost,
                "deregister_own_with_mapping_us",
                &key,
                median(&mut dereg_map),
            );
            emit(imp, cost, "register_floor_us", &key, median(&mut reg_floor));
            emit(
                imp,
                cost,
                "deregister_floor_us",
                &key,
                median(&mut dereg_floor),
            );
            emit(
                imp,
                cost,
                "register_client_own_us",
                &key,
                median(&mut reg_own),
            );
            emit(
                imp,
                cost,
                "deregister_client_own_us",
                &key,
                median(&mut dereg_own),
            );
            emit(imp, cost, "pins_per_registration", &key, pins);
            emit(
                imp,
                cost,
                "unpins_per_registration",
                &key,
                (i1.unpins - i0.unpins) as f64 / reps as f64,
            );
            emit(imp, cost, "sg_entries", &key, nmap as f64);
            if cost == "zero" {
                // Kernel memory per live registration: hold `live` of them,
                // compare the counters, subtract what the provider's page
                // tables and mappings hold (its exact byte counter; the same
                // for both clients). The rest is the client plus the core's
                // per-MR umem, which is the same for both clients.
                let live = live_for(size);
                // The same hold once, unmeasured: the first hold after a
                // pass grows the core's and the provider's slab caches
                // (kmalloc-512 umems, kmalloc-192 page tables) by new slab
                // pages that the next holds reuse, and would charge that
                // growth to whichever module is measured first (a slabinfo
                // diff in the guest showed 60-70 bytes per registration).
                let warm: Vec<u64> = (0..live)
                    .map(|_| c.reg(a.va, size, f))
                    .collect::<Result<_, _>>()
                    .map_err(errno)?;
                for h in warm {
                    c.dereg(h).map_err(errno)?;
                }
                let (m0, p0) = (kernel_mem(), g.info().provider_bytes as i64);
                let hs: Vec<u64> = (0..live)
                    .map(|_| c.reg(a.va, size, f))
                    .collect::<Result<_, _>>()
                    .map_err(errno)?;
                let (m1, p1) = (kernel_mem(), g.info().provider_bytes as i64);
                for h in hs {
                    c.dereg(h).map_err(errno)?;
                }
                let per = |v: i64| v as f64 / live as f64;
                let provider = p1 - p0;
                emit(
                    imp,
                    cost,
                    "kernel_slab_bytes_per_mr",
                    &key,
                    per(m1.slab - m0.slab),
                );
                emit(
                    imp,
                    cost,
                    "kernel_vmalloc_bytes_per_mr",
                    &key,
                    per(m1.vmalloc - m0.vmalloc),
                );
                emit(
                    imp,
                    cost,
                    "kernel_bytes_per_mr_total",
                    &key,
                    per(m1.pages - m0.pages),
                );
                emit(imp, cost, "provider_bytes_per_mr", &key, per(provider));
                emit(
                    imp,
                    cost,
                    "kernel_bytes_per_mr_without_provider",
                    &key,
                    per(m1.pages - m0.pages - provider),
                );
            }
        }
    }
    // Registrations per second, 1 and 2 threads (64 KiB MRs).
    for threads in [1usize, 2] {
        let secs = 2.0;
        let va = a.va;
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(move || {
                        let c = Core::open().expect("core");
                        let t = Instant::now();
                        let mut n = 0u64;
                        while t.elapsed().as_secs_f64() < secs {
                            let h = c.reg(va, K64, PMC_REG_INVAL_SUPP).expect("reg");
                            c.dereg(h).expect("dereg");
                            n += 1;
                        }
                        n
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        emit(
            imp,
            cost,
            "registrations_per_s",
            &format!("{threads} thread(s)"),
            total as f64 / secs,
        );
    }
    // Free-to-invalidated latency: munmap returns once the callbacks ran.
    let mut lat = Vec::new();
    for _ in 0..10 {
        let mut b = g.alloc(1, 2 * M).map_err(errno)?;
        let h = c.reg(b.va, 2 * M, PMC_REG_INVAL_SUPP).map_err(errno)?;
        let t = Instant::now();
        b.unmap();
        let us = t.elapsed().as_secs_f64() * 1e6;
        if c.query(h).map_err(errno)?.revoked != 1 {
            return Err("free did not invalidate".into());
        }
        c.dereg(h).map_err(errno)?;
        lat.push(us);
    }
    emit(imp, cost, "free_to_invalidated_us", "2M", median(&mut lat));
    // Per-operation cost with many live registrations (all on one 64 KiB
    // page: pins of one page share its BAR1 mapping).
    for &n in live_counts {
        let mut hs = Vec::with_capacity(n as usize);
        for _ in 0..n {
            hs.push(c.reg(a.va, K64, PMC_REG_INVAL_SUPP).map_err(errno)?);
        }
        let mut ops = Vec::new();
        for _ in 0..100 {
            let t = Instant::now();
            let h = c.reg(a.va + K64, K64, PMC_REG_INVAL_SUPP).map_err(errno)?;
            c.dereg(h).map_err(errno)?;
            ops.push(t.elapsed().as_secs_f64() * 1e6);
        }
        emit(
            imp,
            cost,
            "reg_dereg_us_with_live",
            &n.to_string(),
            median(&mut ops),
        );
        for h in hs {
            c.dereg(h).map_err(errno)?;
        }
    }
    Ok(())
}

/// One block of `make bench`'s interleaved measurement: the client's own
/// time at 64 KiB and 2 MiB (zero-cost provider), in both modes, as the
/// rounds measure it, with more registrations. Blocks of the two modules
/// alternate seconds apart, so that each pair of blocks runs at one speed
/// of TCG's (see `scripts/bench-report`). Emitted under cost `blocks`.
pub fn run_block(imp: &str) -> Result<(), String> {
    let g = Gpu::open()?;
    let c = Core::open()?;
    let flags = [("invalidating", PMC_REG_INVAL_SUPP), ("persistent", 0)];
    let sizes: [(u64, usize, &str); 2] = [(K64, 300, "64K"), (2 * M, 150, "2M")];
    let a = g.alloc(0, 2 * M).map_err(errno)?;
    let own = || client_ns() - g.info().provider_ns as f64;
    for (fname, f) in flags {
        for (size, reps, sname) in sizes {
            for _ in 0..reps.div_ceil(4) {
                let h = c.reg(a.va, size, f).map_err(errno)?;
                c.dereg(h).map_err(errno)?;
            }
            let (mut reg_own, mut dereg_own) = (Vec::new(), Vec::new());
            set_timing(true)?;
            for _ in 0..reps {
                let o0 = own();
                let h = c.reg(a.va, size, f).map_err(errno)?;
                let o1 = own();
                c.dereg(h).map_err(errno)?;
                let o2 = own();
                reg_own.push((o1 - o0) / 1e3);
                dereg_own.push((o2 - o1) / 1e3);
            }
            set_timing(false)?;
            let key = format!("{fname}/{sname}");
            emit(
                imp,
                "blocks",
                "register_client_own_us",
                &key,
                median(&mut reg_own),
            );
            emit(
                imp,
                "blocks",
                "deregister_client_own_us",
                &key,
                median(&mut dereg_own),
            );
        }
    }
    Ok(())
}

/// `count` registrations and deregistrations of `size` bytes, nothing else:
/// what `make bench` profiles with ftrace.
pub fn register_loop(size: u64, count: u64, mode: &str) -> Result<(), String> {
    let g = Gpu::open()?;
    let c = Core::open()?;
    let f = if mode == "persistent" {
        0
    } else {
        PMC_REG_INVAL_SUPP
    };
    let a = g.alloc(0, size.max(K64)).map_err(errno)?;
    // With the harness clocks on (bench_timing), the client's own time per
    // registration and deregistration, as `bench` measures it.
    let timed = std::fs::read_to_string("/sys/module/peer_mem_core/parameters/bench_timing")
        .is_ok_and(|s| s.trim() == "Y" || s.trim() == "1");
    let own = || client_ns() - g.info().provider_ns as f64;
    let (mut reg_own, mut dereg_own) = (Vec::new(), Vec::new());
    for _ in 0..count {
        let o0 = if timed { own() } else { 0.0 };
        let h = c.reg(a.va, size, f).map_err(errno)?;
        let o1 = if timed { own() } else { 0.0 };
        c.dereg(h).map_err(errno)?;
        if timed {
            let o2 = own();
            reg_own.push((o1 - o0) / 1e3);
            dereg_own.push((o2 - o1) / 1e3);
        }
    }
    if timed {
        println!(
            "LOOP {mode} {size}: own time register {:.3} us, deregister {:.3} us (medians of {count})",
            median(&mut reg_own),
            median(&mut dereg_own)
        );
    }
    Ok(())
}
