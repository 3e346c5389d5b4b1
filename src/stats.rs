// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Exact counters, readable in debugfs as `nvidia_peermem/stats`, and the
//! once-per-cause error log.

use core::fmt;

use kernel::{
    str::CStrExt as _,
    sync::atomic::{
        Atomic,
        Relaxed, //
    },
};

/// Declares the counters: each a field of [`Stats`], shown under its name.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        /// The module's counters.
        pub(crate) struct Stats {
            $($(#[doc = $doc])* pub(crate) $name: Atomic<u64>,)*
            failures: [Atomic<u64>; CAUSES],
            logged: [Atomic<u32>; CAUSES],
        }

        impl Stats {
            const fn new() -> Self {
                Self {
                    $($name: Atomic::new(0),)*
                    failures: [const { Atomic::new(0) }; CAUSES],
                    logged: [const { Atomic::new(0) }; CAUSES],
                }
            }

            fn plain(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
                [$((stringify!($name), self.$name.load(Relaxed)),)*].into_iter()
            }
        }
    };
}

/// Declares the causes of failure, each counted as `fail_<name>`.
macro_rules! causes {
    ($($(#[doc = $doc:literal])* $cause:ident = $name:literal,)*) => {
        /// Why a call failed, for counting and for logging once.
        #[derive(Clone, Copy, Debug)]
        pub(crate) enum Cause {
            $($(#[doc = $doc])* $cause,)*
        }

        const CAUSES: usize = [$($name,)*].len();
        const CAUSE_NAMES: [&str; CAUSES] = [$($name,)*];
    };
}

causes! {
    /// The range is empty or overflows.
    BadRange = "bad_range",
    /// The provider refused to pin.
    Pin = "pin",
    /// The provider's page table has an unknown version or page size.
    PageTable = "page_table",
    /// The `dma_device` is not a PCI device.
    NotPci = "not_pci",
    /// The provider refused to DMA-map.
    DmaMap = "dma_map",
    /// The provider's DMA mapping has an unknown version or page size.
    DmaMapping = "dma_mapping",
    /// Out of memory building the scatterlist or the context.
    NoMemory = "no_memory",
    /// The GPU memory was freed during registration.
    Revoked = "revoked",
    /// The provider failed to unpin or unmap.
    Unpin = "unpin",
    /// The core called out of order.
    Order = "order",
    /// The path policy refused the GPU/peer pair.
    PathPolicy = "path_policy",
    /// The GPU driver's topology gate refuses the GPU/peer pair.
    Topology = "topology",
}

counters! {
    /// Bytes currently pinned (64 KiB granules).
    pinned_bytes,
    /// Ranges claimed by `acquire`.
    acquired,
    /// Ranges `acquire` declined (not GPU memory, or not ours).
    declined,
    /// Registrations that reached the mapped state.
    registrations,
    /// Registrations released.
    releases,
    /// Free callbacks received from the GPU driver.
    invalidations,
    /// Calls of the core's invalidate hook.
    core_invalidations,
    /// Scatterlist entries handed out.
    sg_entries,
    /// Releases in another process than the pinning one (the GPU driver's
    /// unpin would do nothing there): the pin waited for the free callback.
    foreign_releases,
    /// Pins left to the free callback by such releases, still waiting.
    orphaned_pins,
    /// Pins whose unpin failed, still waiting for the free callback.
    stranded_pins,
    /// Persistent pins whose unpin failed (lost to the client).
    leaked_pins,
    /// Calls of the core that found a persistent registration busy with
    /// another of its calls (see `registration`): 0 unless the core breaks
    /// its one-call-at-a-time order.
    claim_waits,
    /// Calls of the core on a registration through the other client of the
    /// module than the one whose `acquire` made it (see `client::called`):
    /// 0 with a core that keeps a registration's client, as OFED's does.
    crossed_calls,
    /// Persistent pins made to ask the GPU driver's topology gate about a
    /// GPU's peers (see `topology::learn_gate`): one per GPU per load.
    topology_probes,
}

/// The counters of this module.
pub(crate) static STATS: Stats = Stats::new();

impl Stats {
    /// Counts a failure; true the first time for this cause (log it then).
    pub(crate) fn fail(&self, cause: Cause) -> bool {
        self.failures[cause as usize].add(1, Relaxed);
        self.logged[cause as usize].xchg(1, Relaxed) == 0
    }

    /// Writes every counter as a `name value` line.
    pub(crate) fn show(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Registrations the core holds: acquired and not yet released.
        // Releases are read first, so a concurrent registration never makes
        // this negative.
        let released = self.releases.load(Relaxed);
        let live = self.acquired.load(Relaxed).saturating_sub(released);
        writeln!(f, "live_registrations {live}")?;
        for (name, v) in self.plain() {
            writeln!(f, "{name} {v}")?;
        }
        for (name, n) in CAUSE_NAMES.iter().zip(&self.failures) {
            writeln!(f, "fail_{name} {}", n.load(Relaxed))?;
        }
        Ok(())
    }
}

/// Counts `err` under `cause` and logs the first occurrence of each cause at
/// error level; later ones are only counted.
macro_rules! fail {
    ($cause:expr, $err:expr, $($fmt:tt)*) => {
        $crate::stats::failed($cause, $err, ::core::format_args!($($fmt)*))
    };
}
pub(crate) use fail;

/// The body of [`fail!`].
#[cold]
pub(crate) fn failed(
    cause: Cause,
    err: kernel::error::Error,
    what: fmt::Arguments<'_>,
) -> kernel::error::Error {
    if STATS.fail(cause) {
        kernel::pr_err!(
            "{what} ({err:?}); later failures of this kind are only counted in debugfs\n"
        );
    }
    err
}

/// Per-registration detail through the module's dynamic-debug call site.
macro_rules! reg_dbg {
    ($($fmt:tt)*) => {{
        // SAFETY: NULL asks whether the call site is enabled, printing nothing.
        if unsafe { $crate::ffi::peermem_dbg(core::ptr::null()) } {
            $crate::stats::debug_line(::core::format_args!($($fmt)*));
        }
    }};
}
pub(crate) use reg_dbg;

/// Prints a debug line through the module's dynamic-debug call site.
#[cold]
pub(crate) fn debug_line(args: fmt::Arguments<'_>) {
    if let Ok(line) = kernel::str::CString::try_from_fmt(args) {
        // SAFETY: a NUL-terminated string, alive during the call.
        unsafe { crate::ffi::peermem_dbg(line.as_char_ptr()) };
    }
}
