// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The PCIe path between a GPU and a peer device, classified in the
//! vocabulary users know from `nvidia-smi topo -m`.
//!
//! Plain Rust without kernel types: the module and the host test crate compile
//! this very file.

/// How far apart two PCI devices are, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Class {
    /// Behind one PCIe switch: peer traffic never leaves it.
    Pix = 1,
    /// Through several PCIe switches, without the host bridge.
    Pxb = 2,
    /// Through one host bridge (the CPU's root complex).
    Phb = 3,
    /// Across host bridges within one NUMA node.
    Node = 4,
    /// Across NUMA nodes (the SMP interconnect).
    Sys = 5,
}

impl Class {
    /// The name `nvidia-smi topo -m` uses.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Class::Pix => "PIX",
            Class::Pxb => "PXB",
            Class::Phb => "PHB",
            Class::Node => "NODE",
            Class::Sys => "SYS",
        }
    }

    /// The class of a stored level (1 = PIX ... 5 = SYS).
    pub(crate) fn from_level(level: u32) -> Option<Self> {
        [Class::Pix, Class::Pxb, Class::Phb, Class::Node, Class::Sys]
            .into_iter()
            .find(|c| *c as u32 == level)
    }

    /// Whether peer traffic crosses the root complex (worth a warning).
    pub(crate) fn through_root_complex(self) -> bool {
        self >= Class::Phb
    }
}

/// What a bridge above a device is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum HopKind {
    /// A PCI-to-PCI bridge that is none of the below.
    #[default]
    Bridge,
    /// A PCIe root port (part of the host bridge).
    RootPort,
    /// The upstream port of a PCIe switch.
    SwitchUp,
    /// A downstream port of a PCIe switch.
    SwitchDown,
}

/// One bridge above a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Hop {
    /// Its PCI address (domain << 16 | bus << 8 | devfn).
    pub(crate) id: u32,
    pub(crate) kind: HopKind,
    /// ACS P2P Request or Completion Redirect is on: peer requests go up to
    /// the root complex instead of across.
    pub(crate) acs_redirect: bool,
}

/// A device's way up to its host bridge.
pub(crate) struct Chain<'a> {
    /// Its host bridge (root bus).
    pub(crate) root: u32,
    /// Its NUMA node, or -1 if unknown.
    pub(crate) numa: i32,
    /// The bridges above it, nearest first.
    pub(crate) hops: &'a [Hop],
}

/// A classified path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Path {
    pub(crate) class: Class,
    /// A bridge on the path redirects peer requests (ACS).
    pub(crate) acs_redirect: bool,
    /// An upstream bridge sits above both devices: what the GPU driver's
    /// topology gate asks (`nv_pci_has_common_pci_switch`, nv-pci.c), which
    /// a root port above both answers too.
    pub(crate) shares_bridge: bool,
}

/// The path between devices with no bridge in common: through their host
/// bridge if they share it, else across host bridges on one NUMA node, or
/// not.
fn apart(a: &Chain<'_>, b: &Chain<'_>) -> Path {
    let class = if a.root == b.root {
        Class::Phb
    } else if a.numa >= 0 && b.numa >= 0 && a.numa != b.numa {
        Class::Sys
    } else {
        Class::Node
    };
    Path {
        class,
        acs_redirect: a.hops.iter().chain(b.hops).any(|h| h.acs_redirect),
        shares_bridge: false,
    }
}

/// Classifies the path between the devices `a` and `b`.
pub(crate) fn classify(a: &Chain<'_>, b: &Chain<'_>) -> Path {
    if a.root != b.root {
        return apart(a, b);
    }
    // The lowest bridge both hang below.
    let common = a
        .hops
        .iter()
        .enumerate()
        .find_map(|(i, h)| b.hops.iter().position(|g| g.id == h.id).map(|j| (i, j)));
    let Some((i, j)) = common else {
        // They meet at the host bridge itself.
        return apart(a, b);
    };
    let below = || a.hops[..i].iter().chain(&b.hops[..j]);
    let acs_redirect = below().any(|h| h.acs_redirect);
    let class = if a.hops[i].kind == HopKind::RootPort {
        Class::Phb
    } else if below().any(|h| matches!(h.kind, HopKind::SwitchUp | HopKind::Bridge)) {
        // Switches crossed: every switch entered below the meeting point,
        // plus the one they meet in; PIX is that one alone.
        Class::Pxb
    } else {
        Class::Pix
    };
    Path {
        class,
        acs_redirect,
        shares_bridge: true,
    }
}

/// What the GPU driver's topology gate (docs/driver-facts.md, fact 5)
/// answers for one kind of a GPU's peers, as this module learnt it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Not learnt yet: not asked, no RDMA peer of the kind to ask about
    /// yet, or the last question failed on the way (the caller's
    /// [`Gate::Pending`]). Until it is, the rule on the platform observed.
    #[default]
    Unknown = 0,
    /// The driver maps for such peers.
    Open = 1,
    /// The driver refuses them (`-ENOTSUPP`).
    Refused = 2,
    /// The driver cannot be asked (persistent pins refused, as under MIG or
    /// vGPU): the rule is applied to what the module observes of the
    /// platform.
    Unverified = 3,
}

/// What the driver's rule reads that is not the pair's own (fact 5,
/// `nv_grdma_pci_topology_supported`), as the module observes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Platform {
    /// `NVreg_GrdmaPciTopoCheckOverride`: 1 allows every peer, 2 refuses
    /// every peer, anything else leaves the decision to the rule.
    pub(crate) over: u32,
    /// The GPU is passed through to a virtual machine (RM's `IS_PASSTHRU`).
    pub(crate) passthrough: bool,
    /// The GPU's PCI domain holds a root complex RM flags as unable to
    /// forward peer-to-peer traffic (`NV_FLAG_PCI_P2P_UNSUPPORTED_CHIPSET`).
    pub(crate) flagged_chipset: bool,
}

impl Platform {
    /// The driver's rule for a non-coherent GPU (a coherent one skips it)
    /// and a peer that does (`shares_bridge`) or does not sit below an
    /// upstream bridge in common with it, in the driver's order.
    pub(crate) fn allows(self, shares_bridge: bool) -> bool {
        match self.over {
            1 => true,
            2 => false,
            _ => self.passthrough || !self.flagged_chipset || shares_bridge,
        }
    }
}

/// The topology gate as the invalidating client applies it for the GPU
/// driver, which it does not call while the core holds `mapping_lock`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    /// The driver would map for this peer.
    Open,
    /// The driver refuses this peer: it said so for a peer of this kind.
    Refused,
    /// The driver's rule refuses this peer on the platform observed (the
    /// driver could not be asked).
    Observed,
    /// The driver's verdict is not learnt yet and the last question failed
    /// on the way (asked again): the caller's, from the failure it knows.
    Pending,
}

/// The gate for a peer that does (`shares_bridge`) or does not sit below a
/// bridge in common with the GPU, given the driver's verdicts for the GPU's
/// peers of each kind (`near`, `far`) and the platform observed.
///
/// The driver decides per GPU and peer only through a common upstream bridge
/// (`nv_grdma_pci_topology_supported`, nv-pci.c: coherent platform, the
/// override, passthrough and the chipset flag are the GPU's; then
/// `nv_pci_has_common_pci_switch`), so one peer of each kind answers for
/// all. Where the driver has not answered (or cannot be asked), its rule is
/// applied to `platform`, unless `allow_unverified` (the operator's word)
/// maps whatever the rule says.
pub(crate) fn gate(
    shares_bridge: bool,
    near: Verdict,
    far: Verdict,
    platform: Platform,
    allow_unverified: bool,
) -> Gate {
    match if shares_bridge { near } else { far } {
        Verdict::Open => Gate::Open,
        Verdict::Refused => Gate::Refused,
        Verdict::Unverified | Verdict::Unknown if allow_unverified => Gate::Open,
        _ if platform.allows(shares_bridge) => Gate::Open,
        _ => Gate::Observed,
    }
}
