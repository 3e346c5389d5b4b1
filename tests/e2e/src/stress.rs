// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `peermem-e2e stress`: a seeded, randomized, concurrent workload.
//!
//! Each thread owns a pool of GPU allocations and registrations and runs
//! random operations on it (allocate, register with random unaligned bounds
//! and flags, deregister, free by munmap or ioctl, query, device DMA, a child
//! process killed with live registrations), checking every outcome against a
//! model of what must happen in the module's mode. Threads contend in the
//! kernel (provider, core and module locks). With the module under test, one
//! more thread drains it and ends the drain at random moments
//! (`/sys/module/nvidia_peermem/drain`): registrations it overlaps may be
//! refused, and invalidating ones made before it revoked. The seed is
//! printed; the same seed replays the same per-thread operation sequences.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst},
    time::{Duration, Instant},
};

use crate::{dev::Alloc, dev::Core, dev::Gpu, uapi::*, Mode};

const K64: u64 = 64 << 10;

/// Drains begun, and whether one is on (the drainer thread's).
static DRAINS: AtomicU64 = AtomicU64::new(0);
static DRAINING: AtomicBool = AtomicBool::new(false);

/// The drains begun so far, counting one that is on as not over.
fn drain_epoch() -> u64 {
    DRAINS.load(SeqCst) * 2 + u64::from(DRAINING.load(SeqCst))
}

struct Mr {
    handle: u64,
    alloc: usize,
    inval: bool,
    /// [`drain_epoch`] before it was registered: a drain since may have
    /// revoked it.
    epoch: u64,
    /// Registered length: the device may touch no more than this.
    len: u64,
}

struct Pool {
    allocs: Vec<Option<(Alloc, bool)>>, // (mapping, freed)
    mrs: Vec<Mr>,
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Operations carried out, by kind.
#[derive(Default, Clone, Copy)]
struct Counts {
    alloc: u64,
    reg: u64,
    dereg: u64,
    free: u64,
    query: u64,
    dma: u64,
    kill: u64,
    /// Registrations a drain refused.
    drained: u64,
}

impl Mr {
    /// Whether a drain may have revoked it (an invalidating registration of
    /// the invalidating client, made before a drain began).
    fn maybe_drained(&self, mode: Mode) -> bool {
        mode.invalidating() && self.inval && drain_epoch() > self.epoch
    }
}

fn worker(t: usize, ops: u64, seed: u64, mode: Mode, exe: &str) -> Result<Counts, String> {
    let mut n = Counts::default();
    let g = Gpu::open()?;
    let c = Core::open()?;
    let mut x = seed ^ ((t as u64 + 1) * 0x9e37_79b9_7f4a_7c15);
    let mut p = Pool {
        allocs: Vec::new(),
        mrs: Vec::new(),
    };
    let mut done = 0;
    while done < ops {
        let r = next(&mut x) % 1000;
        let e = |what: &str, err: i32| {
            format!("thread {t} op {done} {what}: errno {err} (seed {seed})")
        };
        // Allocations not freed yet, and freed (by ioctl) but still mapped.
        let live: Vec<usize> = (0..p.allocs.len())
            .filter(|&i| p.allocs[i].as_ref().is_some_and(|a| !a.1))
            .collect();
        let freed: Vec<usize> = (0..p.allocs.len())
            .filter(|&i| p.allocs[i].as_ref().is_some_and(|a| a.1))
            .collect();
        let pick = |x: &mut u64, v: &[usize]| v[(next(x) % v.len() as u64) as usize];
        if r < 120 && live.len() < 6 || live.is_empty() && r < 700 {
            let size = K64 * (1 + next(&mut x) % 32);
            let a = g
                .alloc(next(&mut x) % 2, size)
                .map_err(|err| e("alloc", err))?;
            p.allocs.push(Some((a, false)));
            n.alloc += 1;
        } else if r < 420 && p.mrs.len() < 24 {
            // register a random unaligned sub-range, now and then of freed memory
            let use_freed = !freed.is_empty() && next(&mut x) % 20 == 0;
            let i = if use_freed {
                pick(&mut x, &freed)
            } else {
                pick(&mut x, &live)
            };
            let (a, is_freed) = p.allocs[i].as_ref().unwrap();
            let off = next(&mut x) % a.size;
            let len = 1 + next(&mut x) % (a.size - off);
            let inval = next(&mut x) % 2 == 0;
            let epoch = drain_epoch();
            let res = c.reg(a.va + off, len, if inval { PMC_REG_INVAL_SUPP } else { 0 });
            let drained = epoch % 2 == 1 || drain_epoch() != epoch;
            n.reg += 1;
            match (res, *is_freed) {
                (Ok(h), false) => p.mrs.push(Mr {
                    handle: h,
                    alloc: i,
                    inval,
                    // A drain on while it registered may revoke it too.
                    epoch: epoch & !1,
                    len,
                }),
                (Err(libc::EFAULT), true) => {}
                // Refused by a drain: not claimed (the core's EFAULT), or
                // refused at `get_pages` (EBUSY) or `dma_map` (EFAULT).
                (Err(libc::EFAULT | libc::EBUSY), false) if drained => n.drained += 1,
                // OFED 4.x fails a registration its invalidate (the drain's)
                // came before the activation of with EINVAL itself.
                (Err(libc::EINVAL), false) if drained && mode == Mode::Ofed4 => n.drained += 1,
                (Ok(_), true) => return Err(e("register freed GPU memory succeeded", 0)),
                (Err(err), _) => return Err(e("reg", err)),
            }
        } else if r < 700 {
            if p.mrs.is_empty() {
                continue;
            }
            let i = (next(&mut x) % p.mrs.len() as u64) as usize;
            let mr = p.mrs.swap_remove(i);
            c.dereg(mr.handle).map_err(|err| e("dereg", err))?;
            n.dereg += 1;
        } else if r < 780 {
            // free an allocation: munmap or the free ioctl
            if live.is_empty() {
                continue;
            }
            let i = pick(&mut x, &live);
            n.free += 1;
            if next(&mut x) % 2 == 0 {
                p.allocs[i] = None; // drop = munmap
            } else {
                let (a, f) = p.allocs[i].as_mut().unwrap();
                g.free(a).map_err(|err| e("free", err))?;
                *f = true;
            }
            for mr in p.mrs.iter().filter(|m| m.alloc == i) {
                let q = c.query(mr.handle).map_err(|err| e("query", err))?;
                let revoke = mode.invalidating() && mr.inval;
                if (q.revoked == 1) != revoke && !mr.maybe_drained(mode) {
                    return Err(e(
                        &format!("after a free, revoked={} (inval {})", q.revoked, mr.inval),
                        0,
                    ));
                }
            }
        } else if r < 800 {
            if freed.is_empty() {
                continue;
            }
            let i = pick(&mut x, &freed);
            p.allocs[i] = None; // munmap what the ioctl freed
            n.free += 1;
        } else if r < 998 {
            // query every MR against the model
            n.query += 1;
            for mr in &p.mrs {
                let q = c.query(mr.handle).map_err(|err| e("query", err))?;
                let gone = p.allocs[mr.alloc].as_ref().is_none_or(|a| a.1);
                let want_revoked = gone && mode.invalidating() && mr.inval;
                if (q.revoked == 1) != want_revoked && !(q.revoked == 1 && mr.maybe_drained(mode)) {
                    return Err(e(
                        &format!("MR revoked={} expected {want_revoked}", q.revoked),
                        0,
                    ));
                }
            }
        } else if r < 999 {
            // the device moves bytes through a random MR
            if p.mrs.is_empty() {
                continue;
            }
            let mr = &p.mrs[(next(&mut x) % p.mrs.len() as u64) as usize];
            let q = c.query(mr.handle).map_err(|err| e("query", err))?;
            // At most 8 bytes: an MR can be shorter (the core refuses a DMA
            // past its end with EINVAL).
            let res = c.dma_read(mr.handle, 0, mr.len.min(8) as usize);
            n.dma += 1;
            match (res, q.revoked) {
                (Ok(_), 0) | (Err(libc::EACCES), 1) => {}
                // A drain revoked it since the query.
                (Err(libc::EACCES), 0) if mr.maybe_drained(mode) => {}
                (r, rev) => return Err(e(&format!("DMA {r:?} on MR revoked={rev}"), 0)),
            }
            // Past the end of a short MR: refused, whatever its state.
            if mr.len < 8 {
                let past = c.dma_read(mr.handle, 0, 8);
                if past != Err(libc::EINVAL) {
                    return Err(e(
                        &format!("DMA past the end of a {}-byte MR: {past:?}", mr.len),
                        0,
                    ));
                }
            }
        } else {
            // a child with live registrations, killed
            let epoch = drain_epoch();
            let mut child = Command::new(exe)
                .arg("child-hold")
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|err| format!("spawn child: {err}"))?;
            let mut line = String::new();
            BufReader::new(child.stdout.as_mut().unwrap())
                .read_line(&mut line)
                .map_err(|err| err.to_string())?;
            child.kill().map_err(|err| err.to_string())?;
            n.kill += 1;
            child.wait().map_err(|err| err.to_string())?;
            let drained = epoch % 2 == 1 || drain_epoch() != epoch;
            if line.trim() != "ready" && !drained {
                return Err(format!("thread {t}: child could not register: {line}"));
            }
        }
        // Draws that found nothing to do (`continue`) are not counted.
        done += 1;
    }
    for mr in p.mrs.drain(..) {
        c.dereg(mr.handle)
            .map_err(|err| format!("final dereg: {err}"))?;
    }
    Ok(n)
}

const DRAIN: &str = "/sys/module/nvidia_peermem/drain";

/// Drains the module and ends the drain at random moments until `stop`.
fn drainer(seed: u64, stop: &AtomicBool) -> Result<(), String> {
    let mut x = seed ^ 0xd1a1_d1a1;
    let write = |v: &str| std::fs::write(DRAIN, v).map_err(|e| format!("drainer: {DRAIN}: {e}"));
    while !stop.load(SeqCst) {
        std::thread::sleep(Duration::from_millis(20 + next(&mut x) % 200));
        DRAINING.store(true, SeqCst);
        write("1")?;
        std::thread::sleep(Duration::from_millis(next(&mut x) % 30));
        write("0")?;
        DRAINS.fetch_add(1, SeqCst);
        DRAINING.store(false, SeqCst);
    }
    Ok(())
}

/// Runs `ops` operations over `threads` threads (and, with `drain`, the
/// drainer); prints the rate.
pub fn run(mode: Mode, ops: u64, threads: usize, seed: u64, drain: bool) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let exe = exe.to_string_lossy().into_owned();
    let t0 = Instant::now();
    let per = ops / threads as u64;
    let (d0, stop) = (DRAINS.load(SeqCst), AtomicBool::new(false));
    let (results, drained) = std::thread::scope(|s| {
        let d = drain.then(|| s.spawn(|| drainer(seed, &stop)));
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let exe = exe.clone();
                s.spawn(move || worker(t, per, seed, mode, &exe))
            })
            .collect();
        let results: Vec<Result<Counts, String>> = hs
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("stress thread panicked".into()))
            })
            .collect();
        stop.store(true, SeqCst);
        let drained = d.map_or(Ok(()), |d| {
            d.join().unwrap_or_else(|_| Err("drainer panicked".into()))
        });
        (results, drained)
    });
    drained?;
    let drains = DRAINS.load(SeqCst) - d0;
    let mut n = Counts::default();
    for r in results {
        let c = r?;
        n.alloc += c.alloc;
        n.reg += c.reg;
        n.dereg += c.dereg;
        n.free += c.free;
        n.query += c.query;
        n.dma += c.dma;
        n.kill += c.kill;
        n.drained += c.drained;
    }
    let total = n.alloc + n.reg + n.dereg + n.free + n.query + n.dma + n.kill;
    let secs = t0.elapsed().as_secs_f64();
    Ok(format!(
        "{total} operations in {secs:.1} s ({:.0} ops/s; {} alloc, {} reg, {} dereg, {} free, {} query, {} DMA, {} killed children), {threads} threads, {drains} drains ({} registrations refused by them), seed {seed}",
        total as f64 / secs,
        n.alloc, n.reg, n.dereg, n.free, n.query, n.dma, n.kill, n.drained
    ))
}

/// The child of the kill operation: registers, says so, waits to be killed.
pub fn child_hold() -> ! {
    let r = (|| -> Option<()> {
        let g = Gpu::open().ok()?;
        let c = Core::open().ok()?;
        let a = g.alloc(0, 4 * K64).ok()?;
        c.reg(a.va, 2 * K64, PMC_REG_INVAL_SUPP).ok()?;
        c.reg(a.va + K64, 3 * K64, 0).ok()?;
        std::mem::forget((g, c, a));
        Some(())
    })();
    println!("{}", if r.is_some() { "ready" } else { "failed" });
    loop {
        std::thread::park();
    }
}
