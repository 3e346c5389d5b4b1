// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Loading, unloading and inspecting kernel modules from the guest.

use std::{collections::BTreeMap, process::Command};

/// Runs `insmod path args...`.
pub fn insmod(path: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new("insmod")
        .arg(path)
        .args(args)
        .output()
        .map_err(|e| format!("insmod: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "insmod {path} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `rmmod name`; Ok(false) if the kernel refused.
pub fn rmmod(name: &str) -> Result<bool, String> {
    let out = Command::new("rmmod")
        .arg(name)
        .output()
        .map_err(|e| format!("rmmod: {e}"))?;
    Ok(out.status.success())
}

pub fn loaded(name: &str) -> bool {
    std::path::Path::new(&format!("/sys/module/{name}")).exists()
}

/// The module's one-value files.
pub const STATS: &str = "/sys/module/nvidia_peermem/stats";
/// Root's list of the processes holding pins (debugfs).
pub const PROCESSES: &str = "/sys/kernel/debug/nvidia_peermem/processes";

/// The sorted names in `dir`.
fn names(dir: &str) -> Result<Vec<String>, String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| format!("{dir}: {e}"))?
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .collect();
    names.sort();
    Ok(names)
}

/// `<name><sep><value><end>` for every file of `dir`, sorted by name.
fn files(dir: &str, sep: &str, end: &str) -> Result<String, String> {
    let mut out = String::new();
    for n in names(dir)? {
        let p = format!("{dir}/{n}");
        let v = std::fs::read_to_string(&p).map_err(|e| format!("{p}: {e}"))?;
        out += &format!("{n}{sep}{}{end}", v.trim());
    }
    Ok(out)
}

/// The module's view `name` as one text, a line per record (the one-value
/// files put together): `counters`, `name value` lines; `gpus`, `gpu=<bdf>
/// <file>=<value> ...` lines; `paths`, `gpu=<bdf> hca=<bdf> <file>=<value>
/// ...` lines (every field followed by a space); `processes`, root's
/// debugfs file; else the file `stats/<name>`.
pub fn view(name: &str) -> Result<String, String> {
    let read = |p: &str| std::fs::read_to_string(p).map_err(|e| format!("{p}: {e}"));
    match name {
        "counters" => files(&format!("{STATS}/counters"), " ", "\n"),
        "gpus" | "paths" => {
            // A counter read first: the directories follow the records.
            let _ = read(&format!("{STATS}/counters/live_registrations"));
            let mut out = String::new();
            for d in names(&format!("{STATS}/{name}"))? {
                let head = match d.split_once('-') {
                    Some((g, h)) if name == "paths" => format!("gpu={g} hca={h} "),
                    _ => format!("gpu={d} "),
                };
                // A directory removed meanwhile is left out.
                if let Ok(f) = files(&format!("{STATS}/{name}/{d}"), "=", " ") {
                    out += &format!("{head}{f}\n");
                }
            }
            Ok(out)
        }
        "processes" => read(PROCESSES),
        _ => read(&format!("{STATS}/{name}")),
    }
}

/// The module's counters (sysfs `stats/counters/<name>`).
pub fn stats() -> BTreeMap<String, u64> {
    let s = view("counters").unwrap_or_default();
    s.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.to_string(), it.next()?.parse().ok()?))
        })
        .collect()
}

/// A numeric parameter of nvidia_peermem (sysfs `parameters/<name>`).
pub fn param(name: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/sys/module/nvidia_peermem/parameters/{name}"))
        .ok()
        .and_then(|v| v.trim().parse().ok())
}

/// One counter of the core's memory_peers/<client>/ directory.
pub fn peer_stat(client: &str, name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/kernel/mm/memory_peers/{client}/{name}"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Arms the provider's fault injection: fail the next `count` calls of `func`.
pub fn inject(func: &str, count: u32, errno: i32) -> Result<(), String> {
    std::fs::write(
        "/sys/kernel/debug/nv_p2p_emu/inject",
        format!("{func} {count} -{errno}"),
    )
    .map_err(|e| format!("inject {func}: {e}"))
}

pub fn debugfs_write(path: &str, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("write {path}: {e}"))
}
