// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The life of one registration, as a state machine without kernel types.
//!
//! The peer-memory core calls `get_pages`, `dma_map`, `dma_unmap`, `put_pages`
//! and `release` one at a time for a registration; the GPU driver's free
//! callback can come at any moment in between, from another thread. Every
//! decision about what the client may still touch is taken here, under the
//! registration's lock, and the provider is called only after the lock is
//! dropped. The module and the host model checker compile this very file.

/// Where a registration is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// `acquire` claimed the range; nothing pinned.
    Acquired,
    /// The provider is pinning the range.
    Pinning,
    /// Pinned; not (or no longer) DMA-mapped.
    Pinned,
    /// The provider is DMA-mapping the pages.
    Mapping,
    /// Pinned and DMA-mapped; the core owns a scatterlist of ours.
    Mapped,
    /// The GPU driver revoked the pages: its page table and DMA mappings are
    /// gone (or will be as soon as the free callback returns).
    Revoked,
    /// The client unpinned the pages.
    Unpinned,
    /// `release` ran; nothing may follow.
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

/// What the caller must undo after a successful pin or map that lost the race
/// against the free callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The step took effect.
    Done,
    /// The free callback fired meanwhile: the provider objects are the GPU
    /// driver's to free; the caller must not touch them and must fail the call.
    Revoked,
}

/// Teardown work decided under the lock, carried out after it is dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Teardown {
    /// Free the scatterlist the client built.
    pub(crate) free_sg: bool,
    /// Undo the provider's DMA mapping (`nvidia_p2p_dma_unmap_pages`).
    pub(crate) unmap_provider: bool,
    /// Unpin at the provider (`nvidia_p2p_put_pages[_persistent]`).
    pub(crate) unpin_provider: bool,
}

/// What the free callback must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Invalidate {
    /// Ask the core to revoke the registration (call its invalidate hook).
    NotifyCore,
    /// Nothing to tell the core: it is already tearing the registration down.
    Quiet,
}

/// The state machine of one registration.
///
/// # Invariants
///
/// - `callback_armed` is true only in invalidating mode, from a successful pin
///   until the free callback fires or the unpin path reclaims the callback's
///   reference, whichever comes first.
/// - `sg_owned` is true only while the client owns a scatterlist it built.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    phase: Phase,
    invalidating: bool,
    callback_armed: bool,
    callback_fired: bool,
    sg_owned: bool,
}

impl Lifecycle {
    /// A freshly acquired registration; `invalidating` when the provider gets
    /// a free callback (non-persistent pinning).
    pub(crate) const fn new(invalidating: bool) -> Self {
        Self {
            phase: Phase::Acquired,
            invalidating,
            callback_armed: false,
            callback_fired: false,
            sg_owned: false,
        }
    }

    /// The current phase.
    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether the free callback has fired.
    #[allow(dead_code)] // Used by the KUnit suites and the host model checker.
    pub(crate) fn callback_fired(&self) -> bool {
        self.callback_fired
    }

    /// Whether the provider still holds the callback's reference.
    #[allow(dead_code)] // Used by the KUnit suites and the host model checker.
    pub(crate) fn callback_armed(&self) -> bool {
        self.callback_armed
    }

    /// Whether the client owns a scatterlist.
    #[allow(dead_code)] // Used by the KUnit suites and the host model checker.
    pub(crate) fn sg_owned(&self) -> bool {
        self.sg_owned
    }

    fn refuse(&self) -> Refusal {
        match self.phase {
            Phase::Revoked => Refusal::Revoked,
            p => Refusal::Forbidden(p),
        }
    }

    /// `get_pages` is about to pin.
    pub(crate) fn start_pin(&mut self) -> Result<(), Refusal> {
        match self.phase {
            Phase::Acquired => {
                self.phase = Phase::Pinning;
                Ok(())
            }
            _ => Err(self.refuse()),
        }
    }

    /// The provider refused to pin.
    pub(crate) fn pin_failed(&mut self) {
        if self.phase == Phase::Pinning {
            self.phase = Phase::Acquired;
        }
    }

    /// The provider pinned the range.
    pub(crate) fn pin_succeeded(&mut self) -> Outcome {
        match self.phase {
            Phase::Pinning => {
                self.phase = Phase::Pinned;
                // INVARIANT: armed only in invalidating mode, from here on.
                self.callback_armed = self.invalidating;
                Outcome::Done
            }
            _ => Outcome::Revoked,
        }
    }

    /// `dma_map` is about to map.
    pub(crate) fn start_map(&mut self) -> Result<(), Refusal> {
        match self.phase {
            Phase::Pinned => {
                self.phase = Phase::Mapping;
                Ok(())
            }
            _ => Err(self.refuse()),
        }
    }

    /// Mapping failed; the provider mapping (if any) was undone by the caller.
    pub(crate) fn map_failed(&mut self) {
        if self.phase == Phase::Mapping {
            self.phase = Phase::Pinned;
        }
    }

    /// The pages are mapped and the scatterlist is built.
    pub(crate) fn map_succeeded(&mut self) -> Outcome {
        match self.phase {
            Phase::Mapping => {
                self.phase = Phase::Mapped;
                // INVARIANT: the caller hands its scatterlist over to us.
                self.sg_owned = true;
                Outcome::Done
            }
            _ => Outcome::Revoked,
        }
    }

    fn take_sg(&mut self) -> bool {
        core::mem::replace(&mut self.sg_owned, false)
    }

    /// `dma_unmap`: idempotent; never touches provider objects after a revoke.
    pub(crate) fn unmap(&mut self) -> Teardown {
        match self.phase {
            Phase::Mapped => {
                self.phase = Phase::Pinned;
                Teardown {
                    free_sg: self.take_sg(),
                    // A non-persistent mapping is torn down by the provider's
                    // unpin, which (unlike its unmap) is safe against a free
                    // callback racing with us.
                    unmap_provider: !self.invalidating,
                    unpin_provider: false,
                }
            }
            Phase::Revoked => Teardown {
                free_sg: self.take_sg(),
                ..Teardown::default()
            },
            _ => Teardown::default(),
        }
    }

    /// `put_pages`: the same as [`Lifecycle::unmap`]; the unpin itself waits
    /// for `release`. The core may call `put_pages` (and `dma_unmap`) with its
    /// per-registration mapping lock held — on legacy cores from deregistration,
    /// on all cores when unwinding a failed `dma_map` — while the GPU driver
    /// holds its own lock around the free callback, which needs the mapping
    /// lock: unpinning there would invert the two (MLNX_OFED bug 2696789).
    /// `release` always runs without the mapping lock.
    pub(crate) fn put_pages(&mut self) -> Teardown {
        self.unmap()
    }

    fn unpin(&mut self) -> Teardown {
        match self.phase {
            Phase::Pinned | Phase::Mapped => {
                let mapped = self.phase == Phase::Mapped;
                self.phase = Phase::Unpinned;
                Teardown {
                    free_sg: self.take_sg(),
                    unmap_provider: mapped && !self.invalidating,
                    unpin_provider: true,
                }
            }
            Phase::Revoked => Teardown {
                free_sg: self.take_sg(),
                ..Teardown::default()
            },
            _ => Teardown::default(),
        }
    }

    /// The provider's unpin returned. Returns whether the caller must drop the
    /// reference the free callback would have consumed: after the provider's
    /// unpin returns, its callback has either run to completion or never will.
    pub(crate) fn unpinned(&mut self) -> bool {
        // INVARIANT: disarmed exactly once, here or in `invalidate`.
        core::mem::replace(&mut self.callback_armed, false)
    }

    /// The GPU driver's free callback. The callback consumes its own
    /// reference, so the unpin path must no longer drop it.
    pub(crate) fn invalidate(&mut self) -> Invalidate {
        self.callback_fired = true;
        // INVARIANT: disarmed exactly once, here or in `unpinned`.
        self.callback_armed = false;
        match self.phase {
            Phase::Pinning | Phase::Pinned | Phase::Mapping | Phase::Mapped => {
                self.phase = Phase::Revoked;
                Invalidate::NotifyCore
            }
            _ => Invalidate::Quiet,
        }
    }

    /// `release`: the unpin the core did not do, then the end.
    pub(crate) fn release(&mut self) -> Teardown {
        match self.phase {
            // The core never releases in the middle of its own call.
            Phase::Mapping | Phase::Pinning => Teardown::default(),
            _ => self.unpin(),
        }
    }

    /// The release path finished its provider calls.
    pub(crate) fn released(&mut self) {
        self.phase = Phase::Released;
    }
}
