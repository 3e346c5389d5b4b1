// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The module's parameters, checked at load: only `bar1_limit_pct` can
//! change afterwards (the others' sysfs files are read-only); and the GPU
//! driver's topology override, read at load.

use kernel::{
    prelude::*,
    sync::atomic::{
        Atomic,
        Relaxed, //
    },
};

/// The module's parameters, declared by the C shim (`bindings/helpers.c`) so
/// that each has its read-only file in `/sys/module/nvidia_peermem/parameters/`,
/// in the shim's order.
#[derive(Clone, Copy)]
pub(crate) enum Param {
    PersistentApiSupport,
    PeerdirectSupport,
    PathPolicy,
    AllowUnverifiedPaths,
    PairTableSlots,
    PathAccounting,
    Bar1LimitPct,
}

impl Param {
    /// The parameter's value as loaded.
    pub(crate) fn value(self) -> i32 {
        crate::ffi::peermem_param(self as u32)
    }
}

/// The most GPU-peer pairs tracked (`pair_table_slots` at most).
pub(crate) const PAIRS: usize = 64;

static DRIVER_OVERRIDE: Atomic<u32> = Atomic::new(0);

/// Reads and checks every parameter and the GPU driver's override; called
/// at load, before any client is registered. Returns
/// `persistent_api_support` and `peerdirect_support`.
pub(crate) fn load() -> Result<(bool, bool)> {
    let persistent = Param::PersistentApiSupport.value();
    let legacy = Param::PeerdirectSupport.value();
    if !(0..=1).contains(&persistent) || !(0..=1).contains(&legacy) {
        pr_err!("invalid parameters persistent_api_support={persistent} peerdirect_support={legacy} (each 0 or 1)\n");
        return Err(EINVAL);
    }
    let policy = Param::PathPolicy.value();
    if !(0..=5).contains(&policy) {
        pr_err!(
            "invalid parameter path_policy={policy} (0 to allow every path, 1..5 for PIX..SYS)\n"
        );
        return Err(EINVAL);
    }
    let accounting = Param::PathAccounting.value();
    let unverified = Param::AllowUnverifiedPaths.value();
    if !(0..=1).contains(&accounting) || !(0..=1).contains(&unverified) {
        pr_err!("invalid parameters path_accounting={accounting} allow_unverified_paths={unverified} (each 0 or 1)\n");
        return Err(EINVAL);
    }
    let slots = Param::PairTableSlots.value();
    if !(1..=PAIRS as i32).contains(&slots) {
        pr_err!("invalid parameter pair_table_slots={slots} (1..{PAIRS})\n");
        return Err(EINVAL);
    }
    // The GPU driver's `NVreg_GrdmaPciTopoCheckOverride`, which its
    // topology rule reads first (fact 5); fixed while the driver is loaded.
    let over = crate::ffi::peermem_driver_override();
    if over < 0 {
        pr_warn!("NVreg_GrdmaPciTopoCheckOverride could not be read from /proc/driver/nvidia/params: taken as 0 (the GPU driver's default) where the driver cannot be asked about a path\n");
    }
    DRIVER_OVERRIDE.store(over.max(0) as u32, Relaxed);
    Ok((persistent == 1, legacy == 1))
}

/// The GPU driver's `NVreg_GrdmaPciTopoCheckOverride`, as read at load.
pub(crate) fn driver_override() -> u32 {
    DRIVER_OVERRIDE.load(Relaxed)
}

/// The `pair_table_slots` parameter: how many pair slots are used (checked
/// at load; kept within 1..=[`PAIRS`] should root make its file writable).
pub(crate) fn pair_slots() -> usize {
    Param::PairTableSlots.value().clamp(1, PAIRS as i32) as usize
}

/// The `allow_unverified_paths` parameter.
pub(crate) fn unverified_allowed() -> bool {
    Param::AllowUnverifiedPaths.value() != 0
}

/// The `path_policy` parameter: 0 allows every path; 1..=5 refuse paths
/// worse than PIX..SYS.
pub(crate) fn policy_level() -> i32 {
    Param::PathPolicy.value()
}

/// `bar1_limit_pct` now (root may change it at run time; the shim keeps it
/// within 0..=100).
pub(crate) fn bar1_limit_pct() -> u64 {
    Param::Bar1LimitPct.value().clamp(0, 100) as u64
}

/// The `path_accounting` parameter: whether registrations are charged per
/// pair, GPU and process.
pub(crate) fn accounting() -> bool {
    Param::PathAccounting.value() != 0
}
