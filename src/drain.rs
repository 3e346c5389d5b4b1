// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The drain (`/sys/module/nvidia_peermem/drain`, root only): lets an
//! operator restart the RDMA stack or the GPU driver under a loaded module.
//!
//! Writing 1 refuses new registrations (one line each), revokes every live
//! invalidating registration through the core as a free callback would (the
//! device's access ends at once; the pin stays until the pinning process
//! deregisters or frees the memory, as the GPU driver undoes it only there,
//! fact 7), and names in the log the processes still holding GPU memory:
//! persistent registrations, which nothing can revoke, and those pins. Once
//! no registration lives the module unregisters its clients and lets go of
//! the core's and the GPU driver's modules (`binding::finish_drain`); when
//! one of them is loaded again, or on writing 0, it binds and registers
//! again.

use kernel::{
    ffi::c_int,
    prelude::*, //
};

use crate::{
    binding, compat,
    registration::{
        registry,
        Mode,
        RegRef, //
    },
};

/// At most this many processes are named, one line each.
const NAMED: usize = 16;

/// What one process holds: persistent registrations, and pins of
/// invalidating ones (revoked or not), with their bytes.
#[derive(Clone, Copy, Default)]
pub(crate) struct Held {
    pub(crate) tgid: u32,
    pub(crate) persistent: (u32, u64),
    pub(crate) pins: (u32, u64),
}

/// The holders of `regs`, by process, in the order first found.
pub(crate) fn holders(regs: &[RegRef]) -> Result<KVec<Held>> {
    let mut out: KVec<Held> = KVec::new();
    for (tgid, mode, bytes) in regs.iter().filter_map(|r| r.holder()) {
        let i = match out.iter().position(|h| h.tgid == tgid) {
            Some(i) => i,
            None => {
                out.push(
                    Held {
                        tgid,
                        ..Held::default()
                    },
                    GFP_KERNEL,
                )?;
                out.len() - 1
            }
        };
        let slot = match mode {
            Mode::Persistent => &mut out[i].persistent,
            Mode::Invalidating => &mut out[i].pins,
        };
        *slot = (slot.0 + 1, slot.1 + bytes);
    }
    Ok(out)
}

/// One line per holder (at most [`NAMED`]).
fn name_holders(held: &[Held]) {
    for h in held.iter().take(NAMED) {
        let who = compat::Process(h.tgid);
        if h.persistent.0 > 0 {
            pr_warn!(
                "drain: process {who} holds {} persistent registrations ({} bytes), which cannot be revoked: the drain completes when it deregisters them or exits\n",
                h.persistent.0,
                h.persistent.1
            );
        }
        if h.pins.0 > 0 {
            pr_warn!(
                "drain: process {who} holds {} pins of GPU memory ({} bytes), revoked for the device: the drain completes when it deregisters, frees the memory or exits\n",
                h.pins.0,
                h.pins.1
            );
        }
    }
    if held.len() > NAMED {
        pr_warn!("drain: and {} more processes\n", held.len() - NAMED);
    }
}

/// `drain` = 1.
fn start() -> Result {
    let again = binding::start_drain();
    let regs = registry::live()?;
    let revoked = regs.iter().filter(|r| r.drain()).count();
    let held = holders(&regs)?;
    // The references go before the drain may complete.
    drop(regs);
    let again = if again { " (again)" } else { "" };
    pr_info!(
        "drain{again}: new registrations are refused; {revoked} revoked through the core; {} processes hold GPU memory\n",
        held.len()
    );
    name_holders(&held);
    binding::finish_drain();
    Ok(())
}

/// Whether a drain is requested (`drain` reads 1).
#[no_mangle]
extern "C" fn peermem_drain_requested() -> bool {
    registry::draining()
}

/// A write to `drain`: 1 drains, 0 resumes. 0 or an errno.
#[no_mangle]
extern "C" fn peermem_drain_set(on: bool) -> c_int {
    if !on {
        binding::end_drain();
        return 0;
    }
    start().map_or_else(|e| e.to_errno(), |()| 0)
}

/// The drain's work: the last registration went (`registry::remove`).
#[no_mangle]
extern "C" fn peermem_drain_run() {
    binding::finish_drain();
}
