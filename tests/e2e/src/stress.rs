// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `peermem-e2e stress`: a seeded, randomized, concurrent workload.
//!
//! Each thread owns a pool of GPU allocations and registrations and runs
//! random operations on it (allocate, register with random unaligned bounds
//! and flags, deregister, free by munmap or ioctl, query, device DMA, a child
//! process killed with live registrations), checking every outcome against a
//! model of what must happen in the module's mode. Threads contend in the
//! kernel (provider, core and module locks). The seed is printed; the same
//! seed replays the same per-thread operation sequences.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Instant,
};

use crate::{dev::Alloc, dev::Core, dev::Gpu, uapi::*, Mode};

const K64: u64 = 64 << 10;

struct Mr {
    handle: u64,
    alloc: usize,
    inval: bool,
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

fn worker(t: usize, ops: u64, seed: u64, mode: Mode, exe: &str) -> Result<u64, String> {
    let g = Gpu::open()?;
    let c = Core::open()?;
    let mut x = seed ^ ((t as u64 + 1) * 0x9e37_79b9_7f4a_7c15);
    let mut p = Pool {
        allocs: Vec::new(),
        mrs: Vec::new(),
    };
    let mut done = 0;
    while done < ops {
        done += 1;
        let r = next(&mut x) % 1000;
        let live_allocs = p.allocs.iter().filter(|a| a.is_some()).count();
        let e = |what: &str, err: i32| {
            format!("thread {t} op {done} {what}: errno {err} (seed {seed})")
        };
        if r < 150 && live_allocs < 6 {
            let size = K64 * (1 + next(&mut x) % 32);
            let a = g
                .alloc(next(&mut x) % 2, size)
                .map_err(|err| e("alloc", err))?;
            p.allocs.push(Some((a, false)));
        } else if r < 500 && !p.mrs.is_empty() || r < 500 && live_allocs == 0 {
            // deregister (or nothing to register on)
            if !p.mrs.is_empty() {
                let i = (next(&mut x) % p.mrs.len() as u64) as usize;
                let mr = p.mrs.swap_remove(i);
                c.dereg(mr.handle).map_err(|err| e("dereg", err))?;
            }
        } else if r < 800 {
            // register a random unaligned sub-range of a random allocation
            let live: Vec<usize> = (0..p.allocs.len())
                .filter(|&i| p.allocs[i].is_some())
                .collect();
            if live.is_empty() {
                continue;
            }
            let i = live[(next(&mut x) % live.len() as u64) as usize];
            let (a, freed) = p.allocs[i].as_ref().unwrap();
            let off = next(&mut x) % a.size;
            let len = 1 + next(&mut x) % (a.size - off);
            let inval = next(&mut x) % 2 == 0;
            let res = c.reg(a.va + off, len, if inval { PMC_REG_INVAL_SUPP } else { 0 });
            match (res, *freed) {
                (Ok(h), false) => p.mrs.push(Mr {
                    handle: h,
                    alloc: i,
                    inval,
                }),
                (Err(libc::EFAULT), true) => {}
                (Ok(_), true) => return Err(e("register freed GPU memory succeeded", 0)),
                (Err(err), _) => return Err(e("reg", err)),
            }
        } else if r < 880 {
            // free an allocation: munmap or the free ioctl
            let live: Vec<usize> = (0..p.allocs.len())
                .filter(|&i| p.allocs[i].as_ref().is_some_and(|a| !a.1))
                .collect();
            if live.is_empty() {
                continue;
            }
            let i = live[(next(&mut x) % live.len() as u64) as usize];
            if next(&mut x) % 2 == 0 {
                p.allocs[i] = None; // drop = munmap
            } else {
                let (a, freed) = p.allocs[i].as_mut().unwrap();
                g.free(a).map_err(|err| e("free", err))?;
                *freed = true;
            }
            for mr in p.mrs.iter().filter(|m| m.alloc == i) {
                let q = c.query(mr.handle).map_err(|err| e("query", err))?;
                let revoke = mode.invalidating() && mr.inval;
                if (q.revoked == 1) != revoke {
                    return Err(e(
                        &format!("after a free, revoked={} (inval {})", q.revoked, mr.inval),
                        0,
                    ));
                }
            }
        } else if r < 996 {
            // query every MR against the model
            for mr in &p.mrs {
                let q = c.query(mr.handle).map_err(|err| e("query", err))?;
                let gone = p.allocs[mr.alloc].as_ref().is_none_or(|a| a.1);
                let want_revoked = gone && mode.invalidating() && mr.inval;
                if (q.revoked == 1) != want_revoked {
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
            let res = c.dma_read(mr.handle, 0, 8);
            match (res, q.revoked) {
                (Ok(_), 0) | (Err(libc::EACCES), 1) => {}
                (r, rev) => return Err(e(&format!("DMA {r:?} on MR revoked={rev}"), 0)),
            }
        } else {
            // a child with live registrations, killed
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
            child.wait().map_err(|err| err.to_string())?;
            if line.trim() != "ready" {
                return Err(format!("thread {t}: child could not register: {line}"));
            }
        }
    }
    for mr in p.mrs.drain(..) {
        c.dereg(mr.handle)
            .map_err(|err| format!("final dereg: {err}"))?;
    }
    Ok(done)
}

/// Runs `ops` operations over `threads` threads; prints the rate.
pub fn run(mode: Mode, ops: u64, threads: usize, seed: u64) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let exe = exe.to_string_lossy().into_owned();
    let t0 = Instant::now();
    let per = ops / threads as u64;
    let results: Vec<Result<u64, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let exe = exe.clone();
                s.spawn(move || worker(t, per, seed, mode, &exe))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("stress thread panicked".into()))
            })
            .collect()
    });
    let mut total = 0;
    for r in results {
        total += r?;
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok(format!(
        "{total} operations in {secs:.1} s ({:.0} ops/s), {threads} threads, seed {seed}",
        total as f64 / secs
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
