// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `peermem-e2e paths <expect-file> [--policy N]`: the module's view of the
//! PCIe path between each GPU and the HCA, on a QEMU layout of
//! `scripts/qemu-run --topology`.
//!
//! Loads nothing: the plan has loaded the harness and nvidia_peermem
//! (invalidating, `persistent_api_support=0`, and `path_policy=N` when
//! `--policy N` is given). Registers MRs on every GPU, moves bytes both ways
//! through the HCA, and checks the sysfs views `paths`, `gpus` and `processes`
//! against the expectation file (`scripts/qemu-run --print-expected`: lines
//! `topology NAME` and `gpu<i> CLASS [acs=0|1]`), against the live counts,
//! against the ACS control registers the guest reads itself, and the
//! module's one log line per pair.
//!
//! Output as the scenarios': `E2E ok paths/<topology>/<case> ...` or
//! `E2E FAIL paths/<topology>/<case>: why`, then `E2E-SUMMARY: N passed, M
//! failed`.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;

use crate::{
    dev::{Alloc, Core, Gpu},
    module,
    scenarios::{errno_name, pattern},
    uapi::PMC_REG_INVAL_SUPP,
};

const K64: u64 = 64 << 10;
const M: u64 = 1 << 20;
const CLASSES: [&str; 5] = ["PIX", "PXB", "PHB", "NODE", "SYS"];
/// printk levels in /dev/kmsg records.
const KERN_WARNING: u8 = 4;
const KERN_INFO: u8 = 6;

macro_rules! ensure {
    ($c:expr, $($fmt:tt)*) => {
        if !$c {
            return Err(format!($($fmt)*));
        }
    };
}

/// 1 = PIX ... 5 = SYS.
fn level(class: &str) -> Option<usize> {
    CLASSES.iter().position(|c| *c == class).map(|i| i + 1)
}

/// The expectation file.
#[derive(Debug)]
struct Expect {
    topology: String,
    /// Per GPU index: class, and whether ACS redirect is on the path.
    gpus: Vec<(String, Option<bool>)>,
}

fn parse_expect(text: &str) -> Result<Expect, String> {
    let mut topology = "unnamed".to_string();
    let mut gpus: BTreeMap<usize, (String, Option<bool>)> = BTreeMap::new();
    for l in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let w: Vec<&str> = l.split_whitespace().collect();
        if w[0] == "topology" && w.len() == 2 {
            topology = w[1].to_string();
            continue;
        }
        let i = w[0]
            .strip_prefix("gpu")
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| format!("expect file: bad line {l:?}"))?;
        ensure!(
            w.len() >= 2 && level(w[1]).is_some(),
            "expect file: bad class in {l:?}"
        );
        let acs = match w.get(2) {
            None => None,
            Some(&"acs=0") => Some(false),
            Some(&"acs=1") => Some(true),
            Some(x) => return Err(format!("expect file: bad field {x:?} in {l:?}")),
        };
        ensure!(w.len() <= 3, "expect file: trailing fields in {l:?}");
        gpus.insert(i, (w[1].to_string(), acs));
    }
    ensure!(!gpus.is_empty(), "expect file names no GPU");
    ensure!(
        gpus.keys().copied().eq(0..gpus.len()),
        "expect file: GPU indices not 0..{}",
        gpus.len()
    );
    Ok(Expect {
        topology,
        gpus: gpus.into_values().collect(),
    })
}

/// `key=value` fields of one line of a view.
fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace()
        .filter_map(|f| f.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The lines of the view `name` (`module::view`), as fields.
fn table(name: &str) -> Result<Vec<BTreeMap<String, String>>, String> {
    let s = crate::module::view(name)?;
    Ok(s.lines()
        .filter(|l| !l.trim().is_empty())
        .map(fields)
        .collect())
}

/// The one line of `name` whose fields match all of `key`.
fn row(name: &str, key: &[(&str, &str)]) -> Result<Option<BTreeMap<String, String>>, String> {
    let mut hits: Vec<_> = table(name)?
        .into_iter()
        .filter(|f| {
            key.iter()
                .all(|(k, v)| f.get(*k).map(String::as_str) == Some(*v))
        })
        .collect();
    ensure!(
        hits.len() <= 1,
        "{} lines of {name} for {key:?}",
        hits.len()
    );
    Ok(hits.pop())
}

fn num(f: &BTreeMap<String, String>, k: &str) -> Result<u64, String> {
    f.get(k)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no number {k} in {f:?}"))
}

fn text<'a>(f: &'a BTreeMap<String, String>, k: &str) -> Result<&'a str, String> {
    f.get(k)
        .map(String::as_str)
        .ok_or_else(|| format!("no field {k} in {f:?}"))
}

/// The kernel log: (level, message) of every record still in the buffer.
fn kmsg() -> Vec<(u8, String)> {
    let mut out = Vec::new();
    let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
    else {
        return out;
    };
    let mut buf = vec![0u8; 16384];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                let first = rec.lines().next().unwrap_or("");
                if let Some((head, msg)) = first.split_once(';') {
                    let pri: u32 = head
                        .split(',')
                        .next()
                        .and_then(|p| p.parse().ok())
                        .unwrap_or(0);
                    out.push(((pri & 7) as u8, msg.to_string()));
                }
            }
            // Overwritten records: the read goes on with the oldest left.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    out
}

fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

/// The PCI devices bound to `driver`, sorted.
fn bound(driver: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/sys/bus/pci/drivers/{driver}"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| is_bdf(n))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The PCI address of each emulated GPU, by the emulator's index: from its
/// probe message (`emulated GPU <i>: BAR ...`), else the bound devices in
/// order.
fn gpu_bdfs(log: &[(u8, String)]) -> Vec<String> {
    let devs = bound("nv_p2p_emu");
    let mut by_index = BTreeMap::new();
    for (_, m) in log {
        let Some(at) = m.find(": emulated GPU ") else {
            continue;
        };
        let Some(bdf) = m[..at].split_whitespace().last() else {
            continue;
        };
        let idx = m[at + 15..]
            .split(':')
            .next()
            .and_then(|n| n.parse::<usize>().ok());
        if let Some(i) = idx {
            if devs.iter().any(|d| d == bdf) {
                by_index.insert(i, bdf.to_string());
            }
        }
    }
    if by_index.len() == devs.len() && by_index.keys().copied().eq(0..devs.len()) {
        by_index.into_values().collect()
    } else {
        devs
    }
}

/// The ACS capability and control words of a PCI device, if it has ACS.
fn acs_of(bdf: &str) -> Option<(u16, u16)> {
    let cfg = std::fs::read(format!("/sys/bus/pci/devices/{bdf}/config")).ok()?;
    let rd16 = |o: usize| cfg.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let rd32 = |o: usize| {
        cfg.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut pos = 0x100usize;
    for _ in 0..64 {
        let h = rd32(pos)?;
        if h == 0 || h == u32::MAX {
            return None;
        }
        if h & 0xffff == 0x000d {
            return Some((rd16(pos + 4)?, rd16(pos + 6)?));
        }
        pos = ((h >> 20) & 0xffc) as usize;
        if pos < 0x100 {
            return None;
        }
    }
    None
}

/// ACS P2P Request Redirect | P2P Completion Redirect.
const ACS_RR_CR: u16 = 0x4 | 0x8;

/// The sysfs path components of a device: its host bridge (`pci0000:00`),
/// then the PCI addresses of the bridges down to it, then itself.
fn sysfs_chain(bdf: &str) -> Result<Vec<String>, String> {
    let p = std::fs::canonicalize(format!("/sys/bus/pci/devices/{bdf}"))
        .map_err(|e| format!("sysfs {bdf}: {e}"))?;
    Ok(p.components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .skip_while(|c| !c.starts_with("pci"))
        .collect())
}

/// A bridge's PCI address and its ACS capability and control words.
type Bridge = (String, Option<(u16, u16)>);

/// The bridges the path between `a` and `b` crosses below where they meet
/// (all of them if they meet at, or above, the host bridge), with their ACS
/// words, as the guest's config space has them.
fn path_bridges(a: &str, b: &str) -> Result<Vec<Bridge>, String> {
    let (ca, cb) = (sysfs_chain(a)?, sysfs_chain(b)?);
    let common = ca.iter().zip(&cb).take_while(|(x, y)| x == y).count();
    let mut out = Vec::new();
    for c in [&ca, &cb] {
        // Skip the host bridge, the shared part and the device itself.
        let n = c.len().saturating_sub(1);
        for br in c[common.max(1).min(n)..n].iter() {
            out.push((br.clone(), acs_of(br)));
        }
    }
    Ok(out)
}

/// How the HCA's DMA is translated, named as the module names it.
fn iommu_kind(bdf: &str) -> String {
    let dev = format!("/sys/bus/pci/devices/{bdf}/iommu_group");
    if std::fs::symlink_metadata(&dev).is_err() {
        return "none".into();
    }
    match std::fs::read_to_string(format!("{dev}/type"))
        .unwrap_or_default()
        .trim()
    {
        "identity" => "identity".into(),
        "DMA" => "dma".into(),
        "DMA-FQ" => "dma-fq".into(),
        _ => "other".into(),
    }
}

/// One registration the scenario makes: allocation size, offset in it, length.
fn mr_specs(gpu: usize) -> Vec<(u64, u64, u64)> {
    if gpu % 2 == 0 {
        vec![(M, 0x1234, 200_000), (4 * K64, 0, 4 * K64)]
    } else {
        vec![(2 * M, 3 * K64 + 100, M)]
    }
}

/// The 64 KiB pages a registration pins, in bytes.
fn pinned(va: u64, len: u64) -> u64 {
    (va + len).div_ceil(K64) * K64 - va / K64 * K64
}

struct Mr {
    alloc: Alloc,
    handle: u64,
    off: u64,
    len: u64,
    bytes: u64,
}

/// The HCA reads what the CPU wrote and the CPU reads what the HCA wrote,
/// at the start, the end and the middle of the MR.
fn dma_verify(core: &Core, mr: &Mr, seed: u64) -> Result<(), String> {
    let n = 256.min(mr.len);
    let offs = [0, mr.len - n, (mr.len / 2) & !7];
    for &s in &offs {
        mr.alloc.write(mr.off + s, &pattern(seed, s, n as usize));
    }
    for &s in &offs {
        let got = core
            .dma_read(mr.handle, s, n as usize)
            .map_err(|e| format!("DMA read at MR+{s:#x}: {}", errno_name(e)))?;
        ensure!(
            got == pattern(seed, s, n as usize),
            "DMA read at MR+{s:#x} returned other bytes than the CPU wrote"
        );
    }
    let seed2 = seed.rotate_left(17) ^ 0x5555;
    for &s in &offs {
        core.dma_write(mr.handle, s, &pattern(seed2, s, n as usize))
            .map_err(|e| format!("DMA write at MR+{s:#x}: {}", errno_name(e)))?;
        ensure!(
            mr.alloc.read(mr.off + s, n as usize) == pattern(seed2, s, n as usize),
            "CPU sees other bytes than the HCA wrote at MR+{s:#x}"
        );
    }
    Ok(())
}

struct Run {
    label: String,
    passed: u32,
    failed: u32,
}

impl Run {
    fn case(&mut self, name: &str, r: Result<String, String>) {
        match r {
            Ok(d) => {
                self.passed += 1;
                println!("E2E ok {}/{name} {d}", self.label);
            }
            Err(e) => {
                self.failed += 1;
                println!("E2E FAIL {}/{name}: {e}", self.label);
            }
        }
    }
}

/// Runs the subcommand with the arguments after `paths`; the exit status.
pub fn run(args: &[String]) -> i32 {
    let mut file = None;
    let mut policy = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--policy" => policy = it.next().and_then(|n| n.parse::<usize>().ok()),
            f if file.is_none() => file = Some(f.to_string()),
            x => {
                println!("E2E FAIL paths/args: unexpected argument {x:?}");
                println!("E2E-SUMMARY: 0 passed, 1 failed");
                return 1;
            }
        }
    }
    let expect = match file
        .ok_or_else(|| "usage: peermem-e2e paths <expect-file> [--policy N]".to_string())
        .and_then(|f| std::fs::read_to_string(&f).map_err(|e| format!("{f}: {e}")))
        .and_then(|t| parse_expect(&t))
    {
        Ok(e) => e,
        Err(e) => {
            println!("E2E FAIL paths/expect: {e}");
            println!("E2E-SUMMARY: 0 passed, 1 failed");
            return 1;
        }
    };
    if policy.is_some_and(|p| !(1..=5).contains(&p)) {
        println!("E2E FAIL paths/args: --policy takes 1 (PIX) ... 5 (SYS)");
        println!("E2E-SUMMARY: 0 passed, 1 failed");
        return 1;
    }
    let mut run = Run {
        label: match policy {
            Some(p) => format!("paths/{}-policy{p}", expect.topology),
            None => format!("paths/{}", expect.topology),
        },
        passed: 0,
        failed: 0,
    };
    let r = scenario(&mut run, &expect, policy);
    if let Err(e) = r {
        run.case("setup", Err(e));
    }
    println!("E2E-SUMMARY: {} passed, {} failed", run.passed, run.failed);
    i32::from(run.failed > 0)
}

/// What each GPU got: its address and whether its pair is refused.
struct GpuPlan {
    bdf: String,
    class: String,
    acs: Option<bool>,
    refused: bool,
    mrs: Vec<Mr>,
}

fn scenario(run: &mut Run, expect: &Expect, policy: Option<usize>) -> Result<(), String> {
    // The devices and their drivers.
    let log0 = kmsg();
    // The module logs a pair once, when it first sees it: count from here.
    let mark = format!("E2E start {} pid {}", run.label, std::process::id());
    let _ = std::fs::write("/dev/kmsg", format!("{mark}\n"));
    let hcas = bound("peer_mem_core_hca");
    let gpus = gpu_bdfs(&log0);
    let bind = (|| {
        ensure!(
            module::loaded("nvidia_peermem"),
            "nvidia_peermem is not loaded"
        );
        ensure!(hcas.len() == 1, "HCAs bound to peer_mem_core_hca: {hcas:?}");
        ensure!(
            gpus.len() == expect.gpus.len(),
            "GPUs bound to nv_p2p_emu: {gpus:?}, expected {}",
            expect.gpus.len()
        );
        Ok(format!("HCA {} GPUs {}", hcas[0], gpus.join(" ")))
    })();
    let ok = bind.is_ok();
    run.case("bind", bind);
    if !ok {
        return Ok(());
    }
    let hca = hcas[0].clone();
    // path_accounting=0: pairs are classified and failures counted, but no
    // registration is charged to a pair, GPU or process.
    let acct = module::param("path_accounting").is_none_or(|v| v != 0);
    if let (Some(p), Some(got)) = (policy, module::param("path_policy")) {
        ensure!(
            got == p as u64,
            "the module runs with path_policy={got}, expected {p}"
        );
    }
    let pair0: Vec<u64> = gpus
        .iter()
        .map(|g| {
            row("paths", &[("gpu", g), ("hca", &hca)])
                .ok()
                .flatten()
                .map_or(0, |f| num(&f, "registrations").unwrap_or(0))
        })
        .collect();

    let gpu = Gpu::open()?;
    let core = Core::open()?;
    ensure!(
        gpu.info().gpus as usize == gpus.len(),
        "the emulator has {} GPUs, sysfs {}",
        gpu.info().gpus,
        gpus.len()
    );
    let mut plans: Vec<GpuPlan> = expect
        .gpus
        .iter()
        .zip(&gpus)
        .map(|((class, acs), bdf)| GpuPlan {
            bdf: bdf.clone(),
            class: class.clone(),
            acs: *acs,
            refused: policy.is_some_and(|p| level(class).unwrap_or(5) > p),
            mrs: Vec::new(),
        })
        .collect();

    // Register (or be refused) on every GPU; keep the MRs live.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for (i, p) in plans.iter_mut().enumerate() {
        let name = format!("gpu{i}-register");
        let r = (|| {
            let refusals0 = module::stats()
                .get("fail_path_policy")
                .copied()
                .unwrap_or(0);
            for (size, off, len) in mr_specs(i) {
                let alloc = gpu
                    .alloc(i as u64, size)
                    .map_err(|e| format!("alloc {size:#x} on GPU {i}: {}", errno_name(e)))?;
                let addr = alloc.va + off;
                let r = core.reg(addr, len, PMC_REG_INVAL_SUPP);
                if p.refused {
                    match r {
                        Err(e) if e == libc::EPERM => {}
                        Err(e) => {
                            return Err(format!(
                                "{} pair refused with {}, expected EPERM",
                                p.class,
                                errno_name(e)
                            ))
                        }
                        Ok(h) => {
                            let _ = core.dereg(h);
                            return Err(format!(
                                "{} pair registered under path_policy={}",
                                p.class,
                                policy.unwrap_or(0)
                            ));
                        }
                    }
                    continue;
                }
                let handle =
                    r.map_err(|e| format!("reg {addr:#x}+{len:#x} on GPU {i}: {}", errno_name(e)))?;
                let mr = Mr {
                    bytes: pinned(addr, len),
                    alloc,
                    handle,
                    off,
                    len,
                };
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                p.mrs.push(mr);
                dma_verify(&core, &p.mrs[p.mrs.len() - 1], seed)?;
            }
            let refusals = module::stats()
                .get("fail_path_policy")
                .copied()
                .unwrap_or(0);
            let want = if p.refused {
                mr_specs(i).len() as u64
            } else {
                0
            };
            ensure!(
                refusals.checked_sub(refusals0) == Some(want),
                "fail_path_policy went from {refusals0} to {refusals}, expected +{want}"
            );
            Ok(if p.refused {
                format!("{} refused ({want} x EPERM)", p.class)
            } else {
                format!(
                    "{} MRs, {} bytes pinned, DMA both ways verified",
                    p.mrs.len(),
                    p.mrs.iter().map(|m| m.bytes).sum::<u64>()
                )
            })
        })();
        run.case(&name, r);
    }

    // The module's tables while everything is live.
    let total_live: u64 = plans.iter().map(|p| p.mrs.len() as u64).sum();
    let total_bytes: u64 = plans.iter().flat_map(|p| &p.mrs).map(|m| m.bytes).sum();
    let mut max_seen = Vec::new();
    for (i, p) in plans.iter().enumerate() {
        let r = (|| {
            let pair = row("paths", &[("gpu", &p.bdf), ("hca", &hca)])?
                .ok_or_else(|| format!("no paths line for gpu={} hca={hca}", p.bdf))?;
            let class = text(&pair, "class")?;
            ensure!(class == p.class, "class {class}, expected {}", p.class);
            let acs = num(&pair, "acs_redirect")?;
            if let Some(want) = p.acs {
                ensure!(
                    acs == u64::from(want),
                    "acs_redirect={acs}, expected {}",
                    u64::from(want)
                );
            }
            let regs = num(&pair, "registrations")?
                .checked_sub(pair0[i])
                .ok_or_else(|| format!("registrations went back below {}", pair0[i]))?;
            let made = if acct { p.mrs.len() as u64 } else { 0 };
            ensure!(
                regs == made,
                "registrations grew by {regs}, expected {made} (path_accounting={})",
                u64::from(acct)
            );
            let refusals = num(&pair, "policy_refusals")?;
            let fails = num(&pair, "failures")?;
            let last = text(&pair, "last_failure")?;
            if p.refused {
                let n = mr_specs(i).len() as u64;
                ensure!(refusals == n, "policy_refusals={refusals}, expected {n}");
                ensure!(
                    fails == n && last == "EPERM",
                    "failures={fails} last_failure={last}, expected {n} EPERM"
                );
            } else {
                ensure!(
                    refusals == 0,
                    "policy_refusals={refusals} on an allowed pair"
                );
                ensure!(
                    fails == 0 && last == "-",
                    "failures={fails} last_failure={last} on a pair that never failed"
                );
            }
            let iommu = text(&pair, "iommu")?;
            let want_iommu = iommu_kind(&hca);
            ensure!(
                iommu == want_iommu,
                "iommu={iommu}, the HCA's IOMMU group says {want_iommu}"
            );
            let bytes: u64 = p.mrs.iter().map(|m| m.bytes).sum();
            let g = row("gpus", &[("gpu", &p.bdf)])?;
            let max = match (&g, p.mrs.is_empty() || !acct) {
                (None, true) => 0,
                (None, false) => return Err(format!("no gpus line for {}", p.bdf)),
                (Some(g), _) => {
                    let (live, pin, max) = (
                        num(g, "live")?,
                        num(g, "pinned_bytes")?,
                        num(g, "max_pinned_bytes")?,
                    );
                    let (want_live, want_pin) = if acct {
                        (p.mrs.len() as u64, bytes)
                    } else {
                        (0, 0)
                    };
                    ensure!(
                        live == want_live && pin == want_pin,
                        "gpus: live={live} pinned_bytes={pin}, expected {want_live} and {want_pin}"
                    );
                    ensure!(
                        max >= pin,
                        "max_pinned_bytes={max} below pinned_bytes={pin}"
                    );
                    max
                }
            };
            max_seen.push(Some(max));
            Ok(format!(
                "class={class} acs_redirect={acs} iommu={iommu} registrations={regs} \
                 policy_refusals={refusals} live={} pinned_bytes={bytes}",
                p.mrs.len()
            ))
        })();
        max_seen.resize(i + 1, None);
        run.case(&format!("gpu{i}-path"), r);
    }
    let tgid = std::process::id().to_string();
    let r = (|| {
        let pr = row("processes", &[("tgid", &tgid)])?;
        match pr {
            // Root's list of the registrations' holders, path_accounting
            // or not.
            None if total_live == 0 => Ok("no live registration, no line".to_string()),
            None => Err(format!("no processes line for tgid {tgid}")),
            Some(f) => {
                let (live, pin) = (num(&f, "live")?, num(&f, "pinned_bytes")?);
                ensure!(
                    live == total_live && pin == total_bytes,
                    "processes: live={live} pinned_bytes={pin}, expected {total_live} and {total_bytes}"
                );
                let comm = text(&f, "comm")?;
                ensure!(comm == "peermem-e2e", "comm={comm}");
                Ok(format!("tgid={tgid} live={live} pinned_bytes={pin}"))
            }
        }
    })();
    run.case("process", r);

    // ACS as the guest's config space has it, against the module.
    for (i, p) in plans.iter().enumerate() {
        let r = (|| {
            let bridges = path_bridges(&p.bdf, &hca)?;
            let on = bridges
                .iter()
                .any(|(_, a)| a.is_some_and(|(_, ctrl)| ctrl & ACS_RR_CR != 0));
            let pair = row("paths", &[("gpu", &p.bdf), ("hca", &hca)])?
                .ok_or_else(|| format!("no paths line for gpu={} hca={hca}", p.bdf))?;
            let module_acs = num(&pair, "acs_redirect")?;
            let desc: Vec<String> = bridges
                .iter()
                .map(|(b, a)| match a {
                    Some((cap, ctrl)) => format!("{b}:cap={cap:#06x},ctrl={ctrl:#06x}"),
                    None => format!("{b}:no-acs"),
                })
                .collect();
            ensure!(
                module_acs == u64::from(on),
                "module acs_redirect={module_acs}, config space says {} ({})",
                u64::from(on),
                desc.join(" ")
            );
            if let Some(want) = p.acs {
                ensure!(
                    on == want,
                    "ACS redirect on the path: {on}, expected {want} ({})",
                    desc.join(" ")
                );
            }
            Ok(format!(
                "acs_redirect={} bridges [{}]",
                u64::from(on),
                desc.join(" ")
            ))
        })();
        run.case(&format!("gpu{i}-acs"), r);
    }

    // Deregister everything: live counts and pinned bytes to 0, the peaks stay.
    let r = (|| {
        for p in plans.iter_mut() {
            for mr in p.mrs.drain(..) {
                core.dereg(mr.handle)
                    .map_err(|e| format!("dereg: {}", errno_name(e)))?;
                drop(mr.alloc);
            }
        }
        for (i, p) in plans.iter().enumerate() {
            if let Some(g) = row("gpus", &[("gpu", &p.bdf)])? {
                let (live, pin, max) = (
                    num(&g, "live")?,
                    num(&g, "pinned_bytes")?,
                    num(&g, "max_pinned_bytes")?,
                );
                ensure!(
                    live == 0 && pin == 0,
                    "gpus after deregistration: {} live={live} pinned_bytes={pin}",
                    p.bdf
                );
                // Unknown if the check while live failed.
                if let Some(want) = max_seen[i] {
                    ensure!(
                        max == want,
                        "max_pinned_bytes of {} went from {want} to {max}",
                        p.bdf
                    );
                }
            } else {
                ensure!(max_seen[i].unwrap_or(0) == 0, "gpus line of {} gone", p.bdf);
            }
        }
        if let Some(f) = row("processes", &[("tgid", &tgid)])? {
            let (live, pin) = (num(&f, "live")?, num(&f, "pinned_bytes")?);
            ensure!(
                live == 0 && pin == 0,
                "processes after deregistration: live={live} pinned_bytes={pin}"
            );
        }
        let s = module::stats();
        ensure!(
            s.get("live_registrations") == Some(&0) && s.get("pinned_bytes") == Some(&0),
            "module stats after deregistration: live_registrations={:?} pinned_bytes={:?}",
            s.get("live_registrations"),
            s.get("pinned_bytes")
        );
        Ok(format!(
            "live 0, pinned 0, peaks kept ({})",
            max_seen
                .iter()
                .map(|m| m.map_or("?".to_string(), |m| m.to_string()))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })();
    run.case("release", r);

    // One log line per pair, at the level its class deserves.
    let mut log = kmsg();
    match log.iter().rposition(|(_, m)| m.trim() == mark) {
        Some(at) => {
            log.drain(..=at);
        }
        None => run.case("log-mark", Err("our mark is not in the kernel log".into())),
    }
    for (i, p) in plans.iter().enumerate() {
        let r = (|| {
            // A warning where peer traffic goes through the root complex:
            // PHB and worse, or any path whose bridges redirect it (ACS).
            let acs = row("paths", &[("gpu", &p.bdf), ("hca", &hca)])?
                .map_or(Ok(0), |f| num(&f, "acs_redirect"))?;
            let want_level = if level(&p.class).unwrap_or(5) >= 3 || acs == 1 {
                KERN_WARNING
            } else {
                KERN_INFO
            };
            let lines: Vec<&(u8, String)> = log
                .iter()
                .filter(|(_, m)| {
                    m.contains("nvidia_peermem")
                        && m.contains(&p.bdf)
                        && m.contains(&hca)
                        && m.split(|c: char| !c.is_ascii_alphanumeric())
                            .any(|w| w == p.class)
                        && !m.contains("polic")
                })
                .collect();
            ensure!(
                lines.len() == 1,
                "{} log lines name {} and {hca} as {}: {lines:?}",
                lines.len(),
                p.bdf,
                p.class
            );
            ensure!(
                lines[0].0 == want_level,
                "logged at level {}, expected {want_level}: {}",
                lines[0].0,
                lines[0].1
            );
            Ok(format!("<{}> {}", lines[0].0, lines[0].1.trim()))
        })();
        run.case(&format!("gpu{i}-log"), r);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expect_file() {
        let e = parse_expect("topology numa\ngpu0 NODE acs=1\n\ngpu1 SYS\n").unwrap();
        assert_eq!(e.topology, "numa");
        assert_eq!(
            e.gpus,
            vec![("NODE".to_string(), Some(true)), ("SYS".to_string(), None)]
        );
        assert!(parse_expect("gpu0 FAR").is_err());
        assert!(parse_expect("gpu1 PIX").is_err());
        assert!(parse_expect("gpu0 PIX acs=2").is_err());
        assert!(parse_expect("topology x").is_err());
    }

    #[test]
    fn debugfs_fields() {
        let f = fields("gpu=0000:00:03.0 hca=0000:00:02.0 acs_redirect=0 class=PHB failures=0 iommu=dma last_failure=- policy_refusals=0 registrations=12 ");
        assert_eq!(text(&f, "class").unwrap(), "PHB");
        assert_eq!(num(&f, "registrations").unwrap(), 12);
        assert_eq!(num(&f, "failures").unwrap(), 0);
        assert_eq!(text(&f, "last_failure").unwrap(), "-");
        assert!(num(&f, "nothing").is_err());
    }

    #[test]
    fn pinned_pages() {
        assert_eq!(pinned(0x10000 + 0x1234, 200_000), 4 * K64);
        assert_eq!(pinned(0x10000, 4 * K64), 4 * K64);
        assert_eq!(pinned(0x20000 + 3 * K64 + 100, M), 17 * K64);
        assert_eq!(level("PIX"), Some(1));
        assert_eq!(level("SYS"), Some(5));
        assert!(is_bdf("0000:00:03.0") && !is_bdf("pci0000:00"));
    }
}
