// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The device the core maps a registration for (`dma_device` in `dma_map`).
//!
//! NVIDIA's DMA API takes a `pci_dev`; the core hands a plain `device`. A
//! device that is not on PCI is refused here, once, instead of being passed on
//! as a garbage `pci_dev` (what the C anchors do).

use core::ptr::NonNull;

use kernel::bindings::{
    device,
    pci_dev, //
};

use crate::ffi;

/// A PCI device the core maps a registration for.
///
/// # Invariants
///
/// `pdev` is the `pci_dev` of `dev`, and both stay alive while the core keeps
/// the registration mapped for it. A clone is the same device, alive under
/// the same condition.
#[derive(Clone)]
pub(crate) struct PeerDevice {
    dev: NonNull<device>,
    pdev: NonNull<pci_dev>,
    /// Its PCI address (domain << 16 | bus << 8 | devfn).
    id: u32,
    /// Its DMA segment limit.
    max_seg: u32,
}

// SAFETY: the pointers are only handed back to the provider and the DMA API,
// which may be called from any thread; the core keeps the device alive.
unsafe impl Send for PeerDevice {}

impl PeerDevice {
    /// The PCI device behind `dev`; `None` when `dev` is NULL or not PCI.
    ///
    /// # Safety
    ///
    /// `dev` must be NULL or a device the core keeps alive while the
    /// registration is mapped for it.
    pub(crate) unsafe fn new(dev: *mut device) -> Option<Self> {
        let dev = NonNull::new(dev)?;
        let (mut id, mut max_seg) = (0, 0);
        // SAFETY: `dev` is a live device (caller); the helper checks the bus
        // before converting; valid out-pointers.
        let pdev = unsafe { ffi::peermem_peer_of(dev.as_ptr(), &mut id, &mut max_seg) };
        let pdev = NonNull::new(pdev)?;
        // INVARIANT: `pdev` is `dev`'s pci_dev, alive as long as `dev` is.
        Some(Self {
            dev,
            pdev,
            id,
            max_seg,
        })
    }

    /// The device's largest DMA segment: scatterlist entries must not exceed it.
    pub(crate) fn max_segment(&self) -> u64 {
        u64::from(self.max_seg)
    }

    /// Its PCI address (domain << 16 | bus << 8 | devfn).
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// The generic device, for the kernel's DMA API.
    pub(crate) fn dev(&self) -> *mut device {
        self.dev.as_ptr()
    }

    /// The `pci_dev` for NVIDIA's DMA API.
    pub(crate) fn pci(&self) -> *mut pci_dev {
        self.pdev.as_ptr()
    }
}
