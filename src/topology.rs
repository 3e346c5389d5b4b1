// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Where a registration's DMA goes: the (GPU, peer) pair, its PCIe path class
//! (computed once per pair, logged once), the path policy, and the
//! explanation of the GPU driver's topology refusal.

use kernel::{
    bindings,
    prelude::*, //
};

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
        Platform,
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
/// The path is known whether or not the pair has a slot in the
/// accounting's table: a pair without one is classified at each
/// registration, and the path policy and the topology gate hold for it all
/// the same.
pub(crate) struct Route {
    gpu: Option<Gpu>,
    /// The bus address of the route's first page.
    phys: u64,
    /// The GPU's PCI address (0: not found).
    gpu_id: u32,
    peer: u32,
    /// The path, if the devices could be classified.
    path: Option<path::Path>,
    pair: Option<Pair>,
}

/// The device's way up as the shim gave it in `c`, its hops copied to `out`.
fn chain<'a>(c: &ffi::PeermemChain, out: &'a mut [Hop; 16]) -> Chain<'a> {
    let n = core::cmp::min(c.nhops as usize, out.len());
    for (o, h) in out.iter_mut().zip(c.hops.iter()).take(n) {
        *o = Hop {
            id: h.id,
            kind: match u32::from(h.kind) {
                bindings::PCI_EXP_TYPE_ROOT_PORT => HopKind::RootPort,
                bindings::PCI_EXP_TYPE_UPSTREAM => HopKind::SwitchUp,
                bindings::PCI_EXP_TYPE_DOWNSTREAM => HopKind::SwitchDown,
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
    let iommu = unsafe { ffi::peermem_chain_of(peer.dev(), &mut peer_chain) };
    let iommu = u32::try_from(iommu).ok()?.min(4);
    let (mut ga, mut pa) = ([Hop::default(); 16], [Hop::default(); 16]);
    let (a, b) = (chain(gpu_chain, &mut ga), chain(&peer_chain, &mut pa));
    Some((path::classify(&a, &b), iommu))
}

#[cold]
fn log_new_pair(gpu: u32, peer: u32, p: path::Path, iommu: u32) {
    let (gpu, peer, class) = (Bdf(gpu), Bdf(peer), p.class.name());
    let iommu = accounting::IOMMU_NAMES[iommu as usize];
    let (acs, or_acs) = match p.acs_redirect {
        true => (
            ", ACS redirects peer requests to the root complex",
            " or disable ACS redirection on its ports",
        ),
        false => ("", ""),
    };
    if p.class.through_root_complex() || p.acs_redirect {
        pr_warn!("GPU {gpu} and peer {peer}: path {class}{acs} (IOMMU: {iommu}): peer-to-peer traffic crosses the root complex; expect low bandwidth, or none on some platforms; put the HCA behind the GPU's PCIe switch{or_acs}\n");
    } else {
        pr_info!("GPU {gpu} and peer {peer}: path {class} (IOMMU: {iommu})\n");
    }
}

impl Route {
    /// The route of pages starting at bus address `phys` to `peer`: one look
    /// at the tables when its GPU and pair are known already.
    pub(crate) fn of(phys: u64, peer: &PeerDevice) -> Self {
        let peer_id = peer.id();
        match accounting::known_pair(phys, peer_id) {
            Some((gpu, pair, path)) => Self {
                gpu: Some(gpu),
                phys,
                gpu_id: gpu.rec.id,
                peer: peer_id,
                path: Some(path),
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
        Self {
            gpu,
            phys,
            gpu_id: found.map_or(gpu.map_or(0, |g| g.rec.id), |_| chain.id),
            peer: peer_id,
            path: path.map(|(p, _)| p),
            pair: path.and_then(|(p, iommu)| record_pair(chain.id, peer_id, p, iommu)),
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
        let level = params::policy_level();
        // A path that could not be classified passes only a policy that
        // allows every path.
        if level <= 0 || self.path.is_some_and(|p| (p.class as i32) <= level) {
            return Ok(());
        }
        Err(self.refused_by_policy(level))
    }

    #[cold]
    fn refused_by_policy(&self, level: i32) -> Error {
        self.count_failure(EPERM, true, None);
        let limit = Class::from_level(level as u32).map_or("?", Class::name);
        let class = self.path.map_or("not classifiable", |p| p.class.name());
        let (gpu, peer) = (Bdf(self.gpu_id), Bdf(self.peer));
        fail!(
            at self.at();
            Cause::PathPolicy,
            EPERM,
            "refused by path_policy={level}: the path between GPU {gpu} and peer {peer} is {class}, worse than {limit}"
        )
    }

    /// The GPU driver's topology gate (fact 5) for this route, which the
    /// invalidating client applies itself: it maps BAR pages without the
    /// driver, whose lock it must not take under the core's `mapping_lock`.
    /// A route whose path is not known counts as sharing no bridge.
    fn gate(&self) -> Gate {
        let shares_bridge = self.path.is_some_and(|p| p.shares_bridge);
        // A GPU without a record (its table full) is never asked.
        let Some(gpu) = self.gpu.map(|g| g.rec) else {
            let u = Verdict::Unverified;
            return path::gate(shares_bridge, u, u, platform(self.phys), false);
        };
        let (near, far) = gpu.gate;
        let v = if shares_bridge { near } else { far };
        if v == Verdict::Unknown && gpu.gate_err != 0 {
            return Gate::Pending;
        }
        let seen = if v == Verdict::Unknown {
            platform(self.phys)
        } else {
            gpu.platform
        };
        path::gate(shares_bridge, near, far, seen, params::unverified_allowed())
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
        let e = match g {
            // The question failed on the way: its error, not a verdict.
            Gate::Pending => match self.gpu.map_or(0, |g| g.rec.gate_err) {
                0 => EAGAIN,
                e => Error::from_errno(e),
            },
            _ => compat::eopnotsupp(),
        };
        self.count_failure(e, false, Some(g).filter(|g| *g != Gate::Pending));
        let why = match g {
            Gate::Refused => "the GPU driver refuses peer-to-peer DMA on this path",
            Gate::Observed => "the GPU driver's rule refuses this path here (flagged chipset, no common PCIe switch, or NVreg_GrdmaPciTopoCheckOverride=2); the driver could not be asked (MIG or vGPU)",
            _ => "asking the GPU driver about this path failed; asked again by a later registration",
        };
        let (gpu, peer) = (Bdf(self.gpu_id), Bdf(self.peer));
        fail!(
            at self.at();
            Cause::Topology,
            e,
            "refused by the topology gate: GPU {gpu} and peer {peer}: {why}"
        )
    }

    /// A registration on this route failed with `e`; explains a refusal by
    /// the GPU driver's topology check (`nvidia_p2p_dma_map_pages`, if
    /// `by_driver_map`) once per pair.
    #[cold]
    pub(crate) fn failed(&self, e: Error, by_driver_map: bool) {
        let refused = by_driver_map && e == compat::eopnotsupp();
        self.count_failure(e, false, refused.then_some(Gate::Refused));
    }

    /// Counts a failure with `e` on the route's pair (a refusal by the path
    /// policy if `policy`) and explains `refusal`, the GPU driver's
    /// topology check's (`Gate::Refused`) or its rule's on the platform
    /// observed (`Gate::Observed`), once per pair. A pair without a slot is
    /// explained by the once-per-cause line.
    fn count_failure(&self, e: Error, policy: bool, refusal: Option<Gate>) {
        let first = |p: Pair| p.failed(-e.to_errno(), policy, refusal.is_some());
        if !self.pair.is_some_and(first) {
            return;
        }
        let (why, ways) = match refusal {
            Some(Gate::Observed) => (
                "the GPU driver cannot be asked about this path (persistent pins refused, as under MIG or vGPU) and its topology rule (580+) refuses it on this platform (a flagged chipset without a common PCIe switch, or NVreg_GrdmaPciTopoCheckOverride=2)",
                "or load nvidia_peermem with allow_unverified_paths=1, if this platform forwards peer-to-peer traffic between them",
            ),
            _ => (
                "the GPU driver's topology check (580+) does not allow peer-to-peer DMA on this path (nvidia_p2p_dma_map_pages refuses it)",
                "move the HCA behind the GPU's PCIe switch, or disable ACS redirection",
            ),
        };
        let (gpu, peer) = (Bdf(self.gpu_id), Bdf(self.peer));
        let class = self.path.map_or("?", |p| p.class.name());
        pr_err!("GPU {gpu} and peer {peer} (path {class}): {why}, so nv_mem does not map it; set NVreg_GrdmaPciTopoCheckOverride=1 for nvidia.ko, {ways}\n");
    }

    /// Counts a mapped registration of `bytes`.
    pub(crate) fn charge(&self, bytes: u64) -> Option<Charge> {
        let gpu = self.gpu.filter(|_| params::accounting())?;
        accounting::charge(self.pair, gpu, bytes)
    }
}

/// Records the classified pair (`gpu`, `peer`), logged once; `None` when
/// the table is full.
fn record_pair(gpu: u32, peer: u32, p: path::Path, iommu: u32) -> Option<Pair> {
    let Some((pair, new)) = accounting::add_pair(gpu, peer, p, iommu) else {
        kernel::pr_warn_once!("the GPU/peer pair table is full: pairs without a slot are classified at each registration, and stats/paths does not show them\n");
        return None;
    };
    if new {
        log_new_pair(gpu, peer, p, iommu);
    }
    Some(pair)
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
pub(crate) fn gpu_of(phys: u64) -> Option<Gpu> {
    accounting::gpu_by_phys(phys).or_else(|| pci_gpu(phys).as_ref().and_then(record_gpu))
}

/// What the module observes of the platform the GPU driver's topology rule
/// reads, for the GPU whose BAR holds `phys` (the C shim: the hypervisor
/// and the root complexes of the GPU's PCI domain; the driver's override
/// read at load).
#[cold]
fn platform(phys: u64) -> Platform {
    let seen = ffi::peermem_platform(phys);
    Platform {
        over: params::driver_override(),
        passthrough: seen & ffi::PEERMEM_PASSTHROUGH != 0,
        flagged_chipset: seen & ffi::PEERMEM_FLAGGED_CHIPSET != 0,
    }
}

/// Learns the GPU driver's topology verdicts (fact 5) for the GPU whose BAR
/// holds `phys`, from an invalidating `acquire` of `start`: there the core
/// holds no `mapping_lock` (facts 11-12), so the driver may be called. Asks
/// until both are learnt; after failed questions, fewer registrations ask
/// (see `accounting::gate_learnt`).
// One call site (the invalidating `acquire`): inlined there.
pub(crate) fn learn_gate(start: u64, phys: u64) {
    if let Some(gpu) = gpu_of(phys)
        .filter(|g| g.rec.gate_unknown())
        .filter(|g| accounting::gate_due(*g))
    {
        ask_once(start, phys, gpu);
    }
}

/// Asks unless another registration did while this one waited: concurrent
/// first registrations wait for one answer instead of asking about the same
/// peers, whose locks they would find taken.
#[cold]
fn ask_once(start: u64, phys: u64, gpu: Gpu) {
    let _one = accounting::ASKING.lock();
    if let Some(gpu) = gpu_of(phys).filter(|g| g.rec.gate_asked == gpu.rec.gate_asked) {
        probe_gate(start, phys, gpu);
    }
}

/// Asks the GPU driver about one RDMA peer below a common bridge with `gpu`
/// and one not (the kinds not learnt yet), through a persistent pin of the
/// GPU page at `start`, made once a peer to ask about is found: a
/// non-persistent table could be freed by a free callback between two calls
/// of the driver (fact 2), and waiting for such a callback while it holds
/// the driver's lock would deadlock.
///
/// Only the driver's refusal of persistent pins (MIG, vGPU) is final (the
/// rule is then applied to the platform observed). No RDMA peer of a kind
/// yet, or a failure on the way (no BAR1 or memory at that moment, the
/// memory freed meanwhile, the peer's lock held), leaves the kind to be
/// asked again; a failure is reported to the registrations that need the
/// verdict meanwhile.
#[cold]
fn probe_gate(start: u64, phys: u64, gpu: Gpu) {
    let range = GpuRange {
        start,
        len: GPU_PAGE_SIZE,
    };
    let mut pin = None;
    let mut ask = |v: Verdict, near| match v {
        Verdict::Unknown => ask_gate(&mut pin, &range, phys, near),
        v => Ok(Some(v)),
    };
    let (near, far) = (ask(gpu.rec.gate.0, true), ask(gpu.rec.gate.1, false));
    if let Some(Ok(table)) = pin {
        STATS.topology_probes.add(1, Relaxed);
        // SAFETY: a persistent pin of `range`, not unpinned before.
        if let Err(e) = unsafe { table.put_persistent(&range) } {
            STATS.leaked_pins.add(1, Relaxed);
            fail!(
                Cause::Unpin,
                e,
                "unpinning the topology probe at {start:#x} failed: the pin is lost, and keeps the GPU driver from unbinding the GPU"
            );
        }
    }
    let (u, refused) = (Verdict::Unverified, compat::eopnotsupp().to_errno());
    // Asked again: after a failure (its errno), or for want of a peer (0).
    let again = match (near, far) {
        // Only the pin answers EOPNOTSUPP (a map's is a verdict): final.
        (Err(e), _) | (_, Err(e)) if e == refused => {
            return accounting::gate_learnt(gpu, u, u, Some(platform(phys)), None);
        }
        (Err(e), _) | (_, Err(e)) => Some(e),
        (Ok(None), _) | (_, Ok(None)) => Some(0),
        _ => None,
    };
    let v = |r: Result<Option<Verdict>, i32>| r.ok().flatten().unwrap_or(Verdict::Unknown);
    accounting::gate_learnt(gpu, v(near), v(far), None, again);
}

/// The driver's verdict for the first of at most three RDMA peers of the
/// right kind (`near`: below a common bridge with the GPU whose BAR holds
/// `phys`) that it answers about, asked with the persistent pin of `range`
/// in `pin` (made by the first question); `None` when there is no such
/// peer; the errno of the last failure (`EBUSY`: a peer's lock was held) or
/// of the pin when none answered.
fn ask_gate(
    pin: &mut Option<Result<p2p::PageTable, i32>>,
    range: &GpuRange,
    phys: u64,
    near: bool,
) -> Result<Option<Verdict>, i32> {
    let mut err = 0;
    for i in 0..3 {
        // A reference on the device, locked; NULL when there is none left,
        // with `busy` set if one was passed over for its lock being held.
        let mut busy = false;
        let dev = ffi::peermem_gate_candidate(phys, near, i, &mut busy);
        if dev.is_null() {
            return match (busy, err) {
                (true, _) => Err(EBUSY.to_errno()),
                (false, 0) => Ok(None),
                (false, e) => Err(e),
            };
        }
        let table =
            pin.get_or_insert_with(|| p2p::get_pages_persistent(range).map_err(|e| e.to_errno()));
        let answer = match table {
            // SAFETY: a live persistent pin (unpinned only by `probe_gate`,
            // after this) and a referenced device.
            Ok(t) => unsafe { verdict(t, dev) },
            Err(e) => Err(*e),
        };
        // SAFETY: the lock and the reference the helper took.
        unsafe { ffi::peermem_gate_candidate_put(dev) };
        match (answer, &pin) {
            (Ok(v), _) => return Ok(Some(v)),
            (Err(e), Some(Err(_))) => return Err(e),
            (Err(e), _) => err = e,
        }
    }
    Err(err)
}

/// The driver's verdict on mapping `table` for `dev`, or the errno of its
/// failure.
///
/// # Safety
///
/// `table` must be a live persistent pin and `dev` a referenced device.
unsafe fn verdict(table: &p2p::PageTable, dev: *mut bindings::pci_dev) -> Result<Verdict, i32> {
    // SAFETY: as promised by the caller.
    match unsafe { table.dma_map(dev) } {
        Ok(m) => {
            // SAFETY: the mapping just made for `dev`; no callback exists.
            let _ = unsafe { table.dma_unmap(dev, m) };
            Ok(Verdict::Open)
        }
        Err(e) if e == compat::eopnotsupp() => Ok(Verdict::Refused),
        Err(e) => Err(e.to_errno()),
    }
}
