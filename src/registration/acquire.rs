// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `acquire`: the registration object and its pin.

use core::fmt;

use kernel::{
    new_spinlock,
    prelude::*,
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        Refcount,
    },
    types::Opaque,
};

use super::{
    refs::{
        Liveness,
        Spare, //
    },
    registry,
    revoke::free_trampoline,
    ArmedCallback, Inner, Mode, RegRef, Registration, Span, GRANULE,
};
use crate::{
    accounting::{
        self,
        Bar1,
        Bar1Charged, //
    },
    compat,
    lifecycle::{
        Lifecycle,
        Pin, //
    },
    p2p, params,
    range::GpuRange,
    sg::SgSlot,
    stats::{
        fail,
        reg_dbg,
        At,
        Cause,
        STATS, //
    },
    topology, waitq,
};

/// A registration's state at birth: its lifecycle and its pin's error.
type Born = (Lifecycle<super::Held>, Option<Error>);

/// A registration's object, born `born`.
fn object(
    mode: Mode,
    start: u64,
    granules: u32,
    live: Liveness,
    (lc, pin_error): Born,
) -> impl PinInit<Registration> {
    pin_init!(Registration {
        mode,
        start,
        granules,
        inner <- new_spinlock!(Inner {
            lc,
            pin_error,
            in_core: None,
            mapper: false,
            waiters: 0,
            charge: None,
            bar1: None,
        }, "Registration::inner"),
        sg_slot: SgSlot::new(),
        holds_map: Atomic::new(0),
        refs: Refcount::new(1),
        reap_link: Opaque::uninit(),
        link: Opaque::uninit(),
        _live: live,
    })
}

/// The user's range, widened to whole granules, and its length in granules.
fn widened(addr: u64, size: u64) -> Result<(GpuRange, u32)> {
    let refused = |why: fmt::Arguments<'_>| {
        fail!(
            Cause::BadRange,
            EINVAL,
            "refused range {addr:#x}+{size:#x}: {why}"
        )
    };
    let range = GpuRange::widen(addr, size, GRANULE).map_err(|e| {
        reg_dbg!("acquire {addr:#x}+{size:#x}: refused ({e:?})");
        refused(format_args!("{e:?}"))
    })?;
    // 2^32 granules are 256 TiB: more than any GPU has.
    let granules =
        u32::try_from(range.len / GRANULE).map_err(|_| refused(format_args!("too long")))?;
    Ok((range, granules))
}

impl Registration {
    /// `acquire`: claims `[addr, addr + size)` if the GPU driver owns it, by
    /// pinning it — the only ownership test the p2p API has, done once: the
    /// pin is kept for `get_pages`. Any error means "not mine".
    pub(crate) fn acquire(addr: u64, size: u64, mode: Mode) -> Result<RegRef> {
        let (range, granules) = widened(addr, size)?;
        // Registrations are made only while the module's wait queue exists
        // (their waits use it).
        waitq::queue().ok_or(ENODEV)?;
        let live = Liveness::new()?;
        // The memory first: nothing pinned has to be undone if it fails.
        let spare = Spare::new()?;
        let reg = match mode {
            Mode::Invalidating => {
                // Pinning starts before the object is shared (nobody else can
                // see it yet, so no lock is needed to move it there).
                let lc = (Lifecycle::pinning(), None);
                let reg = registry::add(spare.init(object(mode, range.start, granules, live, lc)));
                registry::admit()?;
                reg.pin_invalidating(&reg)?;
                reg
            }
            // A persistent pin has no free callback: nothing but this call
            // can touch it, so it is made before the object exists and
            // recorded without a lock.
            Mode::Persistent => {
                let lc = Self::pin_persistent(&range)?;
                let reg = registry::add(spare.init(object(mode, range.start, granules, live, lc)));
                if let Err(e) = registry::admit() {
                    // Unpinned as the core's release would, uncounted: the
                    // core never held it (`acquired` does not count it).
                    reg.undo();
                    return Err(e);
                }
                reg.charge_pin();
                reg
            }
        };
        // The core holds it from now until `release`; counted by the caller
        // (`acquired`; live registrations are `acquired - releases`).
        Ok(reg)
    }

    /// A persistent pin of `range`, as the lifecycle that holds it; or, for
    /// memory the GPU driver owns but cannot pin, an empty lifecycle and the
    /// error `get_pages` reports.
    fn pin_persistent(range: &GpuRange) -> Result<Born> {
        match p2p::get_pages_persistent(range) {
            Ok(table) => {
                STATS.pinned_bytes.add(range.len, Relaxed);
                let pin = Pin {
                    table,
                    token: None,
                    owner: compat::current_tgid(),
                };
                Ok((Lifecycle::with_pin(pin), None))
            }
            Err(e) => Ok((
                Lifecycle::new(),
                Some(Self::pin_refused(e, Mode::Persistent, range)?),
            )),
        }
    }

    /// Pins an invalidating registration (`this` is `self`'s reference) and,
    /// the first time for its GPU, learns the GPU driver's topology verdict.
    fn pin_invalidating(&self, this: &RegRef) -> Result {
        let range = self.range();
        if let Err(e) = self.pin(this) {
            let e = Self::pin_refused(e, Mode::Invalidating, &range)?;
            self.enter().pin_error = Some(e);
        } else if let Some(phys) = self.charge_pin() {
            // No core lock is held here but `peer_memory_mutex`.
            topology::learn_gate(range.start, phys);
        }
        Ok(())
    }

    /// Charges the pin to its GPU's BAR1 use (coherent memory is reached
    /// without BAR1); a pin the guard refuses is undone at once and
    /// `get_pages` reports `ENOMEM`. The BAR address of the pin's first
    /// page, if it is pinned and of a layout this module knows.
    fn charge_pin(&self) -> Option<u64> {
        let (phys, coherent) = self.first_phys()?;
        if coherent {
            return Some(phys);
        }
        let len = self.range().len;
        match bar1_at(phys, len) {
            Ok(None) => (),
            Ok(Some(b)) => {
                let mut g = self.enter();
                // Unless the free callback ended the pin meanwhile.
                if g.lc.pin_owner().is_some() {
                    g.bar1 = Some(b);
                } else {
                    drop(g);
                    b.release(len);
                }
            }
            Err(e) => {
                // Unpinned as the core's release would, uncounted.
                self.undo();
                self.enter().pin_error = Some(e);
            }
        }
        Some(phys)
    }

    /// The provider refused to pin `range` with `e`: `Err` when the range is
    /// not the GPU driver's to pin (not ours), else the error `get_pages`
    /// reports for memory that is the GPU driver's.
    fn pin_refused(e: Error, mode: Mode, range: &GpuRange) -> Result<Error> {
        reg_dbg!("acquire {}: declined ({e:?})", Span(*range));
        match e {
            // The GPU driver refuses persistent pins (MIG, vGPU): the memory
            // is its, so say why instead of the core's "Bad address".
            e if e == compat::eopnotsupp() && mode == Mode::Persistent => {
                kernel::pr_warn_once!("the GPU driver does not support persistent pins here (MIG or vGPU?): registrations fail with EOPNOTSUPP; load with persistent_api_support=0\n");
                Ok(e)
            }
            // Not GPU memory, or not this process's (or freed while
            // pinning): not ours.
            e if e == EINVAL || e == compat::eopnotsupp() || e == EFAULT => Err(e),
            // The GPU driver's memory, which it cannot pin now: ours, failing.
            e => Ok(e),
        }
    }

    /// Pins the range with a free callback; the lifecycle is in Pinning
    /// already (see `acquire`). The callback can run as soon as the provider
    /// armed it, so the outcome is recorded under the lock. `this` is
    /// `self`'s reference (the callback takes one of its own).
    fn pin(&self, this: &RegRef) -> Result {
        let owner = compat::current_tgid();
        let raw = this.clone().into_raw();
        // SAFETY: `free_trampoline` takes `raw`, a counted reference of its
        // own, back; it is sound from any sleepable context until the pin is
        // undone (it only revokes and hands the reference over).
        match unsafe { p2p::get_pages(&self.range(), free_trampoline, raw) } {
            Ok(table) => {
                let pin = Pin {
                    table,
                    // INVARIANT: the provider holds the reference taken above.
                    token: Some(ArmedCallback(())),
                    owner,
                };
                // Recorded unless the free callback came first: it already
                // ran and consumed the provider's reference, and the table is
                // the provider's to free; drop our handles only.
                let took = self.enter().lc.pin_succeeded(pin);
                took.map_err(|_| fail!(Cause::Revoked, EFAULT, "GPU memory freed while pinning"))?;
                STATS.pinned_bytes.add(self.range().len, Relaxed);
                Ok(())
            }
            Err(e) => {
                // SAFETY: the provider refused and did not keep the callback:
                // the reference taken above is ours again.
                drop(unsafe { RegRef::from_raw(raw) });
                self.enter().lc.pin_failed();
                Err(e)
            }
        }
    }

    /// The bus address of the pinned table's first page and whether it is
    /// coherent memory, if it is pinned and of a layout this module knows.
    fn first_phys(&self) -> Option<(u64, bool)> {
        let range = self.range();
        let g = self.enter();
        let t = g.lc.pinned_table().ok()?;
        // SAFETY: Pinned, so the table is ours; a free callback (a
        // persistent pin has none) takes this lock before it revokes, and the
        // provider frees the table only after the callback returns (fact 2):
        // valid while the lock is held. The view does not outlive the lock's
        // section.
        let view = unsafe { t.checked_pages(&range) }?;
        Some((view.physical_address(0)?, view.coherent()))
    }
}

/// Charges `len` bytes pinned at BAR address `phys` to its GPU's BAR1 use
/// (recording the GPU if it is new): `ENOMEM` past `bar1_limit_pct`.
fn bar1_at(phys: u64, len: u64) -> Result<Option<Bar1>> {
    let pct = params::bar1_limit_pct();
    for _ in 0..2 {
        match accounting::bar1_charge(phys, len, pct) {
            Bar1Charged::Yes(b) => return Ok(Some(b)),
            Bar1Charged::Refused(r) => {
                return Err(fail!(at At { gpu: r.gpu, hca: 0 }; Cause::Bar1, ENOMEM,
                    "the pin of {len} bytes would take the GPU's BAR1 use to {} of {} bytes, past bar1_limit_pct={pct} ({} bytes); deregister memory or raise bar1_limit_pct",
                    r.use_after, r.size, r.limit))
            }
            // Recorded now (none: no PCI device's BAR, or the table is
            // full: not counted).
            Bar1Charged::UnknownGpu if topology::gpu_of(phys).is_some() => (),
            Bar1Charged::UnknownGpu => return Ok(None),
        }
    }
    Ok(None)
}
