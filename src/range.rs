// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Widening of a user range to the GPU's pinning granule.
//!
//! Plain Rust without kernel types: the module and the host test crate compile
//! this very file.

/// Size of a GPU page as NVIDIA's p2p API pins and maps it (64 KiB).
pub(crate) const GPU_PAGE_SIZE: u64 = 1 << 16;

/// A user range widened to whole pinning granules.
///
/// # Invariants
///
/// `start` and `len` are multiples of the granule it was built with, `len` is
/// not zero and `start + len` does not overflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GpuRange {
    /// First byte of the first granule.
    pub(crate) start: u64,
    /// Length in bytes, a whole number of granules.
    pub(crate) len: u64,
}

/// Why a user range cannot be widened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RangeError {
    /// The range is empty.
    Empty,
    /// The range, or its widening, runs past the end of the address space.
    Overflow,
    /// The granule is not a power of two.
    BadGranule,
}

impl GpuRange {
    /// Widens `[addr, addr + size)` to whole granules of `granule` bytes.
    ///
    /// The start is rounded down and the end up; an empty range, or one whose
    /// end (rounded up) passes 2^64, is refused.
    pub(crate) fn widen(addr: u64, size: u64, granule: u64) -> Result<Self, RangeError> {
        if granule == 0 || !granule.is_power_of_two() {
            return Err(RangeError::BadGranule);
        }
        if size == 0 {
            return Err(RangeError::Empty);
        }
        let last = addr.checked_add(size - 1).ok_or(RangeError::Overflow)?;
        let mask = !(granule - 1);
        let (start, last_start) = (addr & mask, last & mask);
        let len = (last_start - start)
            .checked_add(granule)
            .ok_or(RangeError::Overflow)?;
        start.checked_add(len).ok_or(RangeError::Overflow)?;
        // INVARIANT: both ends are granule multiples and the end fits in u64.
        Ok(Self { start, len })
    }

    /// Number of granules of `granule` bytes in the range.
    pub(crate) fn pages(&self, granule: u64) -> u64 {
        self.len / granule
    }

    /// Whether `[addr, addr + size)` lies inside this range.
    pub(crate) fn covers(&self, addr: u64, size: u64) -> bool {
        // The offset of `addr` in the range and the room after it: no sum
        // that could overflow (each subtraction is guarded by its compare).
        addr >= self.start && size <= self.len && addr - self.start <= self.len - size
    }
}

/// The pinning granule on a kernel with pages of `page_size` bytes: 64 KiB,
/// or the page size where pages are larger (64 KiB-page arm64 kernels).
pub(crate) const fn granule(page_size: u64) -> u64 {
    if page_size > GPU_PAGE_SIZE {
        page_size
    } else {
        GPU_PAGE_SIZE
    }
}
