// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The device mapping behind the scatterlist the core holds, as small as the
//! common case allows: every registration carries one in its lifecycle.
//!
//! A contiguous registration (one segment) keeps its mapping inline and its
//! one scatterlist entry in the registration's slot. With several segments,
//! the GPU driver's mapping stays inline too and the slot holds the header
//! of the allocated scatterlist; the client's own mappings of several BAR
//! runs keep theirs and the scatterlist in an allocation of their own.

use kernel::{
    bindings,
    prelude::*, //
};

use crate::{
    bar_map::{
        BarMap,
        RunIova, //
    },
    provider_map::ProviderRun,
    sg::{
        SgSlot,
        SlotTable, //
    },
};

/// A registration's device mapping (the lifecycle's `Map`).
///
/// # Invariants
///
/// A `BarRun`, `Window` or `ProviderRun` map owns the registration's slot, which holds
/// its one entry from the map's construction until it is dropped; a
/// `Provider` map's [`SlotTable`] is in the registration's slot.
pub(crate) enum DeviceMap {
    /// The client's own mapping of one BAR run (non-persistent pins); `None`
    /// once the device lost access (the entry stays for the core).
    BarRun(Option<RunIova>),
    /// One BAR run inside its pair's window (`bar_window`): no mapping of
    /// its own to undo.
    Window,
    /// The client's own mappings of several BAR runs (some maybe inside the
    /// window).
    Bar(KBox<BarMap>),
    /// The GPU driver's mapping (persistent pins), one segment.
    ProviderRun(ProviderRun),
    /// The GPU driver's mapping, several segments (drop order: the mapping
    /// is undone first, then the scatterlist freed).
    Provider { _run: ProviderRun, sg: SlotTable },
}

// One registration carries one inline: keep it small.
const _: () = assert!(core::mem::size_of::<DeviceMap>() <= 32);

/// The device's access to revoked pages, undone by [`DeviceAccess::undo`].
pub(crate) enum DeviceAccess {
    /// One run.
    Run(RunIova),
    /// Several runs.
    Runs(KVec<RunIova>),
}

impl DeviceAccess {
    /// Undoes the mappings (outside any spinlock).
    pub(crate) fn undo(self) {
        match self {
            DeviceAccess::Run(r) => drop(r),
            DeviceAccess::Runs(v) => drop(v),
        }
    }
}

impl DeviceMap {
    /// Hands the scatterlist's header to the core; returns its number of
    /// entries.
    ///
    /// # Safety
    ///
    /// `head` must point to the core's table for this registration, and
    /// `slot` be the slot this map was built with.
    pub(crate) unsafe fn publish(&self, slot: &SgSlot, head: *mut bindings::sg_table) -> u32 {
        match self {
            // SAFETY: the slot holds this map's entry (type invariant); `head`
            // as promised by the caller.
            DeviceMap::BarRun(_) | DeviceMap::Window => unsafe { slot.publish(head) },
            // SAFETY: as above.
            DeviceMap::ProviderRun(run) => unsafe { run.publish(slot, head) },
            DeviceMap::Bar(m) => {
                // SAFETY: as promised by the caller.
                unsafe { m.sg().publish(head) };
                m.sg().nents()
            }
            // SAFETY: as promised by the caller.
            DeviceMap::Provider { sg, .. } => unsafe { sg.publish(head) },
        }
    }

    /// After a revoke: the device's mappings, to undo now; the scatterlist
    /// stays for the core (see [`BarMap::take_device_access`]). A persistent
    /// pin has no free callback, so no revoke reaches its mapping.
    pub(crate) fn take_device_access(&mut self) -> Option<DeviceAccess> {
        match self {
            DeviceMap::BarRun(r) => r.take().map(DeviceAccess::Run),
            DeviceMap::Bar(m) => m.take_device_access().map(DeviceAccess::Runs),
            // The window stays: it gives an untranslated device nothing it
            // could not reach without it (see `bar_window`).
            DeviceMap::Window | DeviceMap::ProviderRun(_) | DeviceMap::Provider { .. } => None,
        }
    }
}
