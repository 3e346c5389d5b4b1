// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Exact counters, one file each in sysfs (`stats/counters/<name>`, see
//! `views`), and the
//! rate-limited refusal log: one line per refusal, naming the process, the
//! GPU and the HCA, with the errno in the kernel's words.

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
        }

        impl Stats {
            const fn new() -> Self {
                Self {
                    $($name: Atomic::new(0),)*
                    failures: [const { Atomic::new(0) }; CAUSES],
                }
            }

            fn plain(&self) -> impl Iterator<Item = (&'static kernel::str::CStr, &Atomic<u64>)> {
                [$((kernel::c_str!(stringify!($name)), &self.$name),)*].into_iter()
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
        const CAUSE_NAMES: [&kernel::str::CStr; CAUSES] = [$(kernel::c_str!(concat!("fail_", $name)),)*];
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
    /// The module is draining (`/sys/module/nvidia_peermem/drain`).
    Draining = "draining",
    /// The pin would take the GPU's BAR1 use past `bar1_limit_pct`.
    Bar1 = "bar1",
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
    /// Registrations the drain revoked through the core.
    drain_revoked,
    /// Persistent pins made to ask the GPU driver's topology gate about a
    /// GPU's peers (see `topology::learn_gate`): one per GPU per load.
    topology_probes,
}

/// The counters of this module.
pub(crate) static STATS: Stats = Stats::new();

impl Stats {
    /// Counter `i`'s name and value: `live_registrations`, the plain
    /// counters, then `fail_<cause>`; `None` past the last.
    pub(crate) fn counter(&self, i: usize) -> Option<(&'static kernel::str::CStr, u64)> {
        let Some(j) = i.checked_sub(1) else {
            // Registrations the core holds: acquired and not yet released.
            // Releases are read first, so a concurrent registration never
            // makes this negative.
            let released = self.releases.load(Relaxed);
            let live = self.acquired.load(Relaxed).saturating_sub(released);
            return Some((c"live_registrations", live));
        };
        let causes = CAUSE_NAMES.into_iter().zip(&self.failures);
        let (name, n) = Iterator::chain(self.plain(), causes).nth(j)?;
        Some((name, n.load(Relaxed)))
    }
}

/// Writes a PCI address (domain << 16 | bus << 8 | devfn); `-` for 0 (not
/// known).
#[derive(Clone, Copy)]
pub(crate) struct Bdf(pub(crate) u32);

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.0;
        if v == 0 {
            return f.write_str("-");
        }
        let (dom, bus, dev, func) = (v >> 16, (v >> 8) & 0xff, (v >> 3) & 0x1f, v & 7);
        write!(f, "{dom:04x}:{bus:02x}:{dev:02x}.{func}")
    }
}

impl kernel::fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Where a refusal happened, as far as known: the GPU's and the HCA's PCI
/// addresses (0: not known at that point, e.g. the HCA before `dma_map`).
///
/// `At::default()`: neither is known.
#[derive(Clone, Copy, Default)]
pub(crate) struct At {
    pub(crate) gpu: u32,
    pub(crate) hca: u32,
}

/// The kernel's name of an errno, the same on every kernel (not depending on
/// `CONFIG_SYMBOLIC_ERRNAME`).
pub(crate) fn errno_name(e: kernel::error::Error) -> &'static str {
    match -e.to_errno() {
        1 => "EPERM",
        2 => "ENOENT",
        5 => "EIO",
        7 => "E2BIG",
        11 => "EAGAIN",
        12 => "ENOMEM",
        13 => "EACCES",
        14 => "EFAULT",
        16 => "EBUSY",
        19 => "ENODEV",
        22 => "EINVAL",
        28 => "ENOSPC",
        34 => "ERANGE",
        75 => "EOVERFLOW",
        95 => "EOPNOTSUPP",
        110 => "ETIMEDOUT",
        524 => "ENOTSUPP",
        _ => "EOTHER",
    }
}

/// Counts `err` under `cause` and logs it, rate-limited, with the calling
/// process and where it happened (`at <At>;` first, if known).
macro_rules! fail {
    (at $at:expr; $cause:expr, $err:expr, $($fmt:tt)*) => {
        $crate::stats::failed($at, $cause, $err, ::core::format_args!($($fmt)*))
    };
    ($cause:expr, $err:expr, $($fmt:tt)*) => {
        $crate::stats::fail!(at $crate::stats::At::default(); $cause, $err, $($fmt)*)
    };
}
pub(crate) use fail;

/// The body of [`fail!`]: `refused pid=<tgid> comm=<name> gpu=<bdf> hca=<bdf>
/// errno=<name>: <what>`, at most 10 lines per 5 s (the kernel's default
/// rate limit); every refusal is counted.
#[cold]
pub(crate) fn failed(
    at: At,
    cause: Cause,
    err: kernel::error::Error,
    what: fmt::Arguments<'_>,
) -> kernel::error::Error {
    STATS.failures[cause as usize].add(1, Relaxed);
    if crate::ffi::peermem_ratelimit() {
        let tgid = crate::compat::current_tgid();
        let comm = crate::compat::Comm::of(tgid);
        kernel::pr_err!(
            "refused pid={tgid} comm={} gpu={} hca={} errno={}: {what}\n",
            comm.name(),
            Bdf(at.gpu),
            Bdf(at.hca),
            errno_name(err)
        );
    }
    err
}

/// Per-registration detail through the module's dynamic-debug call site.
macro_rules! reg_dbg {
    ($($fmt:tt)*) => {{
        if $crate::ffi::peermem_dbg_on() {
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
