// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Mirror of tests/harness/uapi.h (every field a u64; sizes checked below).

#![allow(dead_code)]

const fn ioc(dir: u64, ty: u8, nr: u8, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | ((ty as u64) << 8) | nr as u64
}
const W: u64 = 1;
const R: u64 = 2;

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct NvemuAlloc {
    pub gpu: u64,
    pub size: u64,
    pub offset: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvemuInfo {
    pub gpus: u64,
    pub bar_size: [u64; 4],
    pub bar_free: [u64; 4],
    pub pins: u64,
    pub persistent_pins: u64,
    pub unpins: u64,
    pub callbacks: u64,
    pub live_tables: u64,
    pub live_mappings: u64,
    pub dma_maps: u64,
    pub live_allocs: u64,
    pub provider_bytes: u64,
    pub provider_ns: u64,
    pub foreign_puts: u64,
    pub failed_unpins: u64,
    pub stale_puts: u64,
    pub deferred_callbacks: u64,
    pub reused_tables: u64,
    pub topo_refusals: u64,
    pub rm_reentries: u64,
    pub provider_map_ns: u64,
}

pub const NVEMU_IOC_ALLOC: u64 = ioc(R | W, b'N', 1, core::mem::size_of::<NvemuAlloc>());
pub const NVEMU_IOC_FREE: u64 = ioc(W, b'N', 2, 8);
pub const NVEMU_IOC_INFO: u64 = ioc(R, b'N', 3, core::mem::size_of::<NvemuInfo>());

/// Values of /sys/kernel/debug/nv_p2p_emu/dma_map_style (see uapi.h for every knob).
pub const NVEMU_DMA_MAP_PAGES: u32 = 0;
pub const NVEMU_DMA_MAP_SHUFFLED: u32 = 1;
pub const NVEMU_DMA_MAP_RUNS: u32 = 2;

pub const PMC_REG_INVAL_SUPP: u64 = 1 << 0;
pub const PMC_REG_NON_PCI_DEV: u64 = 1 << 1;
pub const PMC_REG_READ_ONLY: u64 = 1 << 2;
pub const PMC_REG_REMAP: u64 = 1 << 3;

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct PmcReg {
    pub addr: u64,
    pub len: u64,
    pub flags: u64,
    pub handle: u64,
}

pub const PMC_SRC_HOST: u64 = 1;
pub const PMC_SRC_PEER: u64 = 2;
pub const PMC_STATE_MAPPED: u64 = 1;
pub const PMC_STATE_INVALIDATED: u64 = 2;
pub const PMC_STATE_UNMAPPED: u64 = 3;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PmcQuery {
    pub handle: u64,
    pub source: u64,
    pub state: u64,
    pub revoked: u64,
    pub nmap: u64,
    pub page_size: u64,
    pub first_dma: u64,
    pub first_len: u64,
    pub last_len: u64,
    pub total_len: u64,
    pub client: [u8; 64],
}

impl Default for PmcQuery {
    fn default() -> Self {
        // SAFETY: plain integers and bytes.
        unsafe { core::mem::zeroed() }
    }
}

impl PmcQuery {
    pub fn client_name(&self) -> String {
        let n = self.client.iter().position(|&b| b == 0).unwrap_or(64);
        String::from_utf8_lossy(&self.client[..n]).into_owned()
    }
}

pub const PMC_DMA_TO_MR: u64 = 1;
pub const PMC_DMA_FROM_MR: u64 = 2;

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct PmcDma {
    pub handle: u64,
    pub offset: u64,
    pub len: u64,
    pub dir: u64,
    pub buf: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct PmcInfo {
    pub hca_present: u64,
    pub live_umems: u64,
    pub clients: u64,
    pub invalidations: u64,
    pub dma_bytes: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct PmcSge {
    pub dma: u64,
    pub len: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct PmcSgl {
    pub handle: u64,
    pub entries: u64,
    pub capacity: u64,
    pub nents: u64,
    pub addr: u64,
    pub len: u64,
}

pub const PMC_IOC_REG: u64 = ioc(R | W, b'P', 1, core::mem::size_of::<PmcReg>());
pub const PMC_IOC_DEREG: u64 = ioc(W, b'P', 2, 8);
pub const PMC_IOC_QUERY: u64 = ioc(R | W, b'P', 3, core::mem::size_of::<PmcQuery>());
pub const PMC_IOC_DMA: u64 = ioc(W, b'P', 4, core::mem::size_of::<PmcDma>());
pub const PMC_IOC_INFO: u64 = ioc(R, b'P', 5, core::mem::size_of::<PmcInfo>());
pub const PMC_IOC_SGL: u64 = ioc(R | W, b'P', 6, core::mem::size_of::<PmcSgl>());

const _: () = assert!(core::mem::size_of::<NvemuInfo>() == 216);
const _: () = assert!(core::mem::size_of::<PmcQuery>() == 144);
const _: () = assert!(core::mem::size_of::<PmcDma>() == 40);
const _: () = assert!(core::mem::size_of::<PmcSgl>() == 48);
