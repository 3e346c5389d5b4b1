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
        match level {
            1 => Some(Class::Pix),
            2 => Some(Class::Pxb),
            3 => Some(Class::Phb),
            4 => Some(Class::Node),
            5 => Some(Class::Sys),
            _ => None,
        }
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
}

fn is_switch(h: &Hop) -> bool {
    matches!(h.kind, HopKind::SwitchUp | HopKind::Bridge)
}

/// Classifies the path between the devices `a` and `b`.
pub(crate) fn classify(a: &Chain<'_>, b: &Chain<'_>) -> Path {
    let all_acs = || a.hops.iter().chain(b.hops).any(|h| h.acs_redirect);
    if a.root != b.root {
        let class = if a.numa >= 0 && b.numa >= 0 && a.numa != b.numa {
            Class::Sys
        } else {
            Class::Node
        };
        return Path {
            class,
            acs_redirect: all_acs(),
        };
    }
    // The lowest bridge both hang below.
    let common = a
        .hops
        .iter()
        .enumerate()
        .find_map(|(i, h)| b.hops.iter().position(|g| g.id == h.id).map(|j| (i, j)));
    let Some((i, j)) = common else {
        // They meet at the host bridge itself.
        return Path {
            class: Class::Phb,
            acs_redirect: all_acs(),
        };
    };
    let below = || a.hops[..i].iter().chain(&b.hops[..j]);
    let acs_redirect = below().any(|h| h.acs_redirect);
    let top = a.hops[i];
    let class = if top.kind == HopKind::RootPort {
        Class::Phb
    } else {
        // Switches crossed: every switch entered below the meeting point,
        // plus the one they meet in.
        match below().filter(|h| is_switch(h)).count() + 1 {
            1 => Class::Pix,
            _ => Class::Pxb,
        }
    };
    Path {
        class,
        acs_redirect,
    }
}
