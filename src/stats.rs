// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Exact counters, readable in debugfs as `nvidia_peermem/stats`, and the
//! once-per-cause error log.

use core::fmt;

use crate::atomics::{
    Atomic,
    Relaxed, //
};

/// Why a call failed, for counting and for logging once.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Cause {
    /// The range is empty or overflows.
    BadRange,
    /// The provider refused to pin.
    Pin,
    /// The provider's page table has an unknown version or page size.
    PageTable,
    /// The `dma_device` is not a PCI device.
    NotPci,
    /// The provider refused to DMA-map.
    DmaMap,
    /// The provider's DMA mapping has an unknown version or page size.
    DmaMapping,
    /// Out of memory building the scatterlist or the context.
    NoMemory,
    /// The GPU memory was freed during registration.
    Revoked,
    /// The provider failed to unpin or unmap.
    Unpin,
    /// The core called out of order.
    Order,
    /// The path policy refused the GPU/peer pair.
    PathPolicy,
    Topology,
}

const CAUSES: usize = 12;

impl Cause {
    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            Cause::BadRange => "bad_range",
            Cause::Pin => "pin",
            Cause::PageTable => "page_table",
            Cause::NotPci => "not_pci",
            Cause::DmaMap => "dma_map",
            Cause::DmaMapping => "dma_mapping",
            Cause::NoMemory => "no_memory",
            Cause::Revoked => "revoked",
            Cause::Unpin => "unpin",
            Cause::Order => "order",
            Cause::PathPolicy => "path_policy",
            Cause::Topology => "topology",
        }
    }

    const ALL: [Cause; CAUSES] = [
        Cause::BadRange,
        Cause::Pin,
        Cause::PageTable,
        Cause::NotPci,
        Cause::DmaMap,
        Cause::DmaMapping,
        Cause::NoMemory,
        Cause::Revoked,
        Cause::Unpin,
        Cause::Order,
        Cause::PathPolicy,
        Cause::Topology,
    ];
}

/// The module's counters.
pub(crate) struct Stats {
    /// Bytes currently pinned (64 KiB granules).
    pub(crate) pinned_bytes: Atomic<u64>,
    /// Ranges claimed by `acquire`.
    pub(crate) acquired: Atomic<u64>,
    /// Ranges `acquire` declined (not GPU memory, or not ours).
    pub(crate) declined: Atomic<u64>,
    /// Registrations that reached the mapped state.
    pub(crate) registrations: Atomic<u64>,
    /// Registrations released.
    pub(crate) releases: Atomic<u64>,
    /// Free callbacks received from the GPU driver.
    pub(crate) invalidations: Atomic<u64>,
    /// Calls of the core's invalidate hook.
    pub(crate) core_invalidations: Atomic<u64>,
    /// Scatterlist entries handed out.
    pub(crate) sg_entries: Atomic<u64>,
    /// Non-persistent mappings made in a pair's whole-BAR window
    /// (`bar_window`) instead of a DMA mapping of their own.
    pub(crate) window_maps: Atomic<u64>,
    /// Releases in another process than the pinning one (the GPU driver's
    /// unpin would do nothing there): the pin waited for the free callback.
    pub(crate) foreign_releases: Atomic<u64>,
    /// Pins left to the free callback by such releases, still waiting.
    pub(crate) orphaned_pins: Atomic<u64>,
    /// Pins whose unpin failed, still waiting for the free callback.
    pub(crate) stranded_pins: Atomic<u64>,
    /// Persistent pins whose unpin failed (lost to the client).
    pub(crate) leaked_pins: Atomic<u64>,
    /// Calls of the core that found a persistent registration busy with
    /// another of its calls (see `access`): 0 unless the core breaks its
    /// one-call-at-a-time order.
    pub(crate) claim_waits: Atomic<u64>,
    /// Calls of the core on a registration through the other client of the
    /// module than the one whose `acquire` made it (see `client::called`):
    /// 0 with a core that keeps a registration's client, as OFED's does.
    pub(crate) crossed_calls: Atomic<u64>,
    /// Of `window_maps`, those made in one section of the registration's
    /// lock (at most `WINDOW_RUN_PAGES` pages; see `registration`).
    pub(crate) single_section_maps: Atomic<u64>,
    /// Persistent pins made to ask the GPU driver's topology gate about a
    /// GPU's peers (see `topology::learn_gate`): one per GPU per load.
    pub(crate) topology_probes: Atomic<u64>,
    failures: [Atomic<u64>; CAUSES],
    logged: [Atomic<u32>; CAUSES],
}

/// The counters of this module.
pub(crate) static STATS: Stats = Stats::new();

impl Stats {
    const fn new() -> Self {
        Self {
            pinned_bytes: Atomic::new(0),
            acquired: Atomic::new(0),
            declined: Atomic::new(0),
            registrations: Atomic::new(0),
            releases: Atomic::new(0),
            invalidations: Atomic::new(0),
            core_invalidations: Atomic::new(0),
            sg_entries: Atomic::new(0),
            window_maps: Atomic::new(0),
            foreign_releases: Atomic::new(0),
            orphaned_pins: Atomic::new(0),
            stranded_pins: Atomic::new(0),
            leaked_pins: Atomic::new(0),
            claim_waits: Atomic::new(0),
            crossed_calls: Atomic::new(0),
            topology_probes: Atomic::new(0),
            single_section_maps: Atomic::new(0),
            failures: [const { Atomic::new(0) }; CAUSES],
            logged: [const { Atomic::new(0) }; CAUSES],
        }
    }

    /// Counts a failure; true the first time for this cause (log it then).
    pub(crate) fn fail(&self, cause: Cause) -> bool {
        self.failures[cause.index()].add(1, Relaxed);
        self.logged[cause.index()].xchg(1, Relaxed) == 0
    }

    /// Failures counted for `cause`.
    pub(crate) fn failures(&self, cause: Cause) -> u64 {
        self.failures[cause.index()].load(Relaxed)
    }

    /// Writes every counter as a `name value` line.
    pub(crate) fn show(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Registrations the core holds: acquired and not yet released (one
        // counter fewer to update per registration). Releases are read first,
        // so a concurrent registration never makes this negative.
        let released = self.releases.load(Relaxed);
        writeln!(
            f,
            "live_registrations {}",
            self.acquired.load(Relaxed).saturating_sub(released)
        )?;
        let plain = [
            ("pinned_bytes", &self.pinned_bytes),
            ("acquired", &self.acquired),
            ("declined", &self.declined),
            ("registrations", &self.registrations),
            ("releases", &self.releases),
            ("invalidations", &self.invalidations),
            ("core_invalidations", &self.core_invalidations),
            ("sg_entries", &self.sg_entries),
            ("window_maps", &self.window_maps),
            ("single_section_maps", &self.single_section_maps),
            ("foreign_releases", &self.foreign_releases),
            ("orphaned_pins", &self.orphaned_pins),
            ("stranded_pins", &self.stranded_pins),
            ("leaked_pins", &self.leaked_pins),
            ("claim_waits", &self.claim_waits),
            ("crossed_calls", &self.crossed_calls),
            ("topology_probes", &self.topology_probes),
        ];
        for (name, v) in plain {
            writeln!(f, "{name} {}", v.load(Relaxed))?;
        }
        writeln!(f, "bar_windows {}", crate::bar_window::live())?;
        for c in Cause::ALL {
            writeln!(f, "fail_{} {}", c.name(), self.failures(c))?;
        }
        Ok(())
    }
}

/// Counts `err` under `cause` and logs the first occurrence of each cause at
/// error level; later ones are only counted. Out of line and cold, so that
/// the hot paths that can fail stay compact.
macro_rules! fail {
    ($cause:expr, $err:expr, $($fmt:tt)*) => {
        $crate::stats::failed($cause, $err, ::core::format_args!($($fmt)*))
    };
}

/// The body of [`fail!`].
#[cold]
#[inline(never)]
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
pub(crate) use fail;

/// Per-registration detail through the module's dynamic-debug call site.
macro_rules! reg_dbg {
    ($($fmt:tt)*) => {{
        // SAFETY: no preconditions.
        if unsafe { $crate::ffi::peermem_dbg(core::ptr::null()) } {
            $crate::stats::debug_line(::core::format_args!($($fmt)*));
        }
    }};
}
pub(crate) use reg_dbg;

/// Formats a debug line into a small buffer and prints it.
#[cold]
#[inline(never)]
pub(crate) fn debug_line(args: fmt::Arguments<'_>) {
    struct Buf {
        b: [u8; 160],
        n: usize,
    }
    impl fmt::Write for Buf {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            let room = self.b.len() - 1 - self.n;
            let take = core::cmp::min(room, s.len());
            self.b[self.n..self.n + take].copy_from_slice(&s.as_bytes()[..take]);
            self.n += take;
            Ok(())
        }
    }
    let mut buf = Buf { b: [0; 160], n: 0 };
    let _ = fmt::write(&mut buf, args);
    buf.b[buf.n] = 0;
    // SAFETY: `buf.b` is NUL-terminated.
    unsafe { crate::ffi::peermem_dbg(buf.b.as_ptr()) };
}
