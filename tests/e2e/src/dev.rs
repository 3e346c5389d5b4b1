// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The testbed's devices from user space: "cudaMalloc/cudaFree" on
//! /dev/nv_p2p_emu and "ibv_reg_mr/ibv_dereg_mr" + device DMA on
//! /dev/peer_mem_core.

use std::{fs::File, fs::OpenOptions, os::fd::AsRawFd};

use crate::uapi::*;

/// A Linux errno.
pub type Errno = i32;

fn ioctl<T>(f: &File, req: u64, arg: *mut T) -> Result<(), Errno> {
    // SAFETY: `arg` points to a live value of the layout the request expects.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), req as _, arg) };
    if rc < 0 {
        Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO))
    } else {
        Ok(())
    }
}

fn open(path: &str) -> Result<File, String> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("open {path}: {e}"))
}

/// The emulated GPU driver.
pub struct Gpu {
    f: File,
}

/// A GPU allocation mapped into this process.
#[derive(Debug)]
pub struct Alloc {
    pub va: u64,
    pub size: u64,
    mapped: bool,
}

impl Gpu {
    pub fn open() -> Result<Self, String> {
        Ok(Self {
            f: open("/dev/nv_p2p_emu")?,
        })
    }

    /// cudaMalloc on `gpu`.
    pub fn alloc(&self, gpu: u64, size: u64) -> Result<Alloc, Errno> {
        self.alloc_at(gpu, size, None)
    }

    /// cudaMalloc on `gpu`, placed at `at` (64 KiB-aligned, must be free).
    pub fn alloc_at(&self, gpu: u64, size: u64, at: Option<u64>) -> Result<Alloc, Errno> {
        let mut a = NvemuAlloc {
            gpu,
            size,
            offset: 0,
        };
        ioctl(&self.f, NVEMU_IOC_ALLOC, &mut a)?;
        let fixed = if at.is_some() {
            libc::MAP_FIXED_NOREPLACE
        } else {
            0
        };
        // SAFETY: a fresh shared mapping of the device at the offset it gave;
        // MAP_FIXED_NOREPLACE never replaces an existing mapping.
        let p = unsafe {
            libc::mmap(
                at.unwrap_or(0) as *mut libc::c_void,
                a.size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | fixed,
                self.f.as_raw_fd(),
                a.offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO));
        }
        Ok(Alloc {
            va: p as u64,
            size: a.size,
            mapped: true,
        })
    }

    /// cudaFree without unmapping (the free ioctl).
    pub fn free(&self, a: &Alloc) -> Result<(), Errno> {
        let mut va = a.va;
        ioctl(&self.f, NVEMU_IOC_FREE, &mut va)
    }

    pub fn info(&self) -> NvemuInfo {
        let mut i = NvemuInfo::default();
        ioctl(&self.f, NVEMU_IOC_INFO, &mut i).expect("NVEMU_IOC_INFO");
        i
    }
}

impl Alloc {
    /// Unmaps (the "cudaFree" of a process that munmaps).
    pub fn unmap(&mut self) {
        if self.mapped {
            // SAFETY: our own mapping.
            unsafe { libc::munmap(self.va as *mut _, self.size as usize) };
            self.mapped = false;
        }
    }

    /// CPU write through the mapping.
    pub fn write(&self, off: u64, data: &[u8]) {
        assert!(self.mapped && off + data.len() as u64 <= self.size);
        for (i, b) in data.iter().enumerate() {
            // SAFETY: inside our mapping (checked above).
            unsafe { std::ptr::write_volatile((self.va + off + i as u64) as *mut u8, *b) };
        }
    }

    /// CPU read through the mapping.
    pub fn read(&self, off: u64, len: usize) -> Vec<u8> {
        assert!(self.mapped && off + len as u64 <= self.size);
        (0..len)
            // SAFETY: inside our mapping (checked above).
            .map(|i| unsafe { std::ptr::read_volatile((self.va + off + i as u64) as *const u8) })
            .collect()
    }
}

impl Drop for Alloc {
    fn drop(&mut self) {
        self.unmap();
    }
}

/// The emulated peer-memory core and its HCA.
pub struct Core {
    f: File,
}

impl Core {
    pub fn open() -> Result<Self, String> {
        Ok(Self {
            f: open("/dev/peer_mem_core")?,
        })
    }

    /// A stand-in while the core module is unloaded (its file must be
    /// closed for rmmod): every call on it fails.
    pub fn placeholder() -> Result<Self, String> {
        Ok(Self {
            f: open("/dev/null")?,
        })
    }

    /// ibv_reg_mr; returns the handle.
    pub fn reg(&self, addr: u64, len: u64, flags: u64) -> Result<u64, Errno> {
        let mut r = PmcReg {
            addr,
            len,
            flags,
            handle: 0,
        };
        ioctl(&self.f, PMC_IOC_REG, &mut r)?;
        Ok(r.handle)
    }

    pub fn dereg(&self, handle: u64) -> Result<(), Errno> {
        let mut h = handle;
        ioctl(&self.f, PMC_IOC_DEREG, &mut h)
    }

    pub fn query(&self, handle: u64) -> Result<PmcQuery, Errno> {
        let mut q = PmcQuery {
            handle,
            ..Default::default()
        };
        ioctl(&self.f, PMC_IOC_QUERY, &mut q)?;
        Ok(q)
    }

    fn dma(&self, handle: u64, offset: u64, buf: &mut [u8], dir: u64) -> Result<(), Errno> {
        let mut d = PmcDma {
            handle,
            offset,
            len: buf.len() as u64,
            dir,
            buf: buf.as_mut_ptr() as u64,
        };
        ioctl(&self.f, PMC_IOC_DMA, &mut d)
    }

    /// The HCA writes `data` into the MR at `offset` (from the MR's address).
    pub fn dma_write(&self, handle: u64, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let mut b = data.to_vec();
        self.dma(handle, offset, &mut b, PMC_DMA_TO_MR)
    }

    /// The HCA reads `len` bytes of the MR at `offset`.
    pub fn dma_read(&self, handle: u64, offset: u64, len: usize) -> Result<Vec<u8>, Errno> {
        let mut b = vec![0u8; len];
        self.dma(handle, offset, &mut b, PMC_DMA_FROM_MR)?;
        Ok(b)
    }

    /// The DMA scatterlist the core holds for a mapped peer MR (after its
    /// first/last fix-up), with the MR's address and length.
    pub fn sgl(&self, handle: u64) -> Result<(Vec<PmcSge>, u64, u64), Errno> {
        let mut cap = 64usize;
        loop {
            let mut v = vec![PmcSge::default(); cap];
            let mut a = PmcSgl {
                handle,
                entries: v.as_mut_ptr() as u64,
                capacity: cap as u64,
                ..Default::default()
            };
            ioctl(&self.f, PMC_IOC_SGL, &mut a)?;
            if a.nents <= cap as u64 {
                v.truncate(a.nents as usize);
                return Ok((v, a.addr, a.len));
            }
            cap = a.nents as usize;
        }
    }

    pub fn info(&self) -> PmcInfo {
        let mut i = PmcInfo::default();
        ioctl(&self.f, PMC_IOC_INFO, &mut i).expect("PMC_IOC_INFO");
        i
    }
}
