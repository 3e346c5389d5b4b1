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

/// The module's counters (sysfs `stats/counters`, `name value` lines).
pub fn stats() -> BTreeMap<String, u64> {
    let s =
        std::fs::read_to_string("/sys/module/nvidia_peermem/stats/counters").unwrap_or_default();
    s.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.to_string(), it.next()?.parse().ok()?))
        })
        .collect()
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
