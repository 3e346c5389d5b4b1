// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The path parameters, copied at load where the registrations read them:
//! they cannot change afterwards (no sysfs write), and reading a module
//! parameter is a call per read.

use kernel::sync::atomic::{
    Atomic,
    Relaxed, //
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
}

impl Param {
    /// Every parameter with its name, as the stats file lists them.
    pub(crate) const ALL: [(Param, &'static str); 6] = [
        (Param::PersistentApiSupport, "persistent_api_support"),
        (Param::PeerdirectSupport, "peerdirect_support"),
        (Param::PathPolicy, "path_policy"),
        (Param::PathAccounting, "path_accounting"),
        (Param::AllowUnverifiedPaths, "allow_unverified_paths"),
        (Param::PairTableSlots, "pair_table_slots"),
    ];

    /// The parameter's value as loaded.
    pub(crate) fn value(self) -> i32 {
        crate::ffi::peermem_param(self as u32)
    }
}

/// The most GPU-peer pairs tracked (`pair_table_slots` at most).
pub(crate) const PAIRS: usize = 64;

static PATH_POLICY: Atomic<u32> = Atomic::new(0);
static PATH_ACCOUNTING: Atomic<u32> = Atomic::new(1);
static ALLOW_UNVERIFIED: Atomic<u32> = Atomic::new(0);
static PAIR_SLOTS: Atomic<u32> = Atomic::new(PAIRS as u32);

/// The path parameters, checked.
pub(crate) struct PathParams {
    pub(crate) policy: u32,
    pub(crate) accounting: bool,
    pub(crate) unverified: bool,
    pub(crate) pair_slots: u32,
}

/// Publishes the path parameters; called at load, before any client is
/// registered, so before any registration reads them.
pub(crate) fn set(p: PathParams) {
    PATH_POLICY.store(p.policy, Relaxed);
    PATH_ACCOUNTING.store(u32::from(p.accounting), Relaxed);
    ALLOW_UNVERIFIED.store(u32::from(p.unverified), Relaxed);
    PAIR_SLOTS.store(p.pair_slots, Relaxed);
}

/// The `pair_table_slots` parameter: how many pair slots are used.
pub(crate) fn pair_slots() -> usize {
    PAIR_SLOTS.load(Relaxed) as usize
}

/// The `allow_unverified_paths` parameter.
pub(crate) fn unverified_allowed() -> bool {
    ALLOW_UNVERIFIED.load(Relaxed) != 0
}

/// The `path_policy` parameter: 0 allows every path; 1..=5 refuse paths
/// worse than PIX..SYS.
pub(crate) fn policy_level() -> i32 {
    PATH_POLICY.load(Relaxed) as i32
}

/// The `path_accounting` parameter: whether registrations are charged per
/// pair, GPU and process.
pub(crate) fn accounting() -> bool {
    PATH_ACCOUNTING.load(Relaxed) != 0
}
