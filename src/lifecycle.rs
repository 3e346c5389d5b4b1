// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The life of one registration, as a state machine without kernel types.
//!
//! The peer-memory core calls `get_pages`, `dma_map`, `dma_unmap`, `put_pages`
//! and `release` one at a time for a registration; the GPU driver's free
//! callback can come at any moment in between, from another thread. Every
//! decision about what the client may still touch is taken here, under the
//! registration's lock, and the provider is called only after the lock is
//! dropped.
//!
//! Each phase holds exactly the objects it owns (the table of
//! [`Lifecycle`]'s invariants): the pin (page table and, for a non-persistent
//! pin, the token of the reference the GPU driver holds for its free
//! callback), the core's id once `get_pages` published it, and the client's
//! DMA mapping once `dma_map` made it. A call takes what it must undo out of
//! the lifecycle (`Option::take`, so at most once) as it leaves the phases
//! that hold it, and hands it to the caller, so "the table is used only while
//! pinned" and "the callback's reference is reclaimed at most once, and only
//! when the callback can no longer run" hold; `Lifecycle::consistent`
//! checks the table after every call in the KUnit suites, the proptest model
//! and the loom model.
//!
//! The module and the host model checker (loom, proptest) compile this very
//! file, with kernel objects or with plain markers as the resources.

// What only the KUnit suites and the host model checker use: the phase, the
// invariant's check, and the step the module folds into `pinning`.
#[cfg(any(test, CONFIG_KUNIT = "y"))]
#[path = "lifecycle/check.rs"]
mod check;

/// How a registration's pages are pinned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `nvidia_p2p_get_pages_persistent`: no free callback.
    Persistent,
    /// `nvidia_p2p_get_pages` with a free callback that revokes through the
    /// core's invalidate hook.
    Invalidating,
}

/// The objects a registration owns at some point of its life.
pub(crate) trait Resources {
    /// A page table the GPU driver pinned for us.
    type Table;
    /// The reference on the registration that the GPU driver holds while the
    /// free callback of a non-persistent pin is armed. Dropping a token leaves
    /// the reference with the driver (the callback consumes it).
    type Token;
    /// A DMA mapping made for the device, with its scatterlist: undone by the
    /// client, never by the GPU driver's callback.
    type Map;
}

/// A pin: the page table, the armed callback's token (`None` for a persistent
/// pin) and the process that pinned it (the GPU driver finds a
/// non-persistent pin by the caller's process).
pub(crate) struct Pin<R: Resources> {
    pub(crate) table: R::Table,
    pub(crate) token: Option<R::Token>,
    pub(crate) owner: u32,
}

/// Where a registration is in its life (a tag, for logs and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// `acquire` claimed the range; nothing pinned.
    Acquired,
    /// The provider is pinning the range.
    Pinning,
    /// Pinned; `get_pages` has not accepted the table yet.
    Pinned,
    /// `get_pages` refused the provider's table: only `release` may follow.
    Unusable,
    /// `get_pages` accepted the table and published the core's id.
    Bound,
    /// The client is DMA-mapping the pages.
    Mapping,
    /// Pinned and DMA-mapped; the core holds the scatterlist.
    Mapped,
    /// The GPU driver revoked the pages: its page table is gone (or will be as
    /// soon as the free callback returns).
    Revoked,
    /// The module's drain revoked the registration through the core: the
    /// device's access ended, but the pin stays until `release` (in the
    /// pinning process) or the free callback ends it, as the GPU driver
    /// undoes a non-persistent pin only there (fact 7).
    Drained,
    /// `release` is unpinning a non-persistent pin at the provider.
    Unpinning,
    /// The provider failed to unpin: the pin and its callback stay armed
    /// until the GPU driver frees the memory.
    Stranded,
    /// Released in a process that cannot unpin (not the pinning one): the pin
    /// stays until the GPU driver frees the memory and calls back.
    Orphaned,
    /// Nothing of the provider's is held any more; nothing may follow.
    Released,
}

/// A core call that is not legal in the current phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The GPU driver revoked the pages before the call.
    Revoked,
    /// The call is not legal in this phase (a core bug or a replayed call).
    Forbidden(Phase),
}

/// What the free callback must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Invalidate {
    /// Ask the core to revoke the registration it knows by this id, then
    /// undo the client's own mapping if the core left it.
    NotifyCore(u64),
    /// The core does not know the registration yet, or is tearing it down.
    Quiet,
    /// The callback ended a pin that `release` could not undo: stranded by a
    /// failed unpin, or `orphaned` by a release in another process. The
    /// registration's last provider-side object is gone.
    Reaped {
        /// Orphaned (else stranded).
        orphaned: bool,
    },
}

/// What `release` leaves the caller to do, outside the lock.
pub(crate) struct Release<R: Resources> {
    /// Undo this mapping first.
    pub(crate) map: Option<R::Map>,
    /// Then unpin this table at the provider and report with
    /// [`Lifecycle::unpinned`].
    pub(crate) unpin: Option<R::Table>,
    /// The registration was released in another process than the pinning
    /// one: its pin stays with the GPU driver until the free callback.
    pub(crate) orphaned: bool,
    /// The lifecycle ended here: the pin to undo is persistent, so no free
    /// callback can race its unpin and nothing is left to decide after it
    /// (the caller does not report it with [`Lifecycle::unpinned`]).
    pub(crate) ended: bool,
}

impl<R: Resources> Default for Release<R> {
    fn default() -> Self {
        Self {
            map: None,
            unpin: None,
            orphaned: false,
            ended: false,
        }
    }
}

/// How the unpin of a non-persistent pin ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unpinned {
    /// Unpinned, and the callback had not run: the token is reclaimed.
    Reclaim,
    /// The callback ran first and consumed its reference: nothing to reclaim.
    Raced,
    /// The unpin failed and the callback is still armed: the pin is stranded
    /// until the GPU driver frees the memory.
    Stranded,
}

/// The state machine of one registration.
///
/// The phase is a tag; the objects sit beside it, each in its own field, so
/// that a transition writes the tag and moves only the object it hands out
/// or takes in (a state enum carrying them would move all of them on every
/// transition).
///
/// # Invariants
///
/// Which objects the lifecycle holds is a function of its phase (a pin's
/// token is held when the pin has one, i.e. it is not persistent):
///
/// | phase                       | table | token     | core id | map   |
/// |-----------------------------|-------|-----------|---------|-------|
/// | Acquired, Pinning, Released | –     | –         | –       | –     |
/// | Unpinning                   | –     | maybe     | –       | –     |
/// | Pinned, Unusable            | yes   | the pin's | –       | –     |
/// | Bound, Mapping              | yes   | the pin's | yes     | –     |
/// | Mapped                      | yes   | the pin's | yes     | yes   |
/// | Revoked                     | –     | –         | –       | maybe |
/// | Drained                     | yes   | yes       | yes     | maybe |
/// | Stranded                    | –     | yes       | –       | –     |
/// | Orphaned                    | yes   | yes       | –       | –     |
///
/// Every provider object of the registration is owned by exactly one place:
/// these fields, or the caller a transition handed it to. A token leaves
/// the lifecycle only to be reclaimed after an unpin the callback did not
/// race, or to be dropped when the callback consumes its reference.
/// `Lifecycle::consistent` checks the table (the KUnit suites and the host
/// model checker call it after every transition).
pub(crate) struct Lifecycle<R: Resources> {
    phase: Phase,
    /// The armed callback's reference (see the table above).
    token: Option<R::Token>,
    /// The process that pinned, while the table is held.
    owner: u32,
    /// The core's id of the registration, from Bound to Mapped.
    core: u64,
    table: Option<R::Table>,
    map: Option<R::Map>,
}

impl<R: Resources> Lifecycle<R> {
    const fn empty(phase: Phase) -> Self {
        Self {
            phase,
            token: None,
            owner: 0,
            core: 0,
            table: None,
            map: None,
        }
    }

    /// A freshly acquired registration.
    pub(crate) const fn new() -> Self {
        Self::empty(Phase::Acquired)
    }

    /// A fresh registration about to pin once it is shared (the same as
    /// [`Lifecycle::new`] then `start_pin`).
    pub(crate) const fn pinning() -> Self {
        Self::empty(Phase::Pinning)
    }

    /// A registration pinned before it was shared: a persistent pin, which
    /// no free callback can reach, made before the object that holds this
    /// lifecycle (the same as `Lifecycle::start_pin` then
    /// [`Lifecycle::pin_succeeded`] on a fresh one).
    pub(crate) fn with_pin(pin: Pin<R>) -> Self {
        let mut lc = Self::empty(Phase::Pinned);
        lc.hold(pin);
        lc
    }

    /// Takes `pin` in (the phase is the caller's to set).
    fn hold(&mut self, pin: Pin<R>) {
        self.table = Some(pin.table);
        self.token = pin.token;
        self.owner = pin.owner;
    }

    fn refuse(&self) -> Refusal {
        match self.phase {
            // Orphaned: also where OFED 4.x released a registration being
            // made from inside the drain's invalidate.
            Phase::Revoked | Phase::Drained | Phase::Orphaned => Refusal::Revoked,
            p => Refusal::Forbidden(p),
        }
    }

    /// Moves from `from` to `to`, or refuses.
    fn step(&mut self, from: Phase, to: Phase) -> Result<(), Refusal> {
        if self.phase != from {
            return Err(self.refuse());
        }
        self.phase = to;
        Ok(())
    }

    /// The provider refused to pin.
    pub(crate) fn pin_failed(&mut self) {
        let _ = self.step(Phase::Pinning, Phase::Acquired);
    }

    /// The provider pinned the range. If its free callback fired meanwhile,
    /// the pin is handed back: its table is the provider's to free and its
    /// token was consumed by the callback; the caller must fail.
    pub(crate) fn pin_succeeded(&mut self, pin: Pin<R>) -> Result<(), Pin<R>> {
        if self.step(Phase::Pinning, Phase::Pinned).is_err() {
            return Err(pin);
        }
        self.hold(pin);
        Ok(())
    }

    /// The pinned table, for `get_pages` to check; the state stays Pinned.
    pub(crate) fn pinned_table(&self) -> Result<&R::Table, Refusal> {
        match (self.phase, &self.table) {
            (Phase::Pinned, Some(t)) => Ok(t),
            _ => Err(self.refuse()),
        }
    }

    /// `get_pages` accepted the table: the core knows the registration as
    /// `core_context` from now on.
    pub(crate) fn bind(&mut self, core_context: u64) -> Result<(), Refusal> {
        self.step(Phase::Pinned, Phase::Bound)?;
        self.core = core_context;
        Ok(())
    }

    /// `get_pages` refused the table: nothing but `release` may use the pin.
    pub(crate) fn reject(&mut self) {
        let _ = self.step(Phase::Pinned, Phase::Unusable);
    }

    /// `dma_map` is about to map: legal only once `get_pages` published the
    /// core's id (so a free callback now waits for the core, which holds its
    /// mapping lock across `dma_map`). Returns the table to map.
    pub(crate) fn start_map(&mut self) -> Result<&R::Table, Refusal> {
        match (self.phase, &self.table) {
            (Phase::Bound, Some(t)) => {
                self.phase = Phase::Mapping;
                Ok(t)
            }
            _ => Err(self.refuse()),
        }
    }

    /// Mapping failed; the caller undid its partial mapping.
    pub(crate) fn map_failed(&mut self) {
        let _ = self.step(Phase::Mapping, Phase::Bound);
    }

    /// The pages are mapped. If the callback fired meanwhile the mapping is
    /// handed back for the caller to undo, and the call must fail.
    pub(crate) fn map_succeeded(&mut self, map: R::Map) -> Result<(), R::Map> {
        if self.step(Phase::Mapping, Phase::Mapped).is_err() {
            return Err(map);
        }
        self.map = Some(map);
        Ok(())
    }

    /// `dma_unmap`: idempotent. Hands back the mapping to undo, also after a
    /// revoke (it is the client's own, never the provider's).
    pub(crate) fn unmap(&mut self) -> Option<R::Map> {
        match self.phase {
            Phase::Mapped => self.phase = Phase::Bound,
            Phase::Revoked | Phase::Drained => (),
            _ => return None,
        }
        self.map.take()
    }

    /// `put_pages`: the same as [`Lifecycle::unmap`]; the unpin itself waits
    /// for `release`. The core may call `put_pages` with the registration's
    /// mapping lock held (legacy cores from their invalidate, every core when
    /// unwinding a failed `dma_map`) while the GPU driver holds its own lock
    /// around the free callback, which waits for that mapping lock:
    /// unpinning there would invert the two (MLNX_OFED bug 2696789).
    /// `release` never runs under the mapping lock.
    pub(crate) fn put_pages(&mut self) -> Option<R::Map> {
        self.unmap()
    }
}

/// The calls that end a registration: the free callback, `release` and the
/// unpin's outcome.
impl<R: Resources> Lifecycle<R> {
    /// The GPU driver's free callback. The callback consumes its own
    /// reference: every token still held is dropped here, never reclaimed.
    /// Returns what to do and the pin's table, which the provider frees as
    /// soon as the callback returns (the caller only drops the handle).
    pub(crate) fn invalidate(&mut self) -> (Invalidate, Option<R::Table>) {
        let action = match self.phase {
            Phase::Pinning | Phase::Pinned | Phase::Unusable => Invalidate::Quiet,
            // Drained: the core is told again (it may have had nothing to
            // revoke yet when the drain told it; a second revoke is a no-op).
            Phase::Bound | Phase::Mapping | Phase::Mapped | Phase::Drained => {
                Invalidate::NotifyCore(self.core)
            }
            // The unpin raced with us: it must not reclaim the token.
            Phase::Unpinning => {
                self.token = None;
                return (Invalidate::Quiet, None);
            }
            Phase::Stranded => Invalidate::Reaped { orphaned: false },
            Phase::Orphaned => Invalidate::Reaped { orphaned: true },
            Phase::Acquired | Phase::Revoked | Phase::Released => return (Invalidate::Quiet, None),
        };
        // The client's mapping stays (Mapped → Revoked) for the core to
        // unmap; the pin ends.
        self.phase = match action {
            Invalidate::Reaped { .. } => Phase::Released,
            _ => Phase::Revoked,
        };
        self.token = None;
        self.core = 0;
        (action, self.table.take())
    }

    /// The module's drain: a registration the core knows, pinned with a free
    /// callback, is to be revoked through the core as the callback would
    /// (returns the core's id; a `dma_map` in progress then fails), but its
    /// pin stays: only `release` in the pinning process or the callback can
    /// end it. `None`: nothing to revoke (persistent, not bound yet, or
    /// ended).
    pub(crate) fn drain(&mut self) -> Option<u64> {
        match self.phase {
            Phase::Bound | Phase::Mapping | Phase::Mapped if self.token.is_some() => {
                self.phase = Phase::Drained;
                Some(self.core)
            }
            _ => None,
        }
    }

    /// The process that pinned, while the pin is usable.
    pub(crate) fn owner(&self) -> Option<u32> {
        match self.phase {
            Phase::Pinned
            | Phase::Unusable
            | Phase::Bound
            | Phase::Mapping
            | Phase::Mapped
            | Phase::Drained => Some(self.owner),
            _ => None,
        }
    }

    /// The process that pinned, while the pin lives (usable, drained, being
    /// undone, or kept for the free callback).
    pub(crate) fn pin_owner(&self) -> Option<u32> {
        (self.table.is_some() || self.token.is_some()).then_some(self.owner)
    }

    /// The mapping the core holds, while mapped.
    pub(crate) fn map(&self) -> Option<&R::Map> {
        match self.phase {
            Phase::Mapped => self.map.as_ref(),
            _ => None,
        }
    }

    /// After the core's invalidate returned: the client's mapping, left in
    /// place (the core may still read its scatterlist until it unmaps or
    /// releases), for the caller to undo the device's access.
    pub(crate) fn revoked_map_mut(&mut self) -> Option<&mut R::Map> {
        match self.phase {
            Phase::Revoked | Phase::Drained => self.map.as_mut(),
            _ => None,
        }
    }

    /// `release`, called by `tgid`: undo whatever the core left, unpin if
    /// this process may, and end.
    pub(crate) fn release(&mut self, tgid: u32) -> Release<R> {
        match self.phase {
            Phase::Pinned | Phase::Unusable | Phase::Bound | Phase::Mapped | Phase::Drained => {
                self.release_pin(tgid)
            }
            Phase::Revoked => {
                self.phase = Phase::Released;
                Release {
                    map: self.map.take(),
                    ..Release::default()
                }
            }
            Phase::Acquired => {
                self.phase = Phase::Released;
                Release::default()
            }
            // The core never releases in the middle of its own call, and
            // nothing is left to release in the other phases.
            _ => Release::default(),
        }
    }

    /// `release` of a registration that holds its pin.
    fn release_pin(&mut self, tgid: u32) -> Release<R> {
        self.core = 0;
        let map = self.map.take();
        if self.token.is_none() {
            // A persistent pin has no callback, and any process may unpin
            // it: nothing can race the unpin, and its outcome changes
            // nothing here. The lifecycle ends now, with one lock section.
            self.phase = Phase::Released;
            return Release {
                map,
                unpin: self.table.take(),
                ended: true,
                ..Release::default()
            };
        }
        if self.owner != tgid {
            // The GPU driver looks a non-persistent pin up by the caller's
            // process: from another one its unpin "succeeds" and does nothing
            // (docs/driver-facts.md, fact 7). Leave the pin and the token
            // to the callback.
            self.phase = Phase::Orphaned;
            return Release {
                map,
                orphaned: true,
                ..Release::default()
            };
        }
        self.phase = Phase::Unpinning;
        Release {
            map,
            unpin: self.table.take(),
            ..Release::default()
        }
    }

    /// The provider's unpin of a non-persistent pin returned (`ok`: it said
    /// so). Returns the token to reclaim, only when the unpin succeeded and
    /// the callback did not run.
    pub(crate) fn unpinned(&mut self, ok: bool) -> (Unpinned, Option<R::Token>) {
        if self.phase != Phase::Unpinning {
            return (Unpinned::Raced, None);
        }
        match self.token {
            None => {
                self.phase = Phase::Released;
                (Unpinned::Raced, None)
            }
            // A failed unpin leaves the callback armed (fact 8): keep its
            // reference where it is; the callback ends the pin later.
            Some(_) if !ok => {
                self.phase = Phase::Stranded;
                (Unpinned::Stranded, None)
            }
            Some(_) => {
                self.phase = Phase::Released;
                (Unpinned::Reclaim, self.token.take())
            }
        }
    }
}
