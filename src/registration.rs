// SPDX-License-Identifier: GPL-2.0 OR MIT

//! One registration: pin → bind → map → (revoke) → unmap → unpin → release.
//!
//! A registration is shared by the core (through `client_context`) and, in
//! invalidating mode, by the GPU driver's free callback, each holding its own
//! reference; it is freed when the last one goes, so `release` cannot free it
//! under a running callback. Its [`Lifecycle`] owns every provider object and
//! decides, under a spinlock (invalidating) or a claim (persistent; see
//! `access`) that is never held across a provider or core call, who may use
//! which.

use kernel::{
    bindings,
    prelude::*, //
};

use core::{
    marker::PhantomData,
    num::NonZeroU32,
    ops::Deref, //
};

use crate::{
    access::{
        Access,
        Entered,
        Locked,
        RegState, //
    },
    accounting::Charge,
    atomics::{
        Atomic,
        Relaxed, //
    },
    bar_map,
    coalesce::{
        segment_limit,
        Segment, //
    },
    compat,
    core_link::CoreLink,
    device_map::DeviceMap,
    lifecycle::{
        Invalidate,
        Lifecycle,
        Pin,
        Refusal,
        Resources,
        Unpinned, //
    },
    liveness::Liveness,
    p2p::{
        self,
        ArmedCallback,
        PageTable,
        PageView, //
    },
    path::Gate,
    peer_device::PeerDevice,
    provider_map,
    range::{
        self,
        GpuRange,
        GPU_PAGE_SIZE, //
    },
    reaper::ReapLink,
    reg_ref::{
        RefCount,
        RegRef,
        Spare, //
    },
    sg::SgSlot,
    stats::{
        fail,
        reg_dbg,
        Cause,
        STATS, //
    },
    topology::{
        self,
        Route, //
    },
};

/// How a registration's pages are pinned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `nvidia_p2p_get_pages_persistent`: no free callback.
    Persistent,
    /// `nvidia_p2p_get_pages` with a free callback that revokes through the
    /// core's invalidate hook.
    Invalidating,
}

/// The objects a registration's lifecycle owns.
pub(crate) struct Held;

impl Resources for Held {
    type Table = PageTable;
    type Token = ArmedCallback;
    type Map = DeviceMap;
}

struct Inner {
    lc: Lifecycle<Held>,
    /// The provider refused to pin a range that is its memory (BAR1
    /// exhausted, ...): reported by `get_pages` as the errno it is, instead of
    /// the core's "Bad address" for memory nobody claimed.
    pin_error: Option<Error>,
    /// The thread (by id) whose free callback is inside the core's invalidate for this
    /// registration; `release` waits until it is out.
    in_core: Option<NonZeroU32>,
    /// A `dma_map` is reading the page table; a free callback waits until
    /// it is done before returning (the provider frees the table then).
    mapper: bool,
    /// Tasks of this registration waiting on the module's queue: wake-ups
    /// are sent only when there are some (a registration without races
    /// never calls into the wait queue).
    waiters: u16,
    /// What the registration is counted under per pair, GPU and process,
    /// from its mapping until its pin ends.
    charge: Option<Charge>,
}

/// One registration of a GPU range with the peer-memory core.
///
/// # Invariants
///
/// `mode` never changes, and `inner` is entered only through a [`Called`]
/// of `mode`'s [`Access`], so always the same way (what [`RegState`]
/// requires).
#[pin_data]
pub(crate) struct Registration {
    mode: Mode,
    /// The widened range (see [`Registration::range`]): its start, and its
    /// length in granules (a `u32` keeps the object within 144 bytes).
    start: u64,
    granules: u32,
    /// Entered only through [`Called`], the way of `mode`.
    #[pin]
    inner: RegState<Inner>,
    /// The scatterlist entry of a one-run mapping, or the header of the
    /// scatterlist of a persistent mapping of several runs (whose entries
    /// are allocated; see `device_map`). Only the mapping being
    /// made or held by `inner` uses it (the lifecycle holds at most one,
    /// built in Mapping), and every mapping is dropped before the
    /// registration is freed (it lives in `inner` or in a local of a method).
    sg_slot: SgSlot,
    /// Whether the lifecycle holds a mapping: written under `inner` by every
    /// call that installs or takes one, read without it by `put_pages`,
    /// which the core calls right after `dma_unmap` and which then has
    /// nothing to do (see there).
    holds_map: Atomic<u32>,
    /// The references on this object (see [`RegRef`]).
    refs: RefCount,
    /// Its link on the module's reap list (see `reaper`).
    reap_link: ReapLink,
    _live: Liveness,
}

// The object of the module's cache (a registration with its count, its lock,
// its one-entry scatterlist and its mapping) stays below the C module's
// memory per registration: its context (kmalloc-128) plus its one-entry
// scatterlist (kmalloc-32), 160 bytes. At 144 bytes the cache packs 28
// objects per 4 KiB page (146 bytes each); at 160 it would pack 25 (164).
// Production kernels only: lock debugging makes every lock bigger.
#[cfg(not(any(CONFIG_LOCKDEP, CONFIG_DEBUG_SPINLOCK)))]
const _: () = assert!(core::mem::size_of::<Registration>() <= 144);

/// A registration as a call of its client sees it: entered the `A` way.
///
/// # Invariants
///
/// `reg.mode` is `A::MODE`, so every `Called` of one registration enters its
/// state the same way (what [`RegState::enter`] requires).
pub(crate) struct Called<'a, A: Access> {
    reg: &'a Registration,
    _access: PhantomData<A>,
}

impl<A: Access> Clone for Called<'_, A> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A: Access> Copy for Called<'_, A> {}

impl<A: Access> Deref for Called<'_, A> {
    type Target = Registration;

    #[inline(always)]
    fn deref(&self) -> &Registration {
        self.reg
    }
}

impl<'a, A: Access> Called<'a, A> {
    /// Enters the registration's state.
    #[inline(always)]
    fn enter(self) -> Entered<'a, Inner, A> {
        // SAFETY: every `Called` of this registration has the `A` of its
        // mode (type invariant), and `Called` is the only way in.
        unsafe { self.reg.inner.enter::<A>() }
    }
}

/// The pinning granule: ranges are widened to it.
const GRANULE: u64 = range::granule(bindings::PAGE_SIZE as u64);

/// The calling thread, compared only.
fn current_task() -> NonZeroU32 {
    compat::current_ids().0
}

fn refused(r: Refusal, call: &str) -> Error {
    match r {
        Refusal::Revoked => fail!(Cause::Revoked, EFAULT, "GPU memory freed before {call}"),
        Refusal::Forbidden(p) => fail!(Cause::Order, EINVAL, "{call} in phase {p:?}"),
    }
}

impl Registration {
    /// This registration as a call of the client of mode `A::MODE` sees
    /// it, if it is of that mode.
    #[inline(always)]
    pub(crate) fn called<A: Access>(&self) -> Option<Called<'_, A>> {
        // INVARIANT: the mode matches the `Access`.
        (self.mode == A::MODE).then_some(Called {
            reg: self,
            _access: PhantomData,
        })
    }

    /// This registration as a call of the client of mode `A::MODE` sees
    /// it, without checking its mode.
    ///
    /// # Safety
    ///
    /// The registration's mode is `A::MODE`.
    #[inline(always)]
    pub(crate) unsafe fn called_unchecked<A: Access>(&self) -> Called<'_, A> {
        // INVARIANT: the mode matches the `Access` (caller).
        Called {
            reg: self,
            _access: PhantomData,
        }
    }

    /// The mode of the client whose `acquire` made this registration.
    #[inline(always)]
    pub(crate) fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether `put_pages` has anything to do: not without a mapping (the
    /// core's usual order is `dma_unmap`, then `put_pages`), which this
    /// tells without entering the registration's state, whatever its mode.
    /// A mapping is installed only by `dma_map`, which the core does not run
    /// concurrently with `put_pages` of the same registration; if a core
    /// did, skipping is the same as running just before the install, and
    /// `dma_unmap` or `release` (which always takes the mapping) undoes it.
    #[inline(always)]
    pub(crate) fn put_pages_needed(&self) -> bool {
        self.holds_map.load(Relaxed) != 0
    }

    /// The GPU range this registration pinned (the user's, widened to
    /// whole granules).
    fn range(&self) -> GpuRange {
        GpuRange {
            start: self.start,
            len: u64::from(self.granules) * GRANULE,
        }
    }

    /// The count of references on this object.
    pub(crate) fn refs(&self) -> &RefCount {
        &self.refs
    }

    /// The link of this object on the reap list.
    pub(crate) fn reap_link(&self) -> &ReapLink {
        &self.reap_link
    }

    /// The core's invalidate hook of this registration's client: only the
    /// invalidating client has one.
    fn link(&self) -> Option<&'static CoreLink> {
        match self.mode {
            Mode::Invalidating => Some(&crate::client::INVALIDATING_LINK),
            Mode::Persistent => None,
        }
    }

    /// `acquire`: claims `[addr, addr + size)` if the GPU driver owns it, by
    /// pinning it — the only ownership test the p2p API has, done once: the
    /// pin is kept for `get_pages`. Any error means "not mine".
    ///
    /// Expanded into each client's `acquire`, where `mode` is a constant:
    /// the other mode's path drops out, and so does a call.
    #[inline(always)]
    pub(crate) fn acquire(addr: u64, size: u64, mode: Mode) -> Result<RegRef> {
        let range = GpuRange::widen(addr, size, GRANULE).map_err(|e| {
            reg_dbg!("acquire {addr:#x}+{size:#x}: refused ({e:?})");
            fail!(
                Cause::BadRange,
                EINVAL,
                "refused range {addr:#x}+{size:#x}: {e:?}"
            )
        })?;
        // 2^32 granules are 256 TiB: more than any GPU has.
        let granules = u32::try_from(range.len / GRANULE).map_err(|_| {
            fail!(
                Cause::BadRange,
                EINVAL,
                "refused range {addr:#x}+{size:#x}: too long"
            )
        })?;
        // Registrations are made only while the module's wait queue exists
        // (their waits use it; see `wait`).
        crate::waitq::queue().ok_or(ENODEV)?;
        let live = Liveness::new()?;
        // The memory first: nothing pinned has to be undone if it fails.
        let spare = Spare::new()?;
        // One expansion per use: each initializer is then built in place
        // where it is used, with what is known there.
        macro_rules! object {
            ($lc:expr, $pin_error:expr) => {
                pin_init!(Self {
                    mode,
                    start: range.start,
                    granules,
                    inner <- RegState::new(Inner {
                        lc: $lc,
                        pin_error: $pin_error,
                        in_core: None,
                        mapper: false,
                        waiters: 0,
                        charge: None,
                    }, c"Registration::inner", kernel::static_lock_class!()),
                    sg_slot: SgSlot::new(),
                    holds_map: Atomic::new(0),
                    refs: RefCount::new(),
                    reap_link: ReapLink::new(),
                    _live: live,
                })
            };
        }
        let reg = match mode {
            Mode::Invalidating => {
                // Pinning starts before the object is shared (nobody else
                // can see it yet, so no lock is needed to move it there).
                let reg = spare.init(object!(Lifecycle::pinning(), None));
                // INVARIANT: made in invalidating mode just above.
                let called = Called::<Locked> {
                    reg: &reg,
                    _access: PhantomData,
                };
                if let Err(e) = called.pin(&reg) {
                    let e = Self::pin_refused(e, mode, &range)?;
                    called.enter().pin_error = Some(e);
                } else if let Some(phys) = called.first_phys() {
                    // No core lock is held here but `peer_memory_mutex`.
                    topology::learn_gate(range.start, phys);
                }
                reg
            }
            // A persistent pin has no free callback: nothing but this call
            // can touch it, so it is made before the object exists and
            // recorded without a lock.
            Mode::Persistent => match p2p::get_pages_persistent(&range) {
                Ok(table) => {
                    STATS.pinned_bytes.add(range.len, Relaxed);
                    let pin = Pin {
                        table,
                        token: None,
                        owner: compat::current_tgid(),
                    };
                    spare.init(object!(Lifecycle::with_pin(pin), None))
                }
                Err(e) => {
                    let e = Self::pin_refused(e, mode, &range)?;
                    spare.init(object!(Lifecycle::new(), Some(e)))
                }
            },
        };
        // The core holds it from now until `release`; counted by the caller
        // (`acquired`; live registrations are `acquired - releases`).
        Ok(reg)
    }

    /// The provider refused to pin `range` with `e`: `Err` when the range is
    /// not the GPU driver's to pin (not ours), else the error `get_pages`
    /// reports for memory that is the GPU driver's.
    fn pin_refused(e: Error, mode: Mode, range: &GpuRange) -> Result<Error> {
        reg_dbg!(
            "acquire {:#x}+{:#x}: declined ({e:?})",
            range.start,
            range.len
        );
        match e {
            // The GPU driver refuses persistent pins (MIG, vGPU): the memory
            // is its, so say why instead of the core's "Bad address".
            e if e == compat::eopnotsupp() && mode == Mode::Persistent => {
                kernel::pr_warn_once!("the GPU driver does not support persistent pins here (MIG or vGPU?): registrations fail with EOPNOTSUPP; load with persistent_api_support=0\n");
                Ok(e)
            }
            // Not GPU memory, or not this process's (or freed while
            // pinning): not ours.
            e if e == EINVAL || e == compat::eopnotsupp() || e == EFAULT => Err(e),
            // The GPU driver's memory, which it cannot pin now: ours, failing.
            e => Ok(e),
        }
    }

    /// The GPU driver revoked the pages (see [`Called::revoke`]); only an
    /// invalidating registration has a free callback.
    pub(crate) fn revoke(&self) {
        if let Some(c) = self.called::<Locked>() {
            c.revoke();
        }
    }

    /// Wakes the waiters of this registration, if any (the caller holds the
    /// lock and changed what they wait for). The queue is the module's: the
    /// waiters of other registrations wake too, find their condition
    /// unchanged and sleep again.
    fn wake(&self, g: &Inner) {
        if g.waiters > 0 {
            if let Some(q) = crate::waitq::queue() {
                q.notify_all();
            }
        }
    }

    /// Unpins a persistent pin, whose lifecycle already ended, and releases
    /// its count.
    // Called from `release` only: inlined there.
    #[inline(always)]
    fn unpin_persistent(&self, table: PageTable, charge: Option<Charge>) {
        // SAFETY: a persistent pin made by `acquire` for `self.range` (the
        // lifecycle ends with `ended` only for a pin without a callback's
        // token, which only `get_pages_persistent` gives), handed out once.
        let res = unsafe { table.put_persistent(&self.range()) };
        if let Some(c) = charge {
            c.release(self.range().len);
        }
        STATS.pinned_bytes.fetch_sub(self.range().len, Relaxed);
        if let Err(e) = res {
            STATS.leaked_pins.add(1, Relaxed);
            fail!(
                Cause::Unpin,
                e,
                "nvidia_p2p_put_pages_persistent failed for {:#x}+{:#x}: the pin is lost",
                self.range().start,
                self.range().len
            );
        }
    }
}

/// The most pages [`window_run`] reads inside the registration's lock (4 MiB):
/// the section with preemption off stays bounded whatever the MR's size; a
/// longer MR is mapped the general way, which reads its table outside the
/// lock.
pub(crate) const WINDOW_RUN_PAGES: u64 = 64;

/// The segment through which `peer` reaches `pages` when they are one run
/// inside the live window of `route`'s pair, as `bar_map` would place it,
/// for a route the path policy allows; `None` otherwise (the general way
/// then maps, learns, explains refusals and counts failures). Never sleeps.
#[inline(always)]
fn window_run(pages: &PageView<'_>, route: &Route, peer: &PeerDevice) -> Option<Segment> {
    if pages.coherent() || !route.allowed() || route.gate() != Gate::Open {
        return None;
    }
    let window = route.live_window(peer)?;
    // One entry, as `bar_map` would make it: a run no longer than the
    // device's segments may be, decided from the page count before any page
    // is read.
    let segment_pages = segment_limit(peer.max_segment(), GPU_PAGE_SIZE) / GPU_PAGE_SIZE;
    let max = core::cmp::min(segment_pages, WINDOW_RUN_PAGES) as usize;
    let (addr, len) = pages.one_run_of_at_most(GPU_PAGE_SIZE, max)?;
    window.segment(Segment { addr, len })
}

impl<A: Access> Called<'_, A> {
    /// `get_pages`: the pin happened in `acquire`; check what the provider
    /// gave us and remember the core's id for the invalidate hook.
    pub(crate) fn get_pages(&self, addr: u64, size: u64, core_context: u64) -> Result {
        if !self.range().covers(addr, size) {
            return Err(fail!(
                Cause::Order,
                EINVAL,
                "get_pages for another range than acquired"
            ));
        }
        let mut g = self.enter();
        if let Some(e) = g.pin_error {
            return Err(fail!(
                Cause::Pin,
                e,
                "the GPU driver could not pin {:#x}+{:#x}",
                self.range().start,
                self.range().len
            ));
        }
        let checked = match g.lc.pinned_table() {
            // SAFETY: Pinned, so the table is ours. A free callback must take
            // this lock to revoke, and the provider frees the table only after
            // the callback returns: it is valid while the lock is held.
            Ok(t) => unsafe { t.check(&self.range()) },
            Err(r) => return Err(refused(r, "get_pages")),
        };
        match checked {
            Ok(_) => g.lc.bind(core_context).map_err(|r| refused(r, "get_pages")),
            Err(m) => {
                // `release` unpins; nothing else may use this table.
                g.lc.reject();
                Err(fail!(
                    Cause::PageTable,
                    compat::eopnotsupp(),
                    "unsupported NVIDIA page table: {m:?}"
                ))
            }
        }
    }

    /// `dma_map`: maps the pinned pages for `dma_device` and publishes the
    /// scatterlist in `sg_head`; returns the number of entries.
    ///
    /// # Safety
    ///
    /// `sg_head` must be the core's table for this registration and
    /// `dma_device` a device the core keeps alive while mapped.
    pub(crate) unsafe fn dma_map(
        &self,
        sg_head: *mut bindings::sg_table,
        dma_device: *mut bindings::device,
    ) -> Result<u32> {
        // SAFETY: `dma_device` is NULL or a device the core keeps alive while
        // mapped (caller).
        let Some(peer) = (unsafe { PeerDevice::new(dma_device) }) else {
            return Err(fail!(
                Cause::NotPci,
                EINVAL,
                "dma_device is not a PCI device"
            ));
        };
        // A device whose DMA is translated has no window (`bar_window`).
        if A::MODE == Mode::Invalidating && !peer.translated() {
            // SAFETY: `sg_head` as promised by the caller.
            if let Some(nents) = unsafe { self.map_in_window(&peer, sg_head) } {
                return Ok(self.mapped(nents));
            }
        }
        let table = self.start_map()?;
        // SAFETY: valid until `finish_map` (see `start_map`); checked by
        // `get_pages`.
        let pages = unsafe { table.pages() };
        let (first, coherent) = (pages.physical_address(0).unwrap_or(0), pages.coherent());
        let route = Route::of(first, &peer);
        let persistent = A::MODE == Mode::Persistent;
        // Coherent memory (C2C) is on no PCIe path: neither the path policy
        // nor the driver's topology gate, which it skips there (fact 5),
        // applies. The invalidating client maps without the GPU driver: it
        // applies the driver's gate itself (the persistent one asks it).
        let checks = || match (coherent, persistent) {
            (true, _) => Ok(()),
            (false, true) => route.admit(),
            (false, false) => route.admit().and_then(|()| route.admit_gate()),
        };
        let made = checks().and_then(|()| {
            self.map_pages(table, peer, &route)
                .inspect_err(|e| route.failed(*e, persistent))
        });
        // SAFETY: `sg_head` is the core's table for this registration (caller).
        let nents = unsafe { self.finish_map(made, &route, sg_head) }?;
        Ok(self.mapped(nents))
    }

    /// Counts a registration mapped with `nents` entries; returns `nents`.
    #[inline(always)]
    fn mapped(&self, nents: u32) -> u32 {
        STATS.registrations.add(1, Relaxed);
        STATS.sg_entries.add(u64::from(nents), Relaxed);
        reg_dbg!(
            "mapped {:#x}+{:#x}: {nents} entries",
            self.range().start,
            self.range().len
        );
        nents
    }

    /// The whole of `dma_map` in one section of the lock, for the usual
    /// invalidating registration without a translating IOMMU: its pages are
    /// one run inside the live window of a known pair that the path policy
    /// allows (see [`window_run`]), so nothing is mapped, allocated or
    /// learnt, and nothing sleeps. The lock is held from the table's read to
    /// the mapping's publication: a free callback waits for it and then
    /// finds the registration Mapped, as after [`Called::finish_map`]. Every
    /// other case returns `None` with nothing changed, and goes the general
    /// way.
    ///
    /// # Safety
    ///
    /// `sg_head` must be the core's table for this registration.
    #[inline(always)]
    unsafe fn map_in_window(
        &self,
        peer: &PeerDevice,
        sg_head: *mut bindings::sg_table,
    ) -> Option<u32> {
        let mut g = self.enter();
        // SAFETY: Bound: the table is pinned and was checked by `get_pages`.
        // The provider frees it only after its free callback returns
        // (real-driver-behaviour.md, fact 2; scenario `free_races_registration`),
        // and the callback takes this lock first, which is held until the
        // alias and its view are gone.
        let table = unsafe { g.lc.bound_table()?.alias() };
        // SAFETY: as above; the view does not outlive this section.
        let pages = unsafe { table.pages() };
        let route = Route::known(pages.physical_address(0)?, peer)?;
        let seg = window_run(&pages, &route, peer)?;
        // The slot is free while Bound (no mapping holds it), and Mapping
        // starts right below, in this section.
        // SAFETY: the slot is this registration's; only the mapping made in
        // this Mapping uses it (see `sg_slot`).
        unsafe { self.sg_slot.fill(seg) }.ok()?;
        g.lc.start_map().ok()?;
        // INVARIANT: the slot holds the window map's entry (above). Cannot
        // fail: Mapping since the line above, under the same lock.
        g.lc.map_succeeded(DeviceMap::Window).ok()?;
        self.installed(&mut g, &route);
        STATS.window_maps.add(1, Relaxed);
        STATS.single_section_maps.add(1, Relaxed);
        // SAFETY: `sg_head` as promised by the caller; the slot holds the
        // entry of the map just installed.
        Some(unsafe { self.sg_slot.publish(sg_head) })
    }

    /// The lifecycle took a mapping (Mapped): flags it for `put_pages` and
    /// counts the registration on `route` until its pin ends (under this
    /// lock, so that a revoke cannot end the pin in between).
    #[inline(always)]
    fn installed(&self, g: &mut Entered<'_, Inner, A>, route: &Route) {
        self.holds_map.store(1, Relaxed);
        let owner = g.lc.owner().unwrap_or(0);
        g.charge = route.charge(owner, self.range().len);
    }

    /// Moves Bound to Mapping and returns the table to map, marking it in
    /// use until [`Called::finish_map`].
    ///
    /// The alias is sound while `mapper` is set: a free callback that comes
    /// meanwhile waits for it in `revoke` before it returns, and the provider
    /// frees the table only after its callback returns
    /// (real-driver-behaviour.md, fact 2; scenario `free_races_registration`,
    /// and the `ofed4` mode, whose core holds no lock across `dma_map`). The
    /// alias does not outlive `dma_map`, except inside a persistent mapping,
    /// whose table is unpinned only after the mapping is dropped.
    fn start_map(&self) -> Result<PageTable> {
        let mut g = self.enter();
        let t = g.lc.start_map().map_err(|r| refused(r, "dma_map"))?;
        // SAFETY: Bound became Mapping: the table is pinned, was checked by
        // `get_pages`, and outlives the alias (see above).
        let t = unsafe { t.alias() };
        g.mapper = true;
        Ok(t)
    }

    /// Ends a mapping attempt: lets a waiting free callback go, and
    /// publishes the scatterlist unless the pages were revoked meanwhile.
    ///
    /// # Safety
    ///
    /// `sg_head` must be the core's table for this registration.
    unsafe fn finish_map(
        &self,
        made: Result<DeviceMap>,
        route: &Route,
        sg_head: *mut bindings::sg_table,
    ) -> Result<u32> {
        let lost = {
            let mut g = self.enter();
            g.mapper = false;
            self.wake(&g);
            let map = match made {
                Ok(m) => m,
                Err(e) => {
                    g.lc.map_failed();
                    return Err(e);
                }
            };
            match g.lc.map_succeeded(map) {
                // Revoked meanwhile: our own mapping, undone below; the
                // device never saw it.
                Err(map) => map,
                Ok(()) => {
                    self.installed(&mut g, route);
                    return Ok(g.lc.map().map_or(0, |m| {
                        // SAFETY: `sg_head` is the core's table (caller); the
                        // map was built with this registration's slot.
                        unsafe { m.publish(&self.sg_slot, sg_head) }
                    }));
                }
            }
        };
        drop(lost);
        route.failed(EFAULT, false);
        Err(fail!(
            Cause::Revoked,
            EFAULT,
            "GPU memory freed while mapping"
        ))
    }

    /// Maps the pages of `table` for `peer`: ourselves for non-persistent
    /// pins (no lock of the GPU driver's is taken, see `bar_map`), through
    /// the GPU driver for persistent ones.
    fn map_pages(&self, table: PageTable, peer: PeerDevice, route: &Route) -> Result<DeviceMap> {
        let entries = self.range().pages(GPU_PAGE_SIZE) as u32;
        match A::MODE {
            Mode::Invalidating => {
                // SAFETY: checked by `get_pages` and valid during `dma_map`
                // (see there); the view does not outlive this block.
                let pages = unsafe { table.pages() };
                let window = route.window(&peer);
                // SAFETY: the slot is this registration's and is used by one
                // mapping at a time (see `sg_slot`): this one, made in Mapping.
                unsafe { bar_map::map(&pages, &peer, &self.sg_slot, window) }.map_err(|e| {
                    match pages.coherent() {
                        true => fail!(
                            Cause::DmaMap,
                            e,
                            "mapping coherent GPU memory for the device failed (a device without coherent DMA, or a kernel without DMA_ATTR_REQUIRE_COHERENT)"
                        ),
                        false => fail!(Cause::DmaMap, e, "mapping GPU BAR pages for the device failed"),
                    }
                })
            }
            Mode::Persistent => {
                // SAFETY: a persistent pin, unpinned only by `release` after
                // the mapping is dropped (the lifecycle hands out the map
                // first); the slot as above.
                unsafe { provider_map::map(table, entries, &peer, &self.sg_slot) }
            }
        }
    }

    /// `dma_unmap`: idempotent; undoes the client's mapping, also after a
    /// revoke (it is ours, never the GPU driver's).
    pub(crate) fn dma_unmap(&self) {
        let map = {
            let mut g = self.enter();
            self.holds_map.store(0, Relaxed);
            g.lc.unmap()
        };
        drop(map);
    }

    /// `put_pages`: as `dma_unmap`; the unpin waits for `release` (see
    /// [`Lifecycle::put_pages`]). The caller skips it when
    /// [`Registration::put_pages_needed`] says so.
    pub(crate) fn put_pages(&self) {
        let map = {
            let mut g = self.enter();
            self.holds_map.store(0, Relaxed);
            g.lc.put_pages()
        };
        drop(map);
    }

    /// `release`: undoes whatever the core left and unpins if this process
    /// may; the caller drops the core's reference after it. Returns only
    /// once no free callback of this registration is inside the core (the
    /// core may free what that callback uses once we return), unless the
    /// caller is that callback (OFED 4.x releases from inside its
    /// invalidate).
    pub(crate) fn release(&self) {
        // No free callback is ever inside the core for a persistent
        // registration, and any process may unpin it: its release needs
        // neither the thread's nor the process's id.
        let ids = (A::MODE == Mode::Invalidating).then(compat::current_ids);
        let (r, charge, owner) = {
            let mut g = self.enter();
            if let Some((me, _)) = ids {
                while g.in_core.is_some_and(|t| t != me) {
                    self.wait(&mut g);
                }
            }
            self.holds_map.store(0, Relaxed);
            let owner = g.lc.owner().unwrap_or(0);
            let r = g.lc.release(ids.map_or(0, |(_, tgid)| tgid));
            // A persistent pin's life ends here, and its count with it
            // (released once the unpin returned).
            let charge = if r.ended { g.charge.take() } else { None };
            (r, charge, owner)
        };
        drop(r.map);
        if r.orphaned {
            STATS.foreign_releases.add(1, Relaxed);
            STATS.orphaned_pins.add(1, Relaxed);
            self.held_pin("released in another process than the pinning one", owner);
        }
        match r.unpin {
            Some(table) if r.ended => self.unpin_persistent(table, charge),
            Some(table) => self.unpin(table),
            None => (),
        }
        STATS.releases.add(1, Relaxed);
    }

    /// Unpins a non-persistent pin at the provider and settles the
    /// callback's reference.
    fn unpin(&self, table: PageTable) {
        // SAFETY: pinned by `pin` for `self.range` with a callback (the
        // lifecycle hands a table out without `ended` only for a pin with a
        // callback's token, which only `get_pages` gives), handed out once,
        // and only to the pinning process.
        let res = unsafe { table.put(&self.range()) };
        let (how, token, charge) = {
            let mut g = self.enter();
            let (how, token) = g.lc.unpinned(res.is_ok());
            // A stranded pin stays counted until its callback.
            let charge = if how == Unpinned::Stranded {
                None
            } else {
                g.charge.take()
            };
            (how, token, charge)
        };
        if let Some(c) = charge {
            c.release(self.range().len);
        }
        let err = res.err().unwrap_or(EIO);
        match how {
            // Raced: the callback ended the pin first; it had no table to
            // count.
            Unpinned::Reclaim | Unpinned::Raced => {
                STATS.pinned_bytes.fetch_sub(self.range().len, Relaxed);
            }
            Unpinned::Stranded => {
                STATS.stranded_pins.add(1, Relaxed);
                self.held_pin("nvidia_p2p_put_pages failed", compat::current_tgid());
                fail!(
                    Cause::Unpin,
                    err,
                    "nvidia_p2p_put_pages failed for {:#x}+{:#x}: the pin stays until the GPU memory is freed",
                    self.range().start,
                    self.range().len
                );
            }
        }
        if let Some(cb) = token {
            // SAFETY: the lifecycle hands the token out only after a
            // successful unpin by the pinning process that its callback did
            // not race: the provider unlinked the pin under the lock it holds
            // across callbacks, so the callback never runs. Not the last
            // reference: our caller holds the core's.
            drop(unsafe { cb.reclaim(self.reg) });
        }
    }

    /// One line for each pin the core let go of that this module keeps (an
    /// orphaned or stranded pin): it holds the module, and nvidia.ko, loaded
    /// until the GPU driver's free callback ends it.
    #[cold]
    #[inline(never)]
    fn held_pin(&self, why: &str, owner: u32) {
        // A process can make many (fork, exit): the counters have them all.
        // SAFETY: no preconditions.
        if !unsafe { crate::ffi::peermem_ratelimit() } {
            return;
        }
        let (start, len) = (self.range().start, self.range().len);
        pr_warn!(
            "{why}: GPU memory {start:#x}+{len:#x} ({len} bytes) pinned by process {} stays pinned until that process frees it or exits; until then nvidia_peermem and nvidia cannot be unloaded (released by process {})\n",
            compat::Process(owner),
            compat::Process(compat::current_tgid())
        );
    }

    /// Waits on the module's queue (`core_left`), counted in `waiters` so
    /// that wakers know. Whoever changes what the caller waits for does so
    /// under this registration's lock and then wakes the queue.
    fn wait(&self, g: &mut Entered<'_, Inner, A>) {
        // Always there: a registration exists only while the queue does
        // (checked by `acquire`; the queue goes only after the last one).
        let Some(q) = crate::waitq::queue() else {
            return;
        };
        g.waiters += 1;
        g.wait(q);
        g.waiters -= 1;
    }
}

impl Called<'_, Locked> {
    /// Pins the range with a free callback; the lifecycle is in Pinning
    /// already (see `acquire`). The callback can run as soon as the provider
    /// armed it, so the outcome is recorded under the lock.
    ///
    /// `this` is the object `self` borrows (the callback takes a reference).
    fn pin(self, this: &RegRef) -> Result {
        let owner = compat::current_tgid();
        let pinned = p2p::get_pages(&self.range(), this).map(|(table, cb)| Pin {
            table,
            token: Some(cb),
            owner,
        });
        let pin = match pinned {
            Ok(p) => p,
            Err(e) => {
                self.enter().lc.pin_failed();
                return Err(e);
            }
        };
        let took = self.enter().lc.pin_succeeded(pin);
        match took {
            Ok(()) => {
                STATS.pinned_bytes.add(self.range().len, Relaxed);
                Ok(())
            }
            // The callback already ran and consumed the provider's reference;
            // the table is the provider's to free: drop our handles only.
            Err(_) => Err(fail!(
                Cause::Revoked,
                EFAULT,
                "GPU memory freed while pinning"
            )),
        }
    }

    /// The bus address of the pinned table's first page, if it is pinned and
    /// of a layout this module knows.
    fn first_phys(self) -> Option<u64> {
        let range = self.range();
        let g = self.enter();
        let t = g.lc.pinned_table().ok()?;
        // SAFETY: Pinned, so the table is ours; a free callback takes this
        // lock before it revokes, and the provider frees the table only after
        // the callback returns (fact 2): valid while the lock is held.
        unsafe { t.check(&range) }.ok()?;
        // SAFETY: as above, and checked just above; the view does not outlive
        // the lock's section.
        unsafe { t.pages() }.physical_address(0)
    }

    /// The GPU driver revoked the pages: tell the core, which stops the device
    /// before we return (the provider frees everything right after), then
    /// undo our own mapping.
    fn revoke(self) {
        STATS.invalidations.add(1, Relaxed);
        let (action, had_pin, charge) = {
            let mut g = self.enter();
            // The table comes back only to be forgotten: the provider frees
            // it once we return.
            let (action, table) = g.lc.invalidate();
            if let Invalidate::NotifyCore(_) = action {
                g.in_core = Some(current_task());
            }
            // A `dma_map` still reads the table: the provider frees it as
            // soon as we return, so wait (it takes no lock of the provider's
            // and sees the revoke when it finishes).
            while g.mapper {
                self.wait(&mut g);
            }
            let ended = table.is_some() || matches!(action, Invalidate::Reaped { .. });
            (action, ended, if ended { g.charge.take() } else { None })
        };
        if had_pin {
            STATS.pinned_bytes.fetch_sub(self.range().len, Relaxed);
        }
        if let Some(c) = charge {
            c.release(self.range().len);
        }
        reg_dbg!(
            "free callback for {:#x}+{:#x}: {action:?}",
            self.range().start,
            self.range().len
        );
        match action {
            Invalidate::NotifyCore(ctx) => {
                if let Some(link) = self.link() {
                    // The core's invalidate takes mutexes: the GPU driver must
                    // call us from sleepable context (lockdep checks it).
                    kernel::task::might_sleep();
                    STATS.core_invalidations.add(1, Relaxed);
                    link.invalidate(ctx);
                }
                // The device lost access: undo our DMA mappings unless the
                // core did from inside its invalidate (legacy cores). The
                // scatterlist stays until the core unmaps or releases.
                let access = self
                    .enter()
                    .lc
                    .revoked_map_mut()
                    .and_then(DeviceMap::take_device_access);
                if let Some(a) = access {
                    a.undo();
                }
                let mut g = self.enter();
                g.in_core = None;
                self.wake(&g);
            }
            Invalidate::Reaped { orphaned: true } => {
                STATS.orphaned_pins.fetch_sub(1, Relaxed);
            }
            Invalidate::Reaped { orphaned: false } => {
                STATS.stranded_pins.fetch_sub(1, Relaxed);
            }
            Invalidate::Quiet => (),
        }
    }
}
