// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The device mapping behind the scatterlist the core holds: the client's own
//! (`bar_map`, non-persistent pins) or the GPU driver's (`provider_map`,
//! persistent pins). Every registration carries one in its lifecycle, so it
//! is as small as the common case allows: one segment keeps its mapping
//! inline and its one scatterlist entry in the registration's slot.

use kernel::bindings;

use crate::{
    bar_map::{
        BarMapping,
        DeviceAccess, //
    },
    provider_map::ProviderMapping,
    sg::SgSlot,
};

/// A registration's device mapping (the lifecycle's `Map`).
pub(crate) enum DeviceMap {
    /// The client's own mapping of BAR (or coherent) pages.
    Bar(BarMapping),
    /// The GPU driver's mapping of a persistent pin.
    Provider(ProviderMapping),
}

// One registration carries one inline: keep it small.
const _: () = assert!(core::mem::size_of::<DeviceMap>() <= 32);

impl DeviceMap {
    /// The scatterlist's header, to hand to the core; `slot` is the slot
    /// this map was built with.
    pub(crate) fn header(&self, slot: &SgSlot) -> bindings::sg_table {
        match self {
            DeviceMap::Bar(m) => m.header(slot),
            DeviceMap::Provider(m) => m.header(slot),
        }
    }

    /// After a revoke: the device's mappings, to undo now; the scatterlist
    /// stays for the core. A persistent pin has no free callback, so no
    /// revoke reaches its mapping.
    pub(crate) fn take_device_access(&mut self) -> Option<DeviceAccess> {
        match self {
            DeviceMap::Bar(m) => m.take_device_access(),
            DeviceMap::Provider(_) => None,
        }
    }
}
