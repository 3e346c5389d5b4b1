// SPDX-License-Identifier: GPL-2.0 OR MIT

//! One DMA mapping of a GPU's whole BAR per (GPU, peer) pair, for peers whose
//! DMA no IOMMU translates.
//!
//! Why: without translation (no IOMMU, or an identity domain, the usual setup
//! of GPUDirect RDMA clusters) a mapping of BAR pages gives the device nothing
//! it could not reach already, yet `bar_map`'s `dma_map_resource` +
//! `dma_unmap_resource` per registration are most of the invalidating mode's
//! own cost. A window maps the BAR once, when the pair is first used; a run
//! inside it is at the window's address plus the run's offset (one
//! `dma_map_resource` maps its whole range linearly). A translated peer keeps
//! a mapping per registration, undone at revoke: there the IOMMU is what
//! stops a device that still uses a revoked registration, and a window would
//! give that up.
//!
//! Lifetime: a window holds a reference on its device and stays until the
//! device loses its driver or the module unloads. A rebind may bring another
//! DMA mask or IOMMU domain (an IOMMU group's `type` can only change while no
//! driver is bound), so the next registration decides anew. The unbind
//! notification comes after the driver's `remove`, which deregisters every
//! MR of the device (an RDMA driver unregisters its `ib_device`, and the core
//! releases its MRs, before `remove` returns), and before DMA-API debug checks
//! the device for leaked mappings. Scenario `bar_window` unbinds and rebinds
//! the HCA, with and without a live registration, and switches its IOMMU
//! group between translated and identity.
//!
//! Making and retiring a window are rare (once per pair and per unbind) and
//! serialised by one mutex, so a registration that finds a window being
//! made waits for it instead of mapping its runs alone: two concurrent first
//! registrations of a pair both get the window (scenario `gpu_rebind`).
//! Readers take no lock: they check the slot's word around their reads.

use core::{
    ptr,
    sync::atomic::fence, //
};

use kernel::{
    bindings,
    prelude::*,
    sync::global_lock, //
};

use crate::{
    accounting::PAIRS,
    atomics::{
        Acquire,
        Atomic,
        Relaxed,
        Release, //
    },
    coalesce::Segment,
    ffi,
};

global_lock! {
    // SAFETY: initialised by `Windows::new`, before any client is
    // registered, so before any window is made or retired.
    unsafe(uninit) static MAKING: Mutex<()> = ();
}

/// No decision yet for the pair (or its device lost its driver).
const EMPTY: u32 = 0;
/// Being made or retired by the holder of `MAKING`.
const BUSY: u32 = 1;
/// Mapped for `dev`.
const LIVE: u32 = 2;
/// `dev`'s DMA is translated (or the window could not be mapped): its
/// registrations map their own runs until the device loses its driver.
const OWN: u32 = 3;
const STATE: u32 = 3;
/// One generation: every change of a slot's word adds it.
const GEN: u32 = 4;

/// The next word after `w`, in `state`.
fn next(w: u32, state: u32) -> u32 {
    ((w & !STATE).wrapping_add(GEN)) | state
}

/// One pair's window.
///
/// The fields are written only under `MAKING`, by the thread that moved the
/// word to `BUSY`, and are valid for the word it stores next; readers check
/// that the word did not change while they read them (a sequence lock).
struct Slot {
    word: Atomic<u32>,
    dev: Atomic<*mut bindings::device>,
    /// The BAR's first and last byte, and the device address of the first.
    start: Atomic<u64>,
    end: Atomic<u64>,
    base: Atomic<u64>,
}

impl Slot {
    const fn new() -> Self {
        Self {
            word: Atomic::new(EMPTY),
            dev: Atomic::new(ptr::null_mut()),
            start: Atomic::new(0),
            end: Atomic::new(0),
            base: Atomic::new(0),
        }
    }
}

/// The windows, indexed like the accounting's pairs.
static SLOTS: [Slot; PAIRS] = [const { Slot::new() }; PAIRS];

/// A live window: the BAR bytes `[start, end]` mapped at `base`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) base: u64,
}

impl Window {
    /// The device range of the BAR bytes `run`, if the window holds them all.
    pub(crate) fn segment(&self, run: Segment) -> Option<Segment> {
        let last = run.addr.checked_add(run.len.checked_sub(1)?)?;
        if run.addr < self.start || last > self.end {
            return None;
        }
        Some(Segment {
            addr: self.base.checked_add(run.addr - self.start)?,
            len: run.len,
        })
    }
}

/// The window of pair `pair` for `dev` over the BAR `[start, end]`, made on
/// the pair's first use (waiting for a thread that is making it); `None`
/// when `dev`'s DMA is translated or the window could not be mapped (the
/// caller maps its runs itself then). May sleep.
///
/// # Safety
///
/// `dev` must be a device the core keeps alive and bound during the call
/// (it is inside `dma_map` for it).
pub(crate) unsafe fn get(
    pair: usize,
    dev: *mut bindings::device,
    bar: (u64, u64),
) -> Option<Window> {
    let s = SLOTS.get(pair)?;
    let w = s.word.load(Acquire);
    match w & STATE {
        LIVE => read(s, w, dev),
        // SAFETY: as promised by the caller.
        EMPTY | BUSY => unsafe { make(s, dev, bar) },
        _ => None,
    }
}

/// The window of pair `pair` for `dev` if it is live; never makes one, so
/// never sleeps (for callers inside a spinlock's section).
#[inline(always)]
pub(crate) fn live_for(pair: usize, dev: *mut bindings::device) -> Option<Window> {
    let s = SLOTS.get(pair)?;
    let w = s.word.load(Acquire);
    if w & STATE != LIVE {
        return None;
    }
    read(s, w, dev)
}

/// Reads the window of `s`, live in word `w`, if it is `dev`'s and the word
/// did not change meanwhile.
#[inline(always)]
fn read(s: &Slot, w: u32, dev: *mut bindings::device) -> Option<Window> {
    let (d, win) = (
        s.dev.load(Relaxed),
        Window {
            start: s.start.load(Relaxed),
            end: s.end.load(Relaxed),
            base: s.base.load(Relaxed),
        },
    );
    fence(Acquire);
    (d == dev && s.word.load(Relaxed) == w).then_some(win)
}

/// Decides the pair's window for `dev`, mapping it if `dev`'s DMA is
/// untranslated, unless another thread decided it first.
///
/// # Safety
///
/// As for [`get`].
#[cold]
#[inline(never)]
unsafe fn make(s: &Slot, dev: *mut bindings::device, (start, end): (u64, u64)) -> Option<Window> {
    let _making = MAKING.lock();
    let w = s.word.load(Acquire);
    match w & STATE {
        EMPTY => (),
        LIVE => return read(s, w, dev),
        _ => return None,
    }
    let busy = next(w, BUSY);
    s.word.store(busy, Relaxed);
    fence(Release);
    // SAFETY: a live device (caller).
    let iommu = unsafe { ffi::peermem_iommu_kind(dev) };
    // 0: no IOMMU, 1: identity domain.
    let base = if (0..=1).contains(&iommu) && start != 0 && start <= end {
        // SAFETY: a live device (caller); `[start, end]` is a PCI memory BAR
        // (the accounting's GPU record, read from the GPU's resource). The
        // window is undone by `retire`.
        unsafe { map_whole_bar(dev, start, end) }
    } else {
        None
    };
    s.dev.store(dev, Relaxed);
    s.start.store(start, Relaxed);
    s.end.store(end, Relaxed);
    s.base.store(base.unwrap_or(0), Relaxed);
    s.word
        .store(next(busy, if base.is_some() { LIVE } else { OWN }), Release);
    base.map(|base| Window { start, end, base })
}

/// Maps the BAR bytes `[start, end]` for `dev` and takes a reference on
/// `dev`; returns the device address of `start`.
///
/// # Safety
///
/// `dev` must be a live device and `[start, end]` a PCI memory BAR, with
/// `start <= end`. The mapping must be undone with [`unmap_whole_bar`].
unsafe fn map_whole_bar(dev: *mut bindings::device, start: u64, end: u64) -> Option<u64> {
    let mut base = 0u64;
    // SAFETY: a live device (caller); the reference is dropped by
    // `unmap_whole_bar`, or below if the mapping fails.
    unsafe { bindings::get_device(dev) };
    // SAFETY: a live device and a memory BAR (caller).
    let rc = unsafe { ffi::peermem_map_bar(dev, start, end - start + 1, &mut base) };
    if rc != 0 {
        // SAFETY: the reference taken above.
        unsafe { bindings::put_device(dev) };
        return None;
    }
    Some(base)
}

/// Undoes [`map_whole_bar`].
///
/// # Safety
///
/// `[start, end]` must have been mapped at `base` by [`map_whole_bar`] for
/// `dev`, and not undone yet.
unsafe fn unmap_whole_bar(dev: *mut bindings::device, start: u64, end: u64, base: u64) {
    // SAFETY: mapped for `dev`, which the mapping's reference keeps alive
    // (caller).
    unsafe {
        ffi::peermem_unmap_bar(dev, base, end - start + 1);
        bindings::put_device(dev);
    }
}

/// Retires the window of slot `s` if it is `only`'s (any device's if `None`):
/// unmaps it and drops its device reference. Sleeps while a window is made.
fn retire(s: &Slot, only: Option<*mut bindings::device>) {
    let _making = MAKING.lock();
    let w = s.word.load(Acquire);
    let (state, dev) = (w & STATE, s.dev.load(Relaxed));
    if state == EMPTY || only.is_some_and(|d| d != dev) {
        return;
    }
    let busy = next(w, BUSY);
    s.word.store(busy, Relaxed);
    fence(Release);
    if state == LIVE {
        let (start, end) = (s.start.load(Relaxed), s.end.load(Relaxed));
        // SAFETY: mapped by `make` for `dev` with these bounds; undone once
        // (the slot left LIVE above, under `MAKING`).
        unsafe { unmap_whole_bar(dev, start, end, s.base.load(Relaxed)) };
    }
    s.dev.store(ptr::null_mut(), Relaxed);
    s.word.store(next(busy, EMPTY), Release);
}

/// The number of live windows.
pub(crate) fn live() -> usize {
    SLOTS
        .iter()
        .filter(|s| s.word.load(Relaxed) & STATE == LIVE)
        .count()
}

/// `dev` lost its driver (C shim, bus notifier): its windows go, and so do
/// the pairs it is part of, with their windows on other devices (a GPU's).
#[no_mangle]
extern "C" fn peermem_device_unbound(dev: *mut bindings::device) {
    for s in &SLOTS {
        retire(s, Some(dev));
    }
    let (mut id, mut seg) = (0u32, 0);
    // SAFETY: the notifier's device, alive during the notification; valid
    // out-pointers.
    if !unsafe { ffi::peermem_peer_of(dev, &mut id, &mut seg) }.is_null() {
        crate::accounting::forget_pairs_of(id, |slot| retire(&SLOTS[slot], None));
        crate::accounting::retire_gpu(id);
    }
}

/// Watches PCI devices for the loss of their driver while the module has
/// windows; retires every window when dropped.
///
/// # Invariants
///
/// The shim's bus notifier is registered from `new` until `drop`.
pub(crate) struct Windows(());

impl Windows {
    /// Registers the bus notifier (before any client: no window exists yet).
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: called once per load, from `init`, before any client is
        // registered (so before `MAKING` is used).
        unsafe { MAKING.init() };
        // SAFETY: no preconditions; registered once.
        kernel::error::to_result(unsafe { ffi::peermem_watch_devices() })?;
        // INVARIANT: registered just above.
        Ok(Self(()))
    }
}

impl Drop for Windows {
    fn drop(&mut self) {
        // SAFETY: registered in `new` (type invariant); returns once no
        // notification runs any more.
        unsafe { ffi::peermem_unwatch_devices() };
        // The clients are unregistered and the reap queue drained (module
        // field order): no registration is left to use a window.
        for s in &SLOTS {
            retire(s, None);
        }
    }
}
