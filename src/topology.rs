// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Where a registration's DMA goes: the (GPU, peer) pair, its PCIe path class
//! (computed once per pair, logged once), the path policy, and the
//! explanation of the GPU driver's topology refusal.

use kernel::prelude::*;

use crate::{
    accounting::{
        self,
        Charge,
        Gpu,
        Pair, //
    },
    compat, ffi, p2p, params,
    path::{
        self,
        Chain,
        Class,
        Gate,
        Hop,
        HopKind,
        Verdict, //
    },
    peer_device::PeerDevice,
    range::{
        GpuRange,
        GPU_PAGE_SIZE, //
    },
    stats::{
        fail,
        At,
        Bdf,
        Cause,
        STATS, //
    },
};

use kernel::sync::atomic::Relaxed;

/// What is known of one registration's route.
///
/// The path's class and whether a bridge sits above both devices are known
/// whether or not the pair has a slot in the accounting's table: a pair
/// without one is classified at each registration, and the path policy and
/// the topology gate hold for it all the same.
pub(crate) struct Route {
    gpu: Option<Gpu>,
    /// The GPU's PCI address (0: not found).
    gpu_id: u32,
    peer: u32,
    /// The path's class, if the devices could be classified.
    class: Option<Class>,
    shares_bridge: bool,
    pair: Option<Pair>,
}

/// The device's way up as the shim gave it in `c`, its hops copied to `out`.
fn chain<'a>(c: &ffi::PeermemChain, out: &'a mut [Hop; 16]) -> Chain<'a> {
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
    Chain {
        root: c.root,
        numa: c.numa,
        hops: &out[..n],
    }
}

#[cold]
fn classify(gpu_chain: &ffi::PeermemChain, peer: &PeerDevice) -> Option<(path::Path, u32)> {
    let mut peer_chain = ffi::PeermemChain::default();
    // SAFETY: a live device (the `PeerDevice` invariant), a valid out-pointer.
    if unsafe { ffi::peermem_chain_of(peer.dev(), &mut peer_chain) } != 0 {
        return None;
    }
    let (mut ga, mut pa) = ([Hop::default(); 16], [Hop::default(); 16]);
    let (a, b) = (chain(gpu_chain, &mut ga), chain(&peer_chain, &mut pa));
    // SAFETY: a live device.
    let iommu = unsafe { ffi::peermem_iommu_kind(peer.dev()) };
    Some((path::classify(&a, &b), iommu.clamp(0, 4) as u32))
}

#[cold]
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
    /// The route of pages starting at bus address `phys` to `peer`: one look
    /// at the tables when its GPU and pair are known already.
    pub(crate) fn of(phys: u64, peer: &PeerDevice) -> Self {
        let peer_id = peer.id();
        match accounting::known_pair(phys, peer_id) {
            Some((gpu, pair, class)) => Self {
                gpu: Some(gpu),
                gpu_id: gpu.id,
                peer: peer_id,
                class: Some(class),
                shares_bridge: pair.shares_bridge,
                pair: Some(pair),
            },
            None => Self::new_pair(phys, accounting::gpu_by_phys(phys), peer),
        }
    }

    /// A new pair, maybe of a new GPU (rare), or a pair without a slot:
    /// walks the PCI devices, classifies the pair and records what the
    /// tables have room for.
    #[cold]
    fn new_pair(phys: u64, known: Option<Gpu>, peer: &PeerDevice) -> Self {
        let peer_id = peer.id();
        let found = pci_gpu(phys);
        let gpu = known.or_else(|| found.as_ref().and_then(record_gpu));
        let chain = found.map_or_else(ffi::PeermemChain::default, |(c, _)| c);
        let path = found.and_then(|_| classify(&chain, peer));
        let pair = path.and_then(|(p, iommu)| {
            let Some((pair, new)) = accounting::add_pair(chain.id, peer_id, p, iommu) else {
                kernel::pr_warn_once!("the GPU/peer pair table is full: pairs without a slot are classified at each registration, and debugfs paths does not show them\n");
                return None;
            };
            if new {
                log_new_pair(chain.id, peer_id, p, iommu);
            }
            Some(pair)
        });
        Self {
            gpu,
            gpu_id: found.map_or(gpu.map_or(0, |g| g.id), |_| chain.id),
            peer: peer_id,
            class: path.map(|(p, _)| p.class),
            shares_bridge: path.is_some_and(|(p, _)| p.shares_bridge),
            pair,
        }
    }

    /// Where a refusal on this route happened, for its log line.
    pub(crate) fn at(&self) -> At {
        At {
            gpu: self.gpu_id,
            hca: self.peer,
        }
    }

    /// The path policy's verdict.
    pub(crate) fn admit(&self) -> Result {
        if self.allowed() {
            return Ok(());
        }
        Err(self.refused_by_policy())
    }

    #[cold]
    fn refused_by_policy(&self) -> Error {
        let level = params::policy_level();
        if let Some(pair) = &self.pair {
            pair.refused_by_policy();
        }
        let limit = Class::from_level(level as u32).map_or("?", Class::name);
        fail!(
            at self.at();
            Cause::PathPolicy,
            EPERM,
            "refused by path_policy={level}: the path between GPU {} and peer {} is {}, worse than {limit}",
            Bdf(self.gpu_id),
            Bdf(self.peer),
            self.class.map_or("not classifiable", Class::name)
        )
    }

    /// The GPU driver's topology gate (fact 5) for this route, which the
    /// invalidating client applies itself: it maps BAR pages without the
    /// driver, whose lock it must not take under the core's `mapping_lock`.
    /// A route without a pair record counts as sharing no bridge.
    pub(crate) fn gate(&self) -> Gate {
        // A GPU without a record (its table full) has no verdict learnt.
        let (near, far) = self
            .gpu
            .and_then(|g| g.gate)
            .unwrap_or((Verdict::Unknown, Verdict::Unknown));
        path::gate(self.shares_bridge, near, far, params::unverified_allowed())
    }

    /// [`Route::gate`]'s verdict, a refusal counted on the pair and
    /// explained once per pair.
    pub(crate) fn admit_gate(&self) -> Result {
        match self.gate() {
            Gate::Open => Ok(()),
            g => Err(self.gate_refused(g)),
        }
    }

    #[cold]
    fn gate_refused(&self, g: Gate) -> Error {
        let e = compat::eopnotsupp();
        // A pair without a slot is explained by the once-per-cause line.
        let first = self.pair.is_some_and(|pair| {
            pair.failed(-e.to_errno());
            pair.first_refusal()
        });
        let (gpu, peer) = (Bdf(self.gpu_id), Bdf(self.peer));
        if first && g == Gate::Refused {
            pr_err!("GPU {gpu} and peer {peer}: the GPU driver's topology check (580+) does not allow peer-to-peer DMA on this path, so nv_mem does not map it either; set NVreg_GrdmaPciTopoCheckOverride=1 for nvidia.ko, move the HCA behind the GPU's PCIe switch, or disable ACS redirection\n");
        } else if first {
            pr_err!("GPU {gpu} and peer {peer}: no PCIe switch in common and the GPU driver's topology verdict could not be learnt (persistent pins refused, as under MIG or vGPU), so nv_mem refuses the path; load nvidia_peermem with allow_unverified_paths=1 if this platform supports peer-to-peer DMA between them\n");
        }
        let why = match g {
            Gate::Refused => "the GPU driver refuses peer-to-peer DMA on this path (NVreg_GrdmaPciTopoCheckOverride)",
            _ => "no common PCIe switch and the GPU driver's verdict unknown (allow_unverified_paths)",
        };
        fail!(
            at self.at();
            Cause::Topology,
            e,
            "refused by the topology gate: GPU {gpu} and peer {peer}: {why}"
        )
    }

    /// Whether the path policy allows this route, without a word (the
    /// refusal itself is [`Route::admit`]'s, which counts and explains it).
    pub(crate) fn allowed(&self) -> bool {
        let level = params::policy_level();
        // A path that could not be classified passes only a policy that
        // allows every path.
        level <= 0 || self.class.is_some_and(|c| (c as i32) <= level)
    }

    /// A registration on this route failed with `e`; explains a refusal by
    /// the GPU driver's topology check once per pair.
    #[cold]
    pub(crate) fn failed(&self, e: Error, by_driver_map: bool) {
        let Some(pair) = &self.pair else {
            return;
        };
        pair.failed(-e.to_errno());
        if by_driver_map && e == compat::eopnotsupp() && pair.first_refusal() {
            pr_err!(
                "nvidia_p2p_dma_map_pages refused GPU {} and peer {} (path {}): the GPU driver's topology check (580+) does not allow peer-to-peer DMA on this path; set NVreg_GrdmaPciTopoCheckOverride=1 for nvidia.ko, move the HCA behind the GPU's PCIe switch, or disable ACS redirection\n",
                Bdf(self.gpu_id),
                Bdf(self.peer),
                self.class.map_or("?", Class::name)
            );
        }
    }

    /// Counts a mapped registration of `bytes` for the process `tgid` (the
    /// one that pinned it).
    pub(crate) fn charge(&self, tgid: u32, bytes: u64) -> Option<Charge> {
        let gpu = self.gpu.filter(|_| params::accounting())?;
        Some(accounting::charge(self.pair, gpu, tgid, bytes))
    }
}

/// The PCI device whose memory BAR holds `phys`: its path up and the BAR's
/// first and last byte.
fn pci_gpu(phys: u64) -> Option<(ffi::PeermemChain, (u64, u64))> {
    let mut chain = ffi::PeermemChain::default();
    let (mut start, mut end) = (0u64, 0u64);
    (ffi::peermem_gpu_by_phys(phys, &mut chain, &mut start, &mut end) == 0)
        .then_some((chain, (start, end)))
}

/// Records the GPU that [`pci_gpu`] found; `None` when the table is full.
fn record_gpu((chain, (start, end)): &(ffi::PeermemChain, (u64, u64))) -> Option<Gpu> {
    accounting::add_gpu(chain.id, *start, *end)
}

/// The GPU whose BAR holds `phys`, recorded if new; `None` when it is no PCI
/// device's or the table is full.
fn gpu_of(phys: u64) -> Option<Gpu> {
    accounting::gpu_by_phys(phys).or_else(|| pci_gpu(phys).as_ref().and_then(record_gpu))
}

/// Learns the GPU driver's topology verdicts (fact 5) for the GPU whose BAR
/// holds `phys` once, from an invalidating `acquire` of `start`: there the
/// core holds no `mapping_lock` (facts 11-12), so the driver may be called.
// One call site (the invalidating `acquire`): inlined there.
pub(crate) fn learn_gate(start: u64, phys: u64) {
    if let Some(gpu) = gpu_of(phys).filter(|g| g.gate.is_none()) {
        probe_gate(start, gpu);
    }
}

/// Asks the GPU driver about one peer below a common bridge with `gpu` and
/// one not, through a persistent pin of the GPU page at `start`: a
/// non-persistent table could be freed by a free callback between two calls
/// of the driver (fact 2), and waiting for such a callback while it holds the
/// driver's lock would deadlock.
#[cold]
fn probe_gate(start: u64, gpu: Gpu) {
    let range = GpuRange {
        start,
        len: GPU_PAGE_SIZE,
    };
    // Only "not supported" is final (MIG, vGPU); anything else (the memory
    // freed meanwhile, no memory, no peer that answered) is asked again by
    // the next registrations, a few times.
    let last_try = accounting::gate_attempt(gpu) >= GATE_TRIES;
    let table = match p2p::get_pages_persistent(&range) {
        Ok(t) => t,
        Err(e) if e == compat::eopnotsupp() || last_try => {
            return accounting::set_gate(gpu, Verdict::Unverified, Verdict::Unverified);
        }
        Err(_) => return,
    };
    STATS.topology_probes.add(1, Relaxed);
    // SAFETY: pinned just above for `range`, unpinned only below.
    let near = unsafe { ask_gate(&table, &range, true) };
    // SAFETY: as above.
    let far = unsafe { ask_gate(&table, &range, false) };
    // SAFETY: a persistent pin of `range`, not unpinned before.
    if let Err(e) = unsafe { table.put_persistent(&range) } {
        STATS.leaked_pins.add(1, Relaxed);
        fail!(
            Cause::Unpin,
            e,
            "unpinning the topology probe at {start:#x} failed: the pin is lost, and keeps the GPU driver from unbinding the GPU"
        );
    }
    // Unknown: a peer was asked and failed otherwise; asked again later.
    if (far != Verdict::Unknown && near != Verdict::Unknown) || last_try {
        accounting::set_gate(gpu, near, far);
    }
}

/// How many registrations ask the GPU driver about a GPU before its
/// verdicts count as unverifiable.
const GATE_TRIES: u32 = 3;

/// The driver's verdict for the first of at most three candidate peers of
/// the right kind that it answers about: [`Verdict::Unverified`] when there
/// is no such peer, [`Verdict::Unknown`] when every one asked failed
/// otherwise.
///
/// # Safety
///
/// `table` must be a live persistent pin of `range`.
unsafe fn ask_gate(table: &p2p::PageTable, range: &GpuRange, near: bool) -> Verdict {
    // SAFETY: live (caller); the view does not outlive this line.
    let phys = unsafe { table.checked_pages(range) }.and_then(|p| p.physical_address(0));
    let Some(phys) = phys else {
        return Verdict::Unknown;
    };
    for i in 0..3 {
        // A reference on the device, locked, or NULL.
        let dev = ffi::peermem_gate_candidate(phys, near, i);
        if dev.is_null() {
            // No such peer to ask about: asking again would not help.
            return if i == 0 {
                Verdict::Unverified
            } else {
                Verdict::Unknown
            };
        }
        // SAFETY: a live persistent table (caller) and a referenced device.
        let verdict = match unsafe { table.dma_map(dev) } {
            Ok(m) => {
                // SAFETY: the mapping just made for `dev`; no callback exists.
                let _ = unsafe { table.dma_unmap(dev, m) };
                Verdict::Open
            }
            Err(e) if e == compat::eopnotsupp() => Verdict::Refused,
            Err(_) => Verdict::Unknown,
        };
        // SAFETY: the lock and the reference the helper took.
        unsafe { ffi::peermem_gate_candidate_put(dev) };
        if verdict != Verdict::Unknown {
            return verdict;
        }
    }
    Verdict::Unknown
}
