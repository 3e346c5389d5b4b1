// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `peermem-e2e stat-check <peermem-stat> [--locked]`: the operator tool
//! against the live module. Assumes nvidia_peermem, the emulated GPU driver
//! and core are loaded. With `--locked`, first requires what a container or a
//! Secure Boot node gives: debugfs not mounted and kernel lockdown on (the
//! tool then reads only sysfs). Prints `STAT-CHECK PASS` or
//! `STAT-CHECK FAIL: why`.

use std::process::Command;

use serde_json::Value;

use crate::{
    dev::{Core, Gpu},
    uapi::PMC_REG_INVAL_SUPP,
};

const K64: u64 = 64 << 10;
const MRS: u64 = 3;

macro_rules! ensure {
    ($c:expr, $($fmt:tt)*) => {
        if !$c {
            return Err(format!($($fmt)*));
        }
    };
}

/// Runs the check with the arguments after `stat-check`; the exit status.
pub fn main(args: &[String]) -> i32 {
    let r = match args {
        [stat] => check(stat),
        [stat, locked] if locked == "--locked" => {
            locked_down().and_then(|why| Ok(format!("{why}; {}", check(stat)?)))
        }
        _ => Err("usage: peermem-e2e stat-check <path-to-peermem-stat> [--locked]".into()),
    };
    match r {
        Ok(detail) => {
            println!("stat-check: {detail}");
            println!("STAT-CHECK PASS");
            0
        }
        Err(e) => {
            println!("STAT-CHECK FAIL: {e}");
            1
        }
    }
}

/// Debugfs is not mounted, kernel lockdown is on, and the module's views
/// are in sysfs: what `--locked` requires before the check.
fn locked_down() -> Result<String, String> {
    let mounts =
        std::fs::read_to_string("/proc/mounts").map_err(|e| format!("/proc/mounts: {e}"))?;
    ensure!(
        !mounts
            .lines()
            .any(|l| l.split_whitespace().nth(2) == Some("debugfs")),
        "debugfs is mounted"
    );
    let lockdown = std::fs::read_to_string("/sys/kernel/security/lockdown")
        .map_err(|e| format!("/sys/kernel/security/lockdown: {e}"))?;
    ensure!(
        lockdown.contains("[integrity]") || lockdown.contains("[confidentiality]"),
        "lockdown is off: {}",
        lockdown.trim()
    );
    // Every file of the views: readable by everyone under lockdown, one
    // value each, none about a process.
    let (mut dirs, mut files) = (vec![crate::module::STATS.to_string()], 0);
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).map_err(|e| format!("{d}: {e}"))? {
            let f = e
                .map_err(|e| format!("{d}: {e}"))?
                .path()
                .display()
                .to_string();
            ensure!(!f.contains("process"), "{f}: processes in sysfs");
            let meta = std::fs::metadata(&f).map_err(|e| format!("{f}: {e}"))?;
            if meta.is_dir() {
                dirs.push(f);
                continue;
            }
            ensure!(
                std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o444 == 0o444,
                "{f} is not readable by everyone"
            );
            let v = std::fs::read_to_string(&f).map_err(|e| format!("{f} under lockdown: {e}"))?;
            ensure!(v.lines().count() == 1, "{f}: not one value: {v:?}");
            files += 1;
        }
    }
    Ok(format!(
        "debugfs unmounted, lockdown {}, {files} files",
        lockdown.trim()
    ))
}

/// Runs peermem-stat with `args`; its stdout (exit status 0 required).
fn run(stat: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(stat)
        .args(args)
        .output()
        .map_err(|e| format!("run {stat}: {e}"))?;
    ensure!(
        out.status.success(),
        "peermem-stat {args:?}: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    String::from_utf8(out.stdout).map_err(|e| format!("peermem-stat {args:?}: {e}"))
}

fn parse(line: &str) -> Result<Value, String> {
    serde_json::from_str(line).map_err(|e| format!("bad JSON ({e}): {line}"))
}

/// One frame of `peermem-stat --json`.
fn snapshot(stat: &str) -> Result<Value, String> {
    let out = run(stat, &["--json"])?;
    ensure!(out.lines().count() == 1, "--json printed {out:?}");
    parse(out.trim_end())
}

/// The counter at JSON pointer `at` (e.g. "/stats/registrations").
fn num(v: &Value, at: &str) -> Result<u64, String> {
    v.pointer(at)
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("{at} missing or not a number: {:?}", v.pointer(at)))
}

/// `at` in `now` minus `at` in `base`, as a signed difference.
fn delta(base: &Value, now: &Value, at: &str) -> Result<i128, String> {
    Ok(num(now, at)? as i128 - num(base, at)? as i128)
}

fn expect_delta(base: &Value, now: &Value, at: &str, want: i128, when: &str) -> Result<(), String> {
    let d = delta(base, now, at)?;
    ensure!(d == want, "{when}: {at} changed by {d}, expected {want}");
    Ok(())
}

fn check(stat: &str) -> Result<String, String> {
    let base = snapshot(stat)?;

    // The module as the tool sees it.
    let version = std::fs::read_to_string("/sys/module/nvidia_peermem/version")
        .map_err(|e| format!("/sys/module/nvidia_peermem/version: {e}"))?;
    ensure!(
        base["module"]["loaded"] == true,
        "module.loaded: {}",
        base["module"]["loaded"]
    );
    ensure!(
        base["module"]["implementation"] == "peermem-rs",
        "module.implementation: {} (stats_error {})",
        base["module"]["implementation"],
        base["stats_error"]
    );
    ensure!(
        base["module"]["version"] == version.trim(),
        "module.version {} != {:?}",
        base["module"]["version"],
        version.trim()
    );
    let nccl = base["detection"]
        .as_array()
        .and_then(|d| d.iter().find(|s| s["stack"] == "NCCL"))
        .ok_or("no NCCL in detection")?;
    ensure!(
        nccl["enabled"] == true && nccl["path"].is_string(),
        "NCCL detection: {nccl}"
    );
    // Persistent pins ignore frees: no invalidation then. The invalidating
    // configuration also registers nv_mem_nc; the persistent one does not.
    let persistent = match base["module"]["parameters"]["persistent_api_support"].as_str() {
        Some(p) => p.trim() == "1",
        None => base["peers"]["nv_mem_nc"].is_null(),
    };

    // Three MRs of 64 KiB, each on its own allocation.
    let gpu = Gpu::open()?;
    let core = Core::open()?;
    let mut allocs = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..MRS {
        let a = gpu
            .alloc(0, K64)
            .map_err(|e| format!("GPU alloc: errno {e}"))?;
        handles.push(
            core.reg(a.va, K64, PMC_REG_INVAL_SUPP)
                .map_err(|e| format!("reg: errno {e}"))?,
        );
        allocs.push(a);
    }
    let reg = snapshot(stat)?;
    let when = "after 3 registrations";
    expect_delta(&base, &reg, "/stats/live_registrations", 3, when)?;
    expect_delta(&base, &reg, "/stats/registrations", 3, when)?;
    expect_delta(&base, &reg, "/peers/nv_mem/live_mrs", 3, when)?;
    expect_delta(
        &base,
        &reg,
        "/peers/nv_mem/live_bytes",
        3 * K64 as i128,
        when,
    )?;
    let pinned = delta(&base, &reg, "/stats/pinned_bytes")?;
    ensure!(
        pinned >= 3 * K64 as i128,
        "{when}: pinned_bytes grew by {pinned}"
    );
    let views = check_views(stat, 3)?;

    // cudaFree (munmap) under the first MR.
    allocs[0].unmap();
    let freed = snapshot(stat)?;
    let want = if persistent { 0 } else { 1 };
    expect_delta(
        &base,
        &freed,
        "/stats/invalidations",
        want,
        "after the free",
    )?;

    for h in handles {
        core.dereg(h).map_err(|e| format!("dereg: errno {e}"))?;
    }
    drop(allocs);
    let done = snapshot(stat)?;
    let when = "after deregistration";
    expect_delta(&base, &done, "/stats/live_registrations", 0, when)?;
    expect_delta(&base, &done, "/peers/nv_mem/live_mrs", 0, when)?;
    expect_delta(&base, &done, "/peers/nv_mem/live_bytes", 0, when)?;
    expect_delta(&base, &done, "/stats/registrations", 3, when)?;
    check_views(stat, 0)?;

    // Watch: two frames, human and JSON.
    let out = run(stat, &["--watch", "0.2", "--count", "2"])?;
    let frames = out.lines().filter(|l| l.starts_with("--- frame ")).count();
    ensure!(
        frames == 2,
        "--watch 0.2 --count 2 printed {frames} frames:\n{out}"
    );
    let out = run(stat, &["--json", "--watch", "0.2", "--count", "2"])?;
    let lines: Vec<&str> = out.lines().collect();
    ensure!(
        lines.len() == 2,
        "--json --watch printed {} lines",
        lines.len()
    );
    let second = parse(lines[1])?;
    parse(lines[0])?;
    ensure!(
        second["rates"]["interval_s"].is_number(),
        "no rates in the second JSON frame: {}",
        second["rates"]
    );

    Ok(format!(
        "version {}, NCCL via {}, {} invalidation(s) on free{}; {views}",
        version.trim(),
        nccl["path"],
        want,
        if persistent { " (persistent mode)" } else { "" }
    ))
}

/// The processes `--by-process --json` lists; `None` where root's debugfs
/// file is absent (debugfs unmounted), if the tool then says why and names
/// none.
fn processes(stat: &str) -> Result<Option<Vec<Value>>, String> {
    let procs = parse(run(stat, &["--by-process", "--json"])?.trim_end())?;
    if std::path::Path::new(crate::module::PROCESSES).exists() {
        let list = procs["processes"].as_array().cloned();
        return list
            .map(Some)
            .ok_or_else(|| format!("--by-process: {procs}"));
    }
    ensure!(
        procs["processes"].is_null() && procs["processes_error"].is_string(),
        "--by-process without debugfs: {procs}"
    );
    Ok(None)
}

/// `paths`, `--by-gpu`, `--by-process` (JSON) and `--prometheus` against
/// `live` registrations of 64 KiB made by this process on GPU 0.
fn check_views(stat: &str, live: u64) -> Result<String, String> {
    let me = std::process::id() as u64;
    let gpus = parse(run(stat, &["--by-gpu", "--json"])?.trim_end())?;
    let gpus = gpus["gpus"].as_array().ok_or("--by-gpu --json: no gpus")?;
    let busy: Vec<&Value> = gpus
        .iter()
        .filter(|g| g["live"].as_u64() != Some(0))
        .collect();
    ensure!(
        busy.len() == usize::from(live > 0),
        "--by-gpu: {} GPUs with live registrations, expected {}",
        busy.len(),
        usize::from(live > 0)
    );
    let Some(gpu) = busy.first() else {
        ensure!(
            gpus.iter().all(|g| g["pinned_bytes"].as_u64() == Some(0)),
            "--by-gpu: pinned bytes left {gpus:?}"
        );
        ensure!(
            processes(stat)?.is_none_or(|p| p.is_empty()),
            "--by-process: processes left"
        );
        return Ok("nothing left".into());
    };
    ensure!(
        num(gpu, "/live")? == live && num(gpu, "/pinned_bytes")? == live * K64,
        "--by-gpu: {gpu}, expected {live} live, {} bytes",
        live * K64
    );
    ensure!(
        num(gpu, "/max_pinned_bytes")? >= live * K64,
        "--by-gpu: high-water mark {gpu}"
    );
    let paths = parse(run(stat, &["paths", "--json"])?.trim_end())?;
    let pair = paths["paths"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["gpu"] == gpu["gpu"]))
        .ok_or_else(|| format!("paths --json has no pair of {}", gpu["gpu"]))?;
    ensure!(
        ["PIX", "PXB", "PHB", "NODE", "SYS"].contains(&pair["class"].as_str().unwrap_or("")),
        "paths --json: class {}",
        pair["class"]
    );
    if let Some(procs) = processes(stat)? {
        let mine = procs.iter().find(|p| p["tgid"].as_u64() == Some(me));
        let mine = mine.ok_or_else(|| format!("--by-process has no process {me}: {procs:?}"))?;
        ensure!(
            num(mine, "/live")? == live && num(mine, "/pinned_bytes")? == live * K64,
            "--by-process: {mine}, expected {live} live"
        );
    }
    let prom = run(stat, &["--prometheus"])?;
    let want = format!(
        "nvidia_peermem_gpu_live_registrations{{gpu=\"{}\"}} {live}",
        pair["gpu"].as_str().unwrap_or("")
    );
    ensure!(
        prom.lines().any(|l| l == want),
        "--prometheus lacks `{want}`"
    );
    ensure!(
        prom.lines().any(|l| l == "nvidia_peermem_up 1"),
        "--prometheus: module not up"
    );
    let matrix = run(stat, &["paths"])?;
    ensure!(
        matrix.contains(pair["class"].as_str().unwrap_or("?")),
        "paths matrix lacks the class:\n{matrix}"
    );
    Ok(format!(
        "paths: {} {} {}",
        pair["gpu"], pair["hca"], pair["class"]
    ))
}
