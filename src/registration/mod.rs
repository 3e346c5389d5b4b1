// SPDX-License-Identifier: GPL-2.0 OR MIT

//! One registration: pin → bind → map → (revoke) → unmap → unpin → release.
//!
//! A registration is shared by the core (through `client_context`) and, in
//! invalidating mode, by the GPU driver's free callback, each holding its own
//! reference ([`refs`]); it is freed when the last one goes, so `release`
//! cannot free it under a running callback. Its [`Lifecycle`] owns every
//! provider object and decides, under the registration's spinlock (never
//! held across a provider or core call), who may use which.
//!
//! - [`acquire`]: the object and its pin.
//! - [`map`]: `get_pages`, `dma_map`, `dma_unmap`, `put_pages`.
//! - [`release`]: the unpin, and the pins the core let go of.
//! - [`revoke`]: the GPU driver's free callback.
//!
//! An invalidating registration is called by the core and, concurrently, by
//! the free callback, and those calls wait for each other (a `release` for a
//! callback inside the core, a callback for a `dma_map` reading the page
//! table), on the module's wait queue. A persistent registration has no free
//! callback: only the core calls it, one call at a time (it makes and
//! destroys a umem in one thread each; docs/driver-facts.md, facts 12 to
//! 14); the drain takes its lock only to name its process.

mod acquire;
mod map;
pub(crate) mod refs;
pub(crate) mod registry;
mod release;
mod revoke;

use core::{
    fmt,
    num::NonZeroU32, //
};

use kernel::{
    bindings,
    prelude::*,
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        lock::{
            spinlock::SpinLockBackend,
            Guard, //
        },
        Refcount, SpinLock,
    },
    types::Opaque,
};

use crate::{
    accounting::Charge,
    device_map::DeviceMap,
    lifecycle::{
        Lifecycle,
        Refusal,
        Resources, //
    },
    p2p::PageTable,
    range::{
        self,
        GpuRange, //
    },
    sg::SgSlot,
    stats::{
        fail,
        Cause, //
    },
    waitq,
};

pub(crate) use crate::lifecycle::Mode;

use refs::{
    Counted,
    Liveness, //
};

/// A counted reference on a registration.
pub(crate) type RegRef = refs::Ref<Registration>;

/// The module's cache of registration objects.
pub(crate) type RegCache = refs::ObjectCache;

/// The reference on a registration that the GPU driver holds while the free
/// callback of a non-persistent pin is armed: a token without data (the
/// registration that holds it in its lifecycle is the one referenced).
///
/// # Invariants
///
/// Made only by [`acquire`]'s pin, when the GPU driver accepted the callback
/// with a counted reference on the pinning registration, which belongs to the
/// driver: the free callback consumes it, or [`ArmedCallback::reclaim`] takes
/// it back after an unpin the callback did not race. Dropping the token
/// leaves the reference where it is.
pub(crate) struct ArmedCallback(());

impl ArmedCallback {
    /// Takes the GPU driver's reference on `reg` back.
    ///
    /// # Safety
    ///
    /// `reg` must be the registration whose pin made this token. The driver
    /// unpinned the pages (in the pinning process, with success) and the free
    /// callback did not run, so it never will: the driver looks the pin up
    /// under the lock it holds across the callback (docs/driver-facts.md,
    /// facts 2 and 8; scenario `unpin_races_free_callback`).
    unsafe fn reclaim(self, reg: &Registration) -> RegRef {
        // SAFETY: the driver's reference is counted on `reg` (type invariant)
        // and no longer the driver's (caller).
        unsafe { RegRef::adopt(reg) }
    }
}

/// The objects a registration's lifecycle owns.
pub(crate) struct Held;

impl Resources for Held {
    type Table = PageTable;
    type Token = ArmedCallback;
    type Map = DeviceMap;
}

/// A registration's state, under its lock.
struct Inner {
    lc: Lifecycle<Held>,
    /// The provider refused to pin a range that is its memory (BAR1
    /// exhausted, ...): reported by `get_pages` as the errno it is, instead of
    /// the core's "Bad address" for memory nobody claimed.
    pin_error: Option<Error>,
    /// The thread (by id) whose free callback is inside the core's invalidate
    /// for this registration; `release` waits until it is out.
    in_core: Option<NonZeroU32>,
    /// A `dma_map` is reading the page table; a free callback waits until
    /// it is done before returning (the provider frees the table then).
    mapper: bool,
    /// Tasks of this registration waiting on the module's queue: wake-ups
    /// are sent only when there are some.
    waiters: u16,
    /// What the registration is counted under per pair, GPU and process,
    /// from its mapping until its pin ends.
    charge: Option<Charge>,
    /// Its pin's charge to its GPU's BAR1 use, from the pin until the pin
    /// ends.
    bar1: Option<crate::accounting::Bar1>,
}

/// Inside a registration's lock.
type Entered<'a> = Guard<'a, Inner, SpinLockBackend>;

/// A pin's counts (per pair, GPU and process; its GPU's BAR1 use), taken
/// out of the state to be released outside the lock.
#[derive(Default)]
struct Charges(Option<Charge>, Option<crate::accounting::Bar1>);

impl Charges {
    /// Releases them for the pin of `len` bytes that ended.
    fn release(self, len: u64) {
        if let Some(c) = self.0 {
            c.release(len);
        }
        if let Some(b) = self.1 {
            b.release(len);
        }
    }
}

impl Inner {
    /// Takes the pin's counts out, to release once outside the lock; none
    /// unless `ended`.
    fn charges(&mut self, ended: bool) -> Charges {
        match ended {
            true => Charges(self.charge.take(), self.bar1.take()),
            false => Charges::default(),
        }
    }
}

/// One registration of a GPU range with the peer-memory core.
///
/// # Invariants
///
/// `mode` never changes; the widened range is `start` and `granules`. The
/// object is on the drain's registry (`link`) from right after its
/// initialisation until it is dropped.
#[pin_data(PinnedDrop)]
pub(crate) struct Registration {
    mode: Mode,
    /// The widened range (see [`Registration::range`]): its start, and its
    /// length in granules.
    start: u64,
    granules: u32,
    #[pin]
    inner: SpinLock<Inner>,
    /// The scatterlist entry of a mapping of one segment, of either
    /// back-end (several segments have a table of their own). Only the mapping
    /// being made or held by `inner` uses it (the lifecycle holds at most
    /// one, built in Mapping), and every mapping is dropped before the
    /// registration is freed.
    sg_slot: SgSlot,
    /// Whether the lifecycle holds a mapping: written under `inner` by every
    /// call that installs or takes one, read without it by `put_pages`,
    /// which the core calls right after `dma_unmap` and which then has
    /// nothing to do.
    holds_map: Atomic<u32>,
    refs: Refcount,
    /// Its link on the reap list (`refs::defer`).
    #[pin]
    reap_link: Opaque<bindings::llist_node>,
    /// Its link on the drain's registry.
    #[pin]
    link: Opaque<bindings::list_head>,
    _live: Liveness,
}

#[pinned_drop]
impl PinnedDrop for Registration {
    fn drop(self: Pin<&mut Self>) {
        registry::remove(&self.link);
    }
}

// SAFETY: a registration is initialized only by `acquire`, in an object of
// the module's cache (`Spare::init`).
unsafe impl Counted for Registration {
    fn refs(&self) -> &Refcount {
        &self.refs
    }

    fn reap_link(&self) -> &Opaque<bindings::llist_node> {
        &self.reap_link
    }
}

/// The pinning granule: ranges are widened to it.
const GRANULE: u64 = range::granule(bindings::PAGE_SIZE as u64);

/// A range as log lines show it: `start+len`, in hex.
struct Span(GpuRange);

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}+{:#x}", self.0.start, self.0.len)
    }
}

fn refused(r: Refusal, call: &str) -> Error {
    match r {
        Refusal::Revoked => fail!(
            Cause::Revoked,
            EFAULT,
            "GPU memory freed (or the module drained) before {call}"
        ),
        Refusal::Forbidden(p) => fail!(Cause::Order, EINVAL, "{call} in phase {p:?}"),
    }
}

impl Registration {
    /// Enters the registration's state.
    fn enter(&self) -> Entered<'_> {
        self.inner.lock()
    }

    /// Whether `put_pages` has anything to do: not without a mapping (the
    /// core's usual order is `dma_unmap`, then `put_pages`), which this
    /// tells without entering the registration's state. A mapping is
    /// installed only by `dma_map`, which the core does not run concurrently
    /// with `put_pages` of the same registration; if a core did, skipping is
    /// the same as running just before the install, and `dma_unmap` or
    /// `release` (which always takes the mapping) undoes it.
    pub(crate) fn put_pages_needed(&self) -> bool {
        self.holds_map.load(Relaxed) != 0
    }

    /// The GPU range this registration pinned (the user's, widened to whole
    /// granules).
    fn range(&self) -> GpuRange {
        GpuRange {
            start: self.start,
            len: u64::from(self.granules) * GRANULE,
        }
    }

    /// Waits on the module's queue, counted in `waiters` so that wakers
    /// know. Whoever changes what the caller waits for does so under this
    /// registration's lock and then wakes the queue.
    fn wait(&self, g: &mut Entered<'_>) {
        // Always there: a registration exists only while the queue does
        // (checked by `acquire`; the queue goes only after the last one).
        let Some(q) = waitq::queue() else {
            return;
        };
        g.waiters += 1;
        q.wait(g);
        g.waiters -= 1;
    }

    /// Wakes the waiters of this registration, if any (the caller holds the
    /// lock and changed what they wait for). The queue is the module's: the
    /// waiters of other registrations wake too, find their condition
    /// unchanged and sleep again.
    fn wake(&self, g: &Inner) {
        if g.waiters > 0 {
            if let Some(q) = waitq::queue() {
                q.notify_all();
            }
        }
    }
}

// The object of the module's cache (a registration with its count, its lock,
// its one-entry scatterlist, its mapping and its link on the drain's
// registry) stays within the C module's memory per registration: its context
// (kmalloc-128) plus its one-entry scatterlist (kmalloc-32), 160 bytes.
// Production kernels only: lock debugging makes every lock bigger. The bound
// is 160 with the 4-byte spinlock_t of a non-RT kernel; on PREEMPT_RT
// spinlock_t is a sleeping rt_mutex, and the bound grows by exactly what the
// lock grows by.
#[cfg(not(any(CONFIG_LOCKDEP, CONFIG_DEBUG_SPINLOCK)))]
const _: () = assert!(
    core::mem::size_of::<Registration>() <= 160 - 4 + core::mem::size_of::<bindings::spinlock_t>()
);
#[cfg(not(any(CONFIG_LOCKDEP, CONFIG_DEBUG_SPINLOCK, CONFIG_PREEMPT_RT)))]
const _: () = assert!(core::mem::size_of::<bindings::spinlock_t>() == 4);
