// SPDX-License-Identifier: GPL-2.0 OR MIT

//! One registration: pin → map → (revoke) → unmap → unpin → release.
//!
//! A registration is shared by the core (through `client_context`) and, in
//! invalidating mode, by the GPU driver's free callback, each holding its own
//! reference; it is freed when the last one goes, so `release` cannot free it
//! under a running callback. Its [`Lifecycle`] decides, under a spinlock that
//! is never held across a provider or core call, what each path may touch.

use kernel::{
    bindings,
    new_spinlock,
    prelude::*,
    sync::{
        atomic::Relaxed,
        Arc,
        SpinLock, //
    }, //
};

use crate::{
    core_link::CoreLink,
    lifecycle::{
        Invalidate,
        Lifecycle,
        Outcome,
        Phase,
        Refusal,
        Teardown, //
    },
    liveness::Liveness,
    p2p::{
        self,
        ArmedCallback,
        DmaMapping,
        PageTable,
        Revocable, //
    },
    peer_device::PeerDevice,
    range::{
        self,
        GpuRange,
        GPU_PAGE_SIZE, //
    },
    sg::SgTable,
    stats::{
        fail,
        reg_dbg,
        Cause,
        STATS, //
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

struct Inner {
    lc: Lifecycle,
    table: Option<PageTable>,
    mapping: Option<DmaMapping>,
    peer: Option<PeerDevice>,
    /// The provider's reference on us while its free callback is armed.
    callback: Option<ArmedCallback<Registration>>,
    sg: Option<SgTable>,
    core_context: Option<u64>,
    /// The provider refused to pin a range that is its memory (BAR1
    /// exhausted, ...): reported by `get_pages` as the errno it is, instead of
    /// the core's "Bad address" for memory nobody claimed.
    pin_error: Option<Error>,
}

/// One registration of a GPU range with the peer-memory core.
///
/// # Invariants
///
/// `inner.table` is `Some` exactly while the lifecycle says the client holds
/// a pin (Pinned, Mapping, Mapped); `inner.sg` is `Some` exactly while the
/// lifecycle says the client owns a scatterlist.
#[pin_data]
pub(crate) struct Registration {
    mode: Mode,
    range: GpuRange,
    link: Option<&'static CoreLink>,
    #[pin]
    inner: SpinLock<Inner>,
    _live: Liveness,
}

/// Bytes that `range` pins.
fn pinned(range: &GpuRange) -> u64 {
    range.len
}

impl Registration {
    /// `acquire`: claims `[addr, addr + size)` if the GPU driver owns it, by
    /// pinning it — the only ownership test the p2p API has, done once: the
    /// pin is kept for `get_pages`. Any error means "not mine".
    pub(crate) fn acquire(
        addr: u64,
        size: u64,
        mode: Mode,
        link: Option<&'static CoreLink>,
    ) -> Result<Arc<Self>> {
        let range = GpuRange::widen(addr, size, range::granule(bindings::PAGE_SIZE as u64))
            .map_err(|e| {
                reg_dbg!("acquire {addr:#x}+{size:#x}: refused ({e:?})");
                fail!(
                    Cause::BadRange,
                    EINVAL,
                    "refused range {addr:#x}+{size:#x}: {e:?}"
                )
            })?;
        let invalidating = mode == Mode::Invalidating;
        let reg = Arc::pin_init(
            pin_init!(Self {
                mode,
                range,
                link,
                inner <- new_spinlock!(Inner {
                    lc: Lifecycle::new(invalidating),
                    table: None,
                    mapping: None,
                    peer: None,
                    callback: None,
                    sg: None,
                    core_context: None,
                    pin_error: None,
                }),
                _live: Liveness::new(),
            }),
            GFP_KERNEL,
        )?;
        match reg.pin() {
            Ok(()) => Ok(reg),
            // Not GPU memory, or not this process's: not ours.
            Err(e) if e == EINVAL || e == EOPNOTSUPP || e == EFAULT => Err(e),
            // The GPU driver's memory, which it cannot pin now: ours, failing.
            Err(e) => {
                reg.inner.lock().pin_error = Some(e);
                Ok(reg)
            }
        }
    }

    fn pin(self: &Arc<Self>) -> Result {
        self.inner.lock().lc.start_pin().map_err(|_| EINVAL)?;
        let pinned_table = match self.mode {
            Mode::Persistent => p2p::get_pages_persistent(&self.range).map(|t| (t, None)),
            Mode::Invalidating => p2p::get_pages(&self.range, self).map(|(t, cb)| (t, Some(cb))),
        };
        let (table, callback) = match pinned_table {
            Ok(t) => t,
            Err(e) => {
                self.inner.lock().lc.pin_failed();
                reg_dbg!(
                    "acquire {:#x}+{:#x}: declined ({e:?})",
                    self.range.start,
                    self.range.len
                );
                return Err(e);
            }
        };
        let mut g = self.inner.lock();
        match g.lc.pin_succeeded() {
            Outcome::Done => {
                // INVARIANT: pinned, so the table goes in.
                g.table = Some(table);
                g.callback = callback;
                drop(g);
                STATS.pinned_bytes.add(pinned(&self.range), Relaxed);
                Ok(())
            }
            // The callback already ran and consumed the provider's reference:
            // `callback` is dropped without reclaiming it.
            Outcome::Revoked => Err(fail!(
                Cause::Revoked,
                EFAULT,
                "GPU memory freed while pinning"
            )),
        }
    }

    /// `get_pages`: the pin happened in `acquire`; check what the provider
    /// gave us and remember the core's id for the invalidate hook.
    pub(crate) fn get_pages(&self, addr: u64, size: u64, core_context: u64) -> Result {
        if !self.range.covers(addr, size) {
            return Err(fail!(
                Cause::Order,
                EINVAL,
                "get_pages for another range than acquired"
            ));
        }
        let mut g = self.inner.lock();
        let checked = match (g.lc.phase(), g.table.as_ref()) {
            // SAFETY: pinned and not revoked: a free callback that comes now
            // sees `core_context` and waits on the core's mapping lock, which
            // the core holds during `get_pages`, so the table stays valid.
            (Phase::Pinned, Some(t)) => unsafe { t.check(&self.range) }.map_err(Some),
            (Phase::Revoked, _) => Err(None),
            (Phase::Acquired, _) if g.pin_error.is_some() => {
                let e = g.pin_error.unwrap_or(EIO);
                drop(g);
                return Err(fail!(
                    Cause::Pin,
                    e,
                    "the GPU driver could not pin {:#x}+{:#x}",
                    self.range.start,
                    self.range.len
                ));
            }
            (p, _) => {
                drop(g);
                return Err(fail!(Cause::Order, EINVAL, "get_pages in phase {p:?}"));
            }
        };
        match checked {
            Ok(_) => {
                g.core_context = Some(core_context);
                Ok(())
            }
            Err(None) => {
                drop(g);
                Err(fail!(
                    Cause::Revoked,
                    EFAULT,
                    "GPU memory freed before get_pages"
                ))
            }
            Err(Some(m)) => {
                drop(g);
                // `release` unpins.
                Err(fail!(
                    Cause::PageTable,
                    EOPNOTSUPP,
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
        let table_ptr = {
            let mut g = self.inner.lock();
            if let Err(r) = g.lc.start_map() {
                drop(g);
                return Err(match r {
                    Refusal::Revoked => {
                        fail!(Cause::Revoked, EFAULT, "GPU memory freed before dma_map")
                    }
                    Refusal::Forbidden(p) => fail!(Cause::Order, EINVAL, "dma_map in phase {p:?}"),
                });
            }
            // SAFETY: the lifecycle says Mapping, so the pin is ours (type
            // invariant); a free callback cannot complete (so the provider
            // cannot free the table) while the core holds this registration's
            // mapping lock, which it does during `dma_map`.
            g.table.as_ref().map(|t| unsafe { t.alias() })
        };
        let Some(table) = table_ptr else {
            self.inner.lock().lc.map_failed();
            return Err(EINVAL);
        };
        // SAFETY: as above; `peer` is live (type invariant).
        let mapping = match unsafe { table.dma_map(peer.pci()) } {
            Ok(m) => m,
            Err(e) => {
                self.inner.lock().lc.map_failed();
                return Err(fail!(Cause::DmaMap, e, "nvidia_p2p_dma_map_pages failed"));
            }
        };
        let entries = self.range.pages(GPU_PAGE_SIZE) as u32;
        // SAFETY: the mapping is valid for the same reason as the table.
        let built = match unsafe { mapping.addresses(entries) } {
            Err(m) => Err(fail!(
                Cause::DmaMapping,
                EOPNOTSUPP,
                "unsupported NVIDIA DMA mapping: {m:?}"
            )),
            Ok(addrs) => SgTable::build(addrs, GPU_PAGE_SIZE, peer.max_segment())
                .map_err(|e| fail!(Cause::NoMemory, e, "cannot allocate the scatterlist")),
        };
        let sg = match built {
            Ok(sg) => sg,
            Err(e) => {
                // SAFETY: valid as above; undo our own mapping.
                let _ = unsafe { table.dma_unmap(peer.pci(), mapping) };
                self.inner.lock().lc.map_failed();
                return Err(e);
            }
        };
        let nents = sg.nents();
        let mut g = self.inner.lock();
        match g.lc.map_succeeded() {
            Outcome::Done => {
                // SAFETY: `sg_head` is the core's table (caller).
                unsafe { sg.publish(sg_head) };
                g.sg = Some(sg);
                g.mapping = Some(mapping);
                g.peer = Some(peer);
                drop(g);
                STATS.registrations.add(1, Relaxed);
                STATS.sg_entries.add(u64::from(nents), Relaxed);
                reg_dbg!(
                    "mapped {:#x}+{:#x}: {nents} entries",
                    self.range.start,
                    self.range.len
                );
                Ok(nents)
            }
            Outcome::Revoked => {
                drop(g);
                sg.free();
                Err(fail!(
                    Cause::Revoked,
                    EFAULT,
                    "GPU memory freed while mapping"
                ))
            }
        }
    }

    /// `dma_unmap`: idempotent; after a revoke it frees only our own memory.
    pub(crate) fn dma_unmap(&self) {
        let t = self.inner.lock().lc.unmap();
        self.teardown(t);
    }

    /// `put_pages`: idempotent; the unpin waits for `release` (see
    /// [`Lifecycle::put_pages`]); after a revoke it touches nothing of the
    /// GPU driver's.
    pub(crate) fn put_pages(&self) {
        let t = self.inner.lock().lc.put_pages();
        self.teardown(t);
    }

    /// `release`: undoes whatever the core left, then the core's reference
    /// goes with `self`.
    pub(crate) fn release(self: Arc<Self>) {
        let t = self.inner.lock().lc.release();
        self.teardown(t);
        self.inner.lock().lc.released();
        STATS.releases.add(1, Relaxed);
    }

    /// Carries out what the lifecycle decided, outside the lock.
    fn teardown(&self, t: Teardown) {
        let (sg, mapping, peer, table, pinned_table) = {
            let mut g = self.inner.lock();
            let sg = if t.free_sg { g.sg.take() } else { None };
            let undo_map = t.unmap_provider || t.unpin_provider;
            let mapping = if undo_map { g.mapping.take() } else { None };
            let peer = if undo_map { g.peer.take() } else { None };
            let table = if t.unpin_provider {
                g.table.take()
            } else {
                None
            };
            // SAFETY: still pinned (we only unmap); see `unmap_provider`.
            let pinned_table = g.table.as_ref().map(|t| unsafe { t.alias() });
            (sg, mapping, peer, table, pinned_table)
        };
        if let Some(sg) = sg {
            sg.free();
        }
        if t.unmap_provider {
            if let (Some(m), Some(p), Some(tb)) =
                (mapping, peer, table.as_ref().or(pinned_table.as_ref()))
            {
                // SAFETY: `unmap_provider` is only decided for persistent
                // pages (no free callback): the table and mapping are valid
                // until we unpin, which comes after this.
                if let Err(e) = unsafe { tb.dma_unmap(p.pci(), m) } {
                    fail!(Cause::Unpin, e, "nvidia_p2p_dma_unmap_pages failed");
                }
            }
        }
        let Some(table) = table else { return };
        // SAFETY: pinned by `pin` for `self.range` in this mode, unpinned once
        // (the lifecycle moved to Unpinned under the lock).
        let r = unsafe {
            match self.mode {
                Mode::Persistent => table.put_persistent(&self.range),
                Mode::Invalidating => table.put(&self.range),
            }
        };
        if let Err(e) = r {
            fail!(Cause::Unpin, e, "unpinning GPU memory failed");
        }
        STATS.pinned_bytes.fetch_sub(pinned(&self.range), Relaxed);
        let armed = {
            let mut g = self.inner.lock();
            let disarmed = g.lc.unpinned();
            g.callback.take().filter(|_| disarmed)
        };
        if let Some(cb) = armed {
            // SAFETY: the provider's unpin returned and its callback never
            // fired (the lifecycle says disarmed): the reference given to it
            // in `pin` is ours to drop. It is not the last one: our caller
            // holds another (the core's).
            drop(unsafe { cb.reclaim() });
        }
    }
}

impl Revocable for Registration {
    /// The GPU driver revoked the pages: tell the core, which stops the device
    /// before we return (the provider frees everything right after).
    fn revoke(&self) {
        STATS.invalidations.add(1, Relaxed);
        let (action, ctx) = {
            let mut g = self.inner.lock();
            let a = g.lc.invalidate();
            // INVARIANT: no longer pinned by us: the provider frees these
            // as soon as this callback returns.
            let was_pinned = g.table.take().is_some();
            // The callback running now consumes the provider's reference.
            g.callback = None;
            g.mapping = None;
            g.peer = None;
            if was_pinned {
                STATS.pinned_bytes.fetch_sub(pinned(&self.range), Relaxed);
            }
            (a, g.core_context)
        };
        reg_dbg!(
            "free callback for {:#x}+{:#x}: {action:?}",
            self.range.start,
            self.range.len
        );
        if action == Invalidate::NotifyCore {
            if let (Some(ctx), Some(link)) = (ctx, self.link) {
                // The core's invalidate takes mutexes: the GPU driver must
                // call us from sleepable context (lockdep checks it).
                kernel::task::might_sleep();
                STATS.core_invalidations.add(1, Relaxed);
                link.invalidate(ctx);
            }
        }
    }
}
