// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `get_pages`, `dma_map`, `dma_unmap` and `put_pages`.

use kernel::{
    bindings,
    prelude::*,
    sync::atomic::Relaxed, //
};

use super::{
    refused,
    registry,
    Entered,
    Held,
    Mode,
    Registration,
    Span, //
};
use crate::{
    compat,
    device_map::DeviceMap,
    lifecycle::Lifecycle,
    p2p::{
        PageTable,
        PageView, //
    },
    peer_device::PeerDevice,
    range::GPU_PAGE_SIZE,
    stats::{
        fail,
        reg_dbg,
        At,
        Cause,
        STATS, //
    },
    topology::Route,
};

impl Registration {
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
        self.may_bind(&g)?;
        let t = g.lc.pinned_table().map_err(|r| refused(r, "get_pages"))?;
        // SAFETY: Pinned, so the table is ours. A free callback must take
        // this lock to revoke, and the provider frees the table only after
        // the callback returns: it is valid while the lock is held.
        if let Err(m) = unsafe { t.check(&self.range()) } {
            // `release` unpins; nothing else may use this table.
            g.lc.reject();
            return Err(fail!(
                Cause::PageTable,
                compat::eopnotsupp(),
                "unsupported NVIDIA page table: {m:?}"
            ));
        }
        g.lc.bind(core_context).map_err(|r| refused(r, "get_pages"))
    }

    /// Whether `get_pages` may bind: no drain, and the pin made. Under the
    /// lock (`g`): a drain that set its flag meanwhile finds this
    /// registration bound (and revokes it), or this finds the flag.
    fn may_bind(&self, g: &Entered<'_>) -> Result {
        if registry::draining() {
            return Err(fail!(
                Cause::Draining,
                EBUSY,
                "nvidia_peermem is draining: registration refused"
            ));
        }
        let Some(e) = g.pin_error else { return Ok(()) };
        Err(fail!(
            Cause::Pin,
            e,
            "the GPU driver could not pin {}",
            Span(self.range())
        ))
    }

    /// `dma_map`: maps the pinned pages for `peer` (`None`: the core's
    /// `dma_device` is no PCI device) and publishes the scatterlist in
    /// `head`, the core's table for this registration; returns the number
    /// of entries.
    pub(crate) fn dma_map(
        &self,
        head: &mut bindings::sg_table,
        peer: Option<PeerDevice>,
    ) -> Result<u32> {
        let peer =
            peer.ok_or_else(|| fail!(Cause::NotPci, EINVAL, "dma_device is not a PCI device"))?;
        let table = self.start_map()?;
        // SAFETY: valid until `finish_map` (see `start_map`); checked by
        // `get_pages`. The view does not outlive this call.
        let pages = unsafe { table.pages() };
        let route = Route::of(pages.physical_address(0).unwrap_or(0), &peer);
        let made = self.checks(&route, pages.coherent()).and_then(|()| {
            self.map_pages(&table, &pages, peer, route.at())
                .inspect_err(|e| route.failed(*e, self.mode == Mode::Persistent))
        });
        let nents = self.finish_map(made, &route, head)?;
        Ok(self.mapped(nents))
    }

    /// Whether `route` may be mapped: coherent memory (C2C) is on no PCIe
    /// path, so neither the path policy nor the driver's topology gate, which
    /// it skips there (fact 5), applies. The invalidating client maps without
    /// the GPU driver: it applies the driver's gate itself (the persistent
    /// one asks the driver).
    fn checks(&self, route: &Route, coherent: bool) -> Result {
        match (coherent, self.mode) {
            (true, _) => Ok(()),
            (false, Mode::Persistent) => route.admit(),
            (false, Mode::Invalidating) => route.admit().and_then(|()| route.admit_gate()),
        }
    }

    /// Counts a registration mapped with `nents` entries; returns `nents`.
    fn mapped(&self, nents: u32) -> u32 {
        STATS.registrations.add(1, Relaxed);
        STATS.sg_entries.add(u64::from(nents), Relaxed);
        reg_dbg!("mapped {}: {nents} entries", Span(self.range()));
        nents
    }

    /// The lifecycle took a mapping (Mapped): flags it for `put_pages` and
    /// counts the registration on `route` until its pin ends (under this
    /// lock, so that a revoke cannot end the pin in between). A pin is
    /// counted once: a map after an unmap of the same pin keeps its charge.
    fn installed(&self, g: &mut Entered<'_>, route: &Route) {
        self.holds_map.store(1, Relaxed);
        if g.charge.is_none() {
            g.charge = route.charge(self.range().len);
        }
    }
}

/// One mapping attempt: its start and its end.
impl Registration {
    /// Moves Bound to Mapping and returns the table to map, marking it in
    /// use until [`Registration::finish_map`].
    ///
    /// The alias is sound while `mapper` is set: a free callback that comes
    /// meanwhile waits for it in `revoke` before it returns, and the provider
    /// frees the table only after its callback returns
    /// (docs/driver-facts.md, fact 2; scenario `free_races_registration`,
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
    /// publishes the scatterlist in `head` unless the pages were revoked
    /// meanwhile.
    fn finish_map(
        &self,
        made: Result<DeviceMap>,
        route: &Route,
        head: &mut bindings::sg_table,
    ) -> Result<u32> {
        let mut g = self.enter();
        g.mapper = false;
        self.wake(&g);
        let map = made.inspect_err(|_| g.lc.map_failed())?;
        let Err(lost) = g.lc.map_succeeded(map) else {
            self.installed(&mut g, route);
            // The map was built with this registration's slot.
            *head = g.lc.map().ok_or(EINVAL)?.header(&self.sg_slot);
            return Ok(head.nents);
        };
        // Revoked meanwhile: our own mapping, undone here; the device never
        // saw it.
        drop(g);
        drop(lost);
        route.failed(EFAULT, false);
        Err(fail!(
            at route.at();
            Cause::Revoked,
            EFAULT,
            "GPU memory freed while mapping"
        ))
    }

    /// Maps the pages of `table` (`pages`, its view) for `peer`: ourselves
    /// for non-persistent pins (no lock of the GPU driver's is taken, see
    /// `device_map`), through the GPU driver for persistent ones.
    fn map_pages(
        &self,
        table: &PageTable,
        pages: &PageView<'_>,
        peer: PeerDevice,
        at: At,
    ) -> Result<DeviceMap> {
        match self.mode {
            Mode::Invalidating => {
                // SAFETY: pinned until the mapping is dropped (see
                // `DeviceMap::bar`: `release` unpins after it, a free
                // callback takes the device's access before it returns); the
                // core keeps `peer` alive; the slot is this registration's
                // and is used by one mapping at a time (see `sg_slot`).
                let map = unsafe { DeviceMap::bar(pages, &peer, &self.sg_slot) };
                map.map_err(|e| bar_map_failed(at, e, pages.coherent()))
            }
            Mode::Persistent => {
                let entries = self.range().pages(GPU_PAGE_SIZE) as u32;
                // SAFETY: an alias of a persistent pin, unpinned only by
                // `release` after the mapping is dropped (the lifecycle hands
                // out the map first), so it outlives the mapping; the slot as
                // above.
                unsafe { DeviceMap::persistent(table.alias(), entries, &peer, &self.sg_slot, at) }
            }
        }
    }
}

/// Undoing the mapping.
impl Registration {
    /// `dma_unmap`: idempotent; undoes the client's mapping, also after a
    /// revoke (it is ours, never the GPU driver's).
    pub(crate) fn dma_unmap(&self) {
        self.drop_map(Lifecycle::unmap);
    }

    /// `put_pages`: as `dma_unmap`; the unpin waits for `release` (see
    /// `Lifecycle::put_pages`). The caller skips it when
    /// [`Registration::put_pages_needed`] says so.
    pub(crate) fn put_pages(&self) {
        self.drop_map(Lifecycle::put_pages);
    }

    /// Takes the mapping out of the lifecycle with `take` and undoes it,
    /// outside the lock.
    fn drop_map(&self, take: fn(&mut Lifecycle<Held>) -> Option<DeviceMap>) {
        let map = {
            let mut g = self.enter();
            self.holds_map.store(0, Relaxed);
            take(&mut g.lc)
        };
        drop(map);
    }
}

/// The error of a failed BAR mapping, counted and explained.
fn bar_map_failed(at: At, e: Error, coherent: bool) -> Error {
    let what = match coherent {
        true => "mapping coherent GPU memory for the device failed (a device without coherent DMA, or a kernel without DMA_ATTR_REQUIRE_COHERENT)",
        false => "mapping GPU BAR pages for the device failed",
    };
    fail!(at at; Cause::DmaMap, e, "{what}")
}
