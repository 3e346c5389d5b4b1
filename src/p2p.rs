// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Thin wrappers over NVIDIA's kernel p2p API (`nvidia_p2p_*`).
//!
//! The provider owns the page tables and DMA mappings it hands out and, for
//! non-persistent pins, frees them itself right after its free callback
//! returns. Whether a handle may still be used is therefore decided by the
//! registration's lifecycle, not by Rust ownership: the handles here are
//! plain tokens with `unsafe` accessors, and a free callback is a function
//! with its data. Nothing here knows what a registration is.

use core::ptr::NonNull;

use kernel::{
    bindings::pci_dev,
    ffi::c_void,
    prelude::*, //
};

use crate::{
    compat, exports, ffi,
    range::{
        GpuRange,
        GPU_PAGE_SIZE, //
    },
};

/// Page-table major versions whose fields up to `gpu_uuid` we can read:
/// 1 (drivers up to 575, minor 2 or later) and 2 (580 and later).
pub(crate) const fn page_table_version_ok(v: u32) -> bool {
    let (major, minor) = (v >> 16, v & 0xffff);
    let compiled_minor = ffi::NVIDIA_P2P_PAGE_TABLE_VERSION & 0xffff;
    (major == 1 && minor >= compiled_minor) || major == 2
}

/// DMA mappings of major 2 with at least the compiled minor.
pub(crate) const fn dma_mapping_version_ok(v: u32) -> bool {
    let want = ffi::NVIDIA_P2P_DMA_MAPPING_VERSION;
    v >> 16 == want >> 16 && (v & 0xffff) >= (want & 0xffff)
}

/// Why a provider object was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mismatch {
    /// Unknown structure version.
    Version(u32),
    /// Page size other than 64 KiB.
    PageSize(u32),
    /// Entry count differing from the pinned range.
    Entries(u32),
}

/// Maps a provider return code to what user space may see: never `ENOTSUPP`
/// (524, kernel-internal), never a positive or out-of-range value.
pub(crate) fn provider_error(rc: i32) -> Error {
    // Not an errno at all (positive, zero, or past MAX_ERRNO): say EIO.
    if !(-4095..0).contains(&rc) {
        return EIO;
    }
    const PASSED: [Error; 9] = [
        EINVAL, ENOMEM, EFAULT, EBUSY, EIO, ENODEV, EPERM, EAGAIN, ENOENT,
    ];
    match Error::from_errno(rc) {
        e if e == ENOTSUPP || e == compat::eopnotsupp() => compat::eopnotsupp(),
        e if PASSED.contains(&e) => e,
        _ => EIO,
    }
}

/// A page table pinned by the provider.
///
/// # Invariants
///
/// The pointer came from a successful `nvidia_p2p_get_pages[_persistent]`.
/// It stays valid until the matching unpin, or (non-persistent) until the
/// provider's free callback returns; the owning lifecycle tracks which.
pub(crate) struct PageTable(NonNull<ffi::nvidia_p2p_page_table>);

// SAFETY: a page table is a provider-owned object; using it from any thread
// is allowed by the API, and the lifecycle serialises who may use it.
unsafe impl Send for PageTable {}

/// A DMA mapping of a page table for one peer device.
///
/// # Invariants
///
/// The pointer came from a successful `nvidia_p2p_dma_map_pages` and is valid
/// under the same conditions as its page table.
pub(crate) struct DmaMapping(NonNull<ffi::nvidia_p2p_dma_mapping>);

// SAFETY: as for `PageTable`.
unsafe impl Send for DmaMapping {}

/// Waits, at module exit, for every free callback that may still be running
/// this module's code.
///
/// A free callback hands its reference to the reap list and then still
/// has to return; if that reference was the last, the module can be unloaded
/// in between. The callback runs under the GPU driver's RM API lock, and every
/// p2p entry point takes that lock first (docs/driver-facts.md, facts 1
/// and 2): so one call that enters RM after the last module reference is gone
/// returns only when every callback in flight has returned to RM. The call is
/// a persistent pin of address 0, which is never GPU memory: RM takes the lock,
/// fails to find a GPU for it and answers `EINVAL` (`rm_p2p_get_gpu_info`,
/// `src/nvidia/arch/nvalloc/unix/src/osapi.c`). Scenario
/// `rmmod_races_last_callback` fails if exit does not wait.
///
/// # Invariants
///
/// Made only by the invalidating mode's init; dropped in its exit after the
/// clients are unregistered (no new callback can be armed then).
pub(crate) struct CallbackFence(());

impl CallbackFence {
    /// A fence for the module's exit.
    pub(crate) fn new() -> Self {
        Self(())
    }

    /// One call through RM's API lock; `Ok` when the lock was taken.
    fn through_rm_lock() -> Result {
        let probe = GpuRange {
            start: 0,
            len: GPU_PAGE_SIZE,
        };
        match get_pages_persistent(&probe) {
            // Taken, and no GPU maps address 0.
            Err(e) if e == EINVAL => Ok(()),
            // Some GPU does: taken too; give the pin back.
            Ok(table) => {
                // SAFETY: just pinned by `get_pages_persistent` for `probe`.
                if let Err(e) = unsafe { table.put_persistent(&probe) } {
                    pr_warn!("exit: unpinning the lock probe at address 0 failed: {e:?}\n");
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

impl Drop for CallbackFence {
    fn drop(&mut self) {
        // An error from before the lock (an allocation, say) proves nothing:
        // try again, for up to half a second.
        for _ in 0..50 {
            if Self::through_rm_lock().is_ok() {
                return;
            }
            kernel::time::delay::fsleep(kernel::time::Delta::from_millis(10));
        }
        pr_warn!(
            "exit: the GPU driver refused every call, so a free callback may still be returning\n"
        );
    }
}

/// The GPU driver's entry points: bound before any client registers, so
/// `ENODEV` only for a call made before (none is). Each is the function the
/// driver exports under the name `nv-p2p.h` declares it with, its type the
/// header's (`binding` checks the driver before publishing them).
#[inline]
fn api() -> Result<&'static ffi::peermem_p2p_api> {
    exports::P2P.get().ok_or(ENODEV)
}

/// A provider return code as a result (see [`provider_error`]).
fn provider_result(rc: i32) -> Result {
    (rc == 0).then_some(()).ok_or_else(|| provider_error(rc))
}

/// The object the provider made, as the token `token` makes of it, if its
/// return code `rc` is a success (see [`provider_result`]).
fn made<T, U>(rc: i32, p: *mut T, token: fn(NonNull<T>) -> U) -> Result<U> {
    provider_result(rc)?;
    // INVARIANT: the provider returned success with this pointer.
    NonNull::new(p).map(token).ok_or(EIO)
}

/// Pins `range` without a free callback; the pages stay until unpinned.
pub(crate) fn get_pages_persistent(range: &GpuRange) -> Result<PageTable> {
    let mut pt = core::ptr::null_mut();
    let f = api()?.get_pages_persistent.ok_or(ENODEV)?;
    // SAFETY: `pt` is a valid out-pointer; the provider validates the range.
    let rc = unsafe { f(range.start, range.len, &mut pt, 0) };
    made(rc, pt, PageTable)
}

/// A free callback: the GPU driver calls it with its data when it frees the
/// pages of a non-persistent pin.
pub(crate) type FreeCallback = unsafe extern "C" fn(*mut c_void);

/// Pins `range` with the free callback `callback`, which the GPU driver calls
/// with `data` (at most once) when it frees the pages; the callback may run
/// before this returns. On an error the driver did not keep `data`.
///
/// # Safety
///
/// `callback` must be sound to call with `data` from any sleepable context
/// until the pin is undone (a successful unpin by the pinning process).
pub(crate) unsafe fn get_pages(
    range: &GpuRange,
    callback: FreeCallback,
    data: *mut c_void,
) -> Result<PageTable> {
    let mut pt = core::ptr::null_mut();
    let f = api()?.get_pages.ok_or(ENODEV)?;
    // SAFETY: `pt` is a valid out-pointer; the callback may be called with
    // `data` (caller).
    let rc = unsafe { f(0, 0, range.start, range.len, &mut pt, Some(callback), data) };
    made(rc, pt, PageTable)
}

impl PageTable {
    /// A token for the table at `table` (for KUnit).
    ///
    /// # Safety
    ///
    /// As for a table from the provider: valid while the token is used.
    #[cfg(CONFIG_KUNIT = "y")]
    pub(crate) unsafe fn from_raw(table: NonNull<ffi::nvidia_p2p_page_table>) -> Self {
        PageTable(table)
    }

    /// A second token for the same table.
    ///
    /// # Safety
    ///
    /// The caller must not use the alias after the table is unpinned or
    /// revoked, nor unpin through it.
    pub(crate) unsafe fn alias(&self) -> PageTable {
        PageTable(self.0)
    }

    /// Checks the version, page size and entry count against what was pinned;
    /// returns the number of entries.
    ///
    /// # Safety
    ///
    /// The table must still be valid (see the type invariants).
    pub(crate) unsafe fn check(&self, range: &GpuRange) -> Result<u32, Mismatch> {
        // SAFETY: valid per the caller's guarantee.
        let t = unsafe { self.0.as_ref() };
        if !page_table_version_ok(t.version) {
            return Err(Mismatch::Version(t.version));
        }
        if t.page_size != ffi::nvidia_p2p_page_size_type_NVIDIA_P2P_PAGE_SIZE_64KB {
            return Err(Mismatch::PageSize(t.page_size));
        }
        if u64::from(t.entries) != range.pages(GPU_PAGE_SIZE) {
            return Err(Mismatch::Entries(t.entries));
        }
        Ok(t.entries)
    }

    /// Bus address of each pinned page, and whether the table describes
    /// coherent (C2C) memory rather than BAR1 pages.
    ///
    /// # Safety
    ///
    /// The table must still be valid, checked by [`PageTable::check`], and
    /// stay valid while the returned view is used.
    pub(crate) unsafe fn pages(&self) -> PageView<'_> {
        // SAFETY: valid and checked (caller).
        let t = unsafe { self.0.as_ref() };
        let flags_at = self
            .0
            .as_ptr()
            .wrapping_byte_add(PAGE_TABLE_V2_FLAGS_OFFSET);
        let flags = match t.version >> 16 {
            // SAFETY: a version 2 table carries `flags` right after the public
            // fields (nv-p2p.h 580+); version 1 tables have none.
            2.. => Some(unsafe { flags_at.cast::<u32>().read_unaligned() }),
            _ => None,
        };
        let pages: &[Option<&ffi::nvidia_p2p_page>] = match t.pages.is_null() {
            true => &[],
            // SAFETY: a checked table holds `entries` page pointers, each NULL
            // or to a page valid while the table is (`Option<&_>` has a
            // pointer's layout).
            false => unsafe {
                core::slice::from_raw_parts(t.pages.cast_const().cast(), t.entries as usize)
            },
        };
        PageView {
            pages,
            entries: t.entries as usize,
            coherent: flags.is_some_and(|f| f & PAGE_TABLE_FLAGS_CPU_CACHEABLE != 0),
        }
    }

    /// Checks the table as [`PageTable::check`] does and returns its view.
    ///
    /// # Safety
    ///
    /// As for [`PageTable::pages`], without the check.
    pub(crate) unsafe fn checked_pages(&self, range: &GpuRange) -> Option<PageView<'_>> {
        // SAFETY: valid (caller), and checked before the view is made.
        unsafe { self.check(range).ok().map(|_| self.pages()) }
    }

    /// Unpins a non-persistent table. Safe against a racing free callback:
    /// the provider looks the pin up under the lock it holds across the
    /// callback and returns 0 if the callback already unlinked it. What a
    /// return of 0 does not prove: the provider finds the pin by the
    /// *caller's process* and also returns 0, unpinning nothing, when called
    /// from another one (docs/driver-facts.md, fact 7); and an error
    /// leaves the pin and its callback armed (fact 8). Only a 0 from the
    /// pinning process means the callback has run or never will.
    ///
    /// # Safety
    ///
    /// The table must have been pinned by [`get_pages`] for `range`, and not
    /// unpinned before.
    pub(crate) unsafe fn put(self, range: &GpuRange) -> Result {
        let f = api()?.put_pages.ok_or(ENODEV)?;
        // SAFETY: per the caller's guarantee; the provider only compares the
        // pointer with its live tables.
        let rc = unsafe { f(0, 0, range.start, self.0.as_ptr()) };
        provider_result(rc)
    }

    /// Unpins a persistent table.
    ///
    /// # Safety
    ///
    /// The table must have been pinned by [`get_pages_persistent`] for
    /// `range`, and not unpinned before.
    pub(crate) unsafe fn put_persistent(self, range: &GpuRange) -> Result {
        let f = api()?.put_pages_persistent.ok_or(ENODEV)?;
        // SAFETY: per the caller's guarantee.
        let rc = unsafe { f(range.start, self.0.as_ptr(), 0) };
        provider_result(rc)
    }

    /// Maps the table for DMA by `peer`.
    ///
    /// # Safety
    ///
    /// The table must still be valid and `peer` a live PCI device.
    pub(crate) unsafe fn dma_map(&self, peer: *mut pci_dev) -> Result<DmaMapping> {
        let mut m = core::ptr::null_mut();
        let f = api()?.dma_map_pages.ok_or(ENODEV)?;
        // SAFETY: per the caller's guarantee; `m` is a valid out-pointer.
        let rc = unsafe { f(peer, self.0.as_ptr(), &mut m) };
        made(rc, m, DmaMapping)
    }

    /// Undoes [`PageTable::dma_map`].
    ///
    /// # Safety
    ///
    /// The table and the mapping must still be valid (no free callback can
    /// have run), and `peer` must be the device the mapping was made for.
    pub(crate) unsafe fn dma_unmap(&self, peer: *mut pci_dev, m: DmaMapping) -> Result {
        let f = api()?.dma_unmap_pages.ok_or(ENODEV)?;
        // SAFETY: per the caller's guarantee.
        let rc = unsafe { f(peer, self.0.as_ptr(), m.0.as_ptr()) };
        provider_result(rc)
    }
}

/// Offset of `flags` in a version 2 page table (after `gpu_uuid`).
pub(crate) const PAGE_TABLE_V2_FLAGS_OFFSET: usize = 32;
/// `NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE` (nv-p2p.h 580+).
const PAGE_TABLE_FLAGS_CPU_CACHEABLE: u32 = 1;

/// The pages of a checked page table, borrowed from it: `entries` of them,
/// of which `pages` has the pointers (none if the table has none).
pub(crate) struct PageView<'a> {
    pages: &'a [Option<&'a ffi::nvidia_p2p_page>],
    entries: usize,
    coherent: bool,
}

impl<'a> PageView<'a> {
    /// A view of the pages `pages` (for KUnit).
    #[cfg(CONFIG_KUNIT = "y")]
    pub(crate) fn from_pages(pages: &'a [Option<&'a ffi::nvidia_p2p_page>]) -> Self {
        Self {
            pages,
            entries: pages.len(),
            coherent: false,
        }
    }

    /// Number of 64 KiB pages.
    pub(crate) fn len(&self) -> usize {
        self.entries
    }

    /// Whether the memory is coherent system memory (Grace Hopper and later
    /// C2C platforms) rather than BAR1 pages.
    pub(crate) fn coherent(&self) -> bool {
        self.coherent
    }

    /// Physical (bus) address of page `i`, or `None` past the end.
    pub(crate) fn physical_address(&self, i: usize) -> Option<u64> {
        let page = (*self.pages.get(i)?)?;
        Some(page.physical_address)
    }
}

impl DmaMapping {
    /// Checks version, page size and entry count: a mapping that passes is
    /// one [`DmaMapping::addresses`] and [`DmaMapping::peer`] may read.
    ///
    /// # Safety
    ///
    /// The mapping must still be valid.
    pub(crate) unsafe fn check(&self, entries: u32) -> Result<(), Mismatch> {
        // SAFETY: valid per the caller's guarantee.
        let m = unsafe { self.0.as_ref() };
        if !dma_mapping_version_ok(m.version) {
            return Err(Mismatch::Version(m.version));
        }
        if m.page_size_type != ffi::nvidia_p2p_page_size_type_NVIDIA_P2P_PAGE_SIZE_64KB {
            return Err(Mismatch::PageSize(m.page_size_type));
        }
        if m.entries != entries || m.dma_addresses.is_null() {
            return Err(Mismatch::Entries(m.entries));
        }
        Ok(())
    }

    /// The bus addresses, one per 64 KiB page.
    ///
    /// # Safety
    ///
    /// The mapping must have passed [`DmaMapping::check`] and stay valid
    /// while the slice is used.
    pub(crate) unsafe fn addresses(&self) -> &[u64] {
        // SAFETY: valid per the caller's guarantee; the provider allocated
        // `entries` addresses (checked not null), valid as long as the
        // mapping is.
        unsafe {
            let m = self.0.as_ref();
            core::slice::from_raw_parts(m.dma_addresses, m.entries as usize)
        }
    }

    /// The device the mapping was made for. nvidia.ko records the `peer` of
    /// `nvidia_p2p_dma_map_pages` in the mapping's `pci_dev`, undoes the
    /// mapping's IOVAs for that device, and WARNs when the `peer` of
    /// `nvidia_p2p_dma_unmap_pages` is another (nv-p2p.c:
    /// `nv_p2p_dma_map_pages`, `nv_p2p_free_dma_mapping`,
    /// `nvidia_p2p_dma_unmap_pages`; the testbed's provider does the same,
    /// and a WARN fails every test boot).
    ///
    /// # Safety
    ///
    /// The mapping must have passed [`DmaMapping::check`] (a version with
    /// `pci_dev`) and still be valid.
    pub(crate) unsafe fn peer(&self) -> *mut pci_dev {
        // SAFETY: valid per the caller's guarantee.
        unsafe { self.0.as_ref() }.pci_dev
    }
}
