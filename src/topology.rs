// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Where a registration's DMA goes: the (GPU, peer) pair, its PCIe path class
//! (computed once per pair, logged once), the path policy, and the
//! explanation of the GPU driver's topology refusal.

use kernel::prelude::*;

use crate::{
    accounting::{
        self,
        Bdf,
        Charge,
        Gpu,
        Pair, //
    },
    bar_window, compat, ffi,
    path::{
        self,
        Chain,
        Class,
        Hop,
        HopKind, //
    },
    peer_device::PeerDevice,
    stats::{
        fail,
        Cause, //
    },
};

/// The refusal level of the path policy (`path_policy`): 0 allows every
/// path; 1..=5 refuse paths worse than PIX..SYS.
pub(crate) fn policy_level() -> i32 {
    crate::policy_parameter()
}

/// What is known of one registration's route.
pub(crate) struct Route {
    gpu: Option<Gpu>,
    peer: u32,
    pair: Option<(Pair, Class)>,
}

fn hops(c: &ffi::PeermemChain, out: &mut [Hop; 16]) -> usize {
    let n = core::cmp::min(c.nhops as usize, out.len());
    for (o, h) in out.iter_mut().zip(c.hops.iter()).take(n) {
        *o = Hop {
            id: h.id,
            kind: match h.kind {
                1 => HopKind::RootPort,
                2 => HopKind::SwitchUp,
                3 => HopKind::SwitchDown,
                _ => HopKind::Bridge,
            },
            acs_redirect: h.acs_redirect != 0,
        };
    }
    n
}

#[cold]
#[inline(never)]
fn classify(gpu_chain: &ffi::PeermemChain, peer: &PeerDevice) -> Option<(path::Path, u32)> {
    let mut peer_chain = ffi::PeermemChain::default();
    // SAFETY: a live device (the `PeerDevice` invariant), a valid out-pointer.
    if unsafe { ffi::peermem_chain_of(peer.dev(), &mut peer_chain) } != 0 {
        return None;
    }
    let (mut ga, mut pa) = ([Hop::default(); 16], [Hop::default(); 16]);
    let (gn, pn) = (hops(gpu_chain, &mut ga), hops(&peer_chain, &mut pa));
    let a = Chain {
        root: gpu_chain.root,
        numa: gpu_chain.numa,
        hops: &ga[..gn],
    };
    let b = Chain {
        root: peer_chain.root,
        numa: peer_chain.numa,
        hops: &pa[..pn],
    };
    // SAFETY: a live device.
    let iommu = unsafe { ffi::peermem_iommu_kind(peer.dev()) };
    Some((path::classify(&a, &b), iommu.clamp(0, 4) as u32))
}

#[cold]
#[inline(never)]
fn log_new_pair(gpu: u32, peer: u32, p: path::Path, iommu: u32) {
    let class = p.class.name();
    let acs = if p.acs_redirect {
        ", ACS redirects peer requests to the root complex"
    } else {
        ""
    };
    let iommu = accounting::IOMMU_NAMES[iommu as usize];
    if p.class.through_root_complex() || p.acs_redirect {
        pr_warn!(
            "GPU {} and peer {}: path {class}{acs} (IOMMU: {iommu}): peer-to-peer traffic crosses the root complex; expect low bandwidth, or none on some platforms; put the HCA behind the GPU's PCIe switch{}\n",
            Bdf(gpu),
            Bdf(peer),
            if p.acs_redirect { " or disable ACS redirection on its ports" } else { "" }
        );
    } else {
        pr_info!(
            "GPU {} and peer {}: path {class} (IOMMU: {iommu})\n",
            Bdf(gpu),
            Bdf(peer)
        );
    }
}

impl Route {
    /// The route of pages starting at bus address `phys` to `peer`.
    // One call site per client mode: inlined into each `dma_map`.
    #[inline(always)]
    pub(crate) fn of(phys: u64, peer: &PeerDevice) -> Self {
        match Self::known(phys, peer) {
            Some(r) => r,
            None => Self::new_pair(phys, accounting::gpu_by_phys(phys), peer),
        }
    }

    /// The route of pages starting at bus address `phys` to `peer` if its
    /// GPU and pair are known already; never learns one, so never sleeps (for
    /// callers inside a spinlock's section).
    #[inline(always)]
    pub(crate) fn known(phys: u64, peer: &PeerDevice) -> Option<Self> {
        let peer_id = peer.id();
        let gpu = accounting::gpu_by_phys(phys)?;
        let found = accounting::find_pair(gpu.id, peer_id)?;
        Some(Self {
            gpu: Some(gpu),
            peer: peer_id,
            pair: Some(found),
        })
    }

    /// A new pair, maybe of a new GPU (rare): walks the PCI devices,
    /// classifies the pair and records both.
    #[cold]
    #[inline(never)]
    fn new_pair(phys: u64, known: Option<Gpu>, peer: &PeerDevice) -> Self {
        let peer_id = peer.id();
        let mut chain = ffi::PeermemChain::default();
        let (mut start, mut end) = (0u64, 0u64);
        // SAFETY: valid out-pointers; the helper walks the PCI devices itself.
        let rc = unsafe { ffi::peermem_gpu_by_phys(phys, &mut chain, &mut start, &mut end) };
        let found = rc == 0;
        let gpu = match known {
            Some(g) => Some(g),
            None if found => accounting::add_gpu(chain.id, start, end),
            None => None,
        };
        let Some(gpu) = gpu else {
            return Self {
                gpu: None,
                peer: peer_id,
                pair: None,
            };
        };
        let pair = found
            .then(|| classify(&chain, peer))
            .flatten()
            .and_then(|(p, iommu)| {
                let (pair, new) =
                    accounting::add_pair(gpu.id, peer_id, p.class, p.acs_redirect, iommu)?;
                if new {
                    log_new_pair(gpu.id, peer_id, p, iommu);
                }
                Some((pair, p.class))
            });
        Self {
            gpu: Some(gpu),
            peer: peer_id,
            pair,
        }
    }

    /// The path policy's verdict.
    // One call site per client mode: inlined into each `dma_map`.
    #[inline(always)]
    pub(crate) fn admit(&self) -> Result {
        if self.allowed() {
            return Ok(());
        }
        let Some((pair, class)) = &self.pair else {
            return Ok(());
        };
        let level = policy_level();
        pair.refused_by_policy();
        let limit = Class::from_level(level as u32).map_or("?", Class::name);
        Err(fail!(
            Cause::PathPolicy,
            EPERM,
            "refused by path_policy={level}: the path between GPU {} and peer {} is {}, worse than {limit}",
            Bdf(self.gpu.map_or(0, |g| g.id)),
            Bdf(self.peer),
            class.name()
        ))
    }

    /// Whether the path policy allows this route, without a word (the
    /// refusal itself is [`Route::admit`]'s, which counts and explains it).
    #[inline(always)]
    pub(crate) fn allowed(&self) -> bool {
        let level = policy_level();
        match &self.pair {
            Some((_, class)) => level <= 0 || (*class as i32) <= level,
            None => true,
        }
    }

    /// A registration on this route failed with `e`; explains a refusal by
    /// the GPU driver's topology check once per pair.
    #[cold]
    #[inline(never)]
    pub(crate) fn failed(&self, e: Error, by_driver_map: bool) {
        let Some((pair, class)) = &self.pair else {
            return;
        };
        pair.failed(-e.to_errno());
        if by_driver_map && e == compat::eopnotsupp() && pair.first_refusal() {
            pr_err!(
                "nvidia_p2p_dma_map_pages refused GPU {} and peer {} (path {}): the GPU driver's topology check (580+) does not allow peer-to-peer DMA on this path; set NVreg_GrdmaPciTopoCheckOverride=1 for nvidia.ko, move the HCA behind the GPU's PCIe switch, or disable ACS redirection\n",
                Bdf(self.gpu.map_or(0, |g| g.id)),
                Bdf(self.peer),
                class.name()
            );
        }
    }

    /// The pair's whole-BAR window for `peer` (see `bar_window`), if its DMA
    /// is untranslated.
    pub(crate) fn window(&self, peer: &PeerDevice) -> Option<bar_window::Window> {
        let (pair, _) = self.pair.as_ref()?;
        let bar = accounting::gpu_bar(self.gpu?);
        // SAFETY: the core keeps `peer` alive and bound while it maps for it
        // (the `PeerDevice` invariant; we are inside its `dma_map`).
        unsafe { bar_window::get(pair.slot, peer.dev(), bar) }
    }

    /// The pair's window for `peer` if it is live already (see
    /// [`bar_window::live`]); never makes one.
    #[inline(always)]
    pub(crate) fn live_window(&self, peer: &PeerDevice) -> Option<bar_window::Window> {
        let (pair, _) = self.pair.as_ref()?;
        bar_window::live_for(pair.slot, peer.dev())
    }

    /// Counts a mapped registration of `bytes` for the process `tgid` (the
    /// one that pinned it).
    // One call site per client mode: inlined into each `dma_map`.
    #[inline(always)]
    pub(crate) fn charge(&self, tgid: u32, bytes: u64) -> Option<Charge> {
        if !crate::accounting_parameter() {
            return None;
        }
        let (pair, _) = self.pair?;
        let gpu = self.gpu?;
        Some(accounting::charge(pair, gpu, tgid, bytes))
    }
}
