// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The kernel log cut into load attempts of nvidia_peermem, so that
//! `doctor` judges the latest one, not the first failure it finds.
//!
//! An attempt starts at the module's load line ("version V loaded"), or at
//! a line the kernel or the module prints when a load fails: "Unknown
//! symbol", "disagrees about version of symbol", a signature refusal (the
//! kernel does not name the module), "invalid parameter". The lines of one
//! failed insmod follow each other, so a failure line joins the failed
//! attempt before it unless it repeats one of its lines or comes more than
//! [`SAME_ATTEMPT`] seconds later. Every other line of the module belongs to
//! the attempt before it; lines before the first attempt (its start lost in
//! a wrapped ring buffer) form an attempt of their own.

/// Failure lines further apart than this (seconds) are separate attempts.
const SAME_ATTEMPT: f64 = 1.0;

const OURS: &str = "nvidia_peermem: ";

/// What the module (and the kernel, for it) prints at load before its load
/// line.
const PRELOAD: [&str; 3] = [
    ": refused module ",
    ": refused the GPU driver ",
    ": module verification failed",
];

/// What one line of the log says about the module.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind<'a> {
    /// "version V loaded...": a load that succeeded.
    Loaded,
    /// The kernel found this symbol unknown.
    Unknown(&'a str),
    /// The kernel found this symbol's version (CRC) different.
    Disagrees(&'a str),
    /// The kernel refused a module's signature (any module's).
    Signature,
    /// The module refused its parameters.
    Parameter,
    /// Any other line of the module.
    Other,
}

/// One line of the log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Line<'a> {
    /// Seconds since boot, when the line has a time stamp.
    pub secs: Option<f64>,
    /// The text after the record's prefix.
    pub text: &'a str,
    pub kind: Kind<'a>,
}

/// One load attempt and the lines of the module after it.
#[derive(Debug, Default, PartialEq)]
pub struct Attempt<'a> {
    pub lines: Vec<Line<'a>>,
}

impl<'a> Attempt<'a> {
    /// Its load line, if it loaded.
    pub fn loaded(&self) -> Option<&Line<'a>> {
        self.lines.iter().find(|l| l.kind == Kind::Loaded)
    }

    /// Its lines of kind `f`.
    pub fn of<T>(&self, f: impl Fn(&Line<'a>) -> Option<T>) -> Vec<T> {
        self.lines.iter().filter_map(f).collect()
    }

    /// Whether a failure line `l` belongs to this attempt: it failed, `l`
    /// repeats none of its lines and follows its last one closely.
    fn joins(&self, l: &Line) -> bool {
        let close = match (self.lines.last().and_then(|p| p.secs), l.secs) {
            (Some(a), Some(b)) => (b - a).abs() <= SAME_ATTEMPT,
            _ => true,
        };
        let failed = self.lines.iter().all(|p| p.kind != Kind::Other) && self.loaded().is_none();
        failed && close && !self.lines.iter().any(|p| p.text == l.text)
    }

    /// Its last lines that a load at `secs` prints before its load line (a
    /// module refused at load, the kernel's taint line), if they came within
    /// [`SAME_ATTEMPT`] of it, taken out.
    fn take_preload(&mut self, secs: Option<f64>) -> Vec<Line<'a>> {
        let near = |l: &Line| {
            PRELOAD.iter().any(|p| l.text.contains(p))
                && matches!((l.secs, secs), (Some(a), Some(b)) if b - a <= SAME_ATTEMPT)
        };
        let keep = self.lines.len() - self.lines.iter().rev().take_while(|l| near(l)).count();
        // The attempt's own first line stays (it started it).
        self.lines.split_off(keep.max(1))
    }

    /// A short account of it, for the history.
    pub fn summary(&self) -> String {
        let at = self.lines.first().and_then(|l| l.secs);
        let at = at.map_or(String::new(), |s| format!(" at {s:.1} s"));
        match self.loaded() {
            Some(l) => format!("loaded{at}: \"{}\"", l.text),
            None => {
                let texts: Vec<&str> = self.lines.iter().map(|l| l.text).take(3).collect();
                format!("failed{at}: \"{}\"", texts.join("\", \""))
            }
        }
    }
}

/// The record's time and text: /dev/kmsg's "6,812,5123,-;text" (time in
/// microseconds), dmesg's "[   12.5] text" (seconds), or a bare line. None
/// for /dev/kmsg's continuation lines (" SUBSYSTEM=...").
fn record(raw: &str) -> Option<(Option<f64>, &str)> {
    if raw.starts_with(' ') || raw.trim().is_empty() {
        return None;
    }
    if let Some((head, rest)) = raw.split_once(';') {
        if !head.contains(' ') && head.contains(',') {
            let us = head.split(',').nth(2).and_then(|t| t.parse::<u64>().ok());
            return Some((us.map(|u| u as f64 / 1e6), rest.trim()));
        }
    }
    let stamped = raw.split_once("] ").and_then(|(head, rest)| {
        let secs = head.rsplit_once('[')?.1.trim().parse::<f64>().ok()?;
        Some((Some(secs), rest.trim()))
    });
    Some(stamped.unwrap_or((None, raw.trim())))
}

/// The first word of `s`.
fn first(s: &str) -> &str {
    s.split_whitespace().next().unwrap_or("")
}

/// What `text` says about the module; None when it is not about it.
fn kind(text: &str) -> Option<Kind<'_>> {
    let Some(msg) = text.split_once(OURS).map(|(_, m)| m) else {
        let sig = text.starts_with("Loading of unsigned module is rejected")
            || (text.starts_with("Loading of module with ") && text.contains(" is rejected"))
            || (text.starts_with("Lockdown: ")
                && text.contains(": unsigned module loading is restricted"));
        return sig.then_some(Kind::Signature);
    };
    Some(if msg.starts_with("version ") && msg.contains(" loaded") {
        Kind::Loaded
    } else if let Some(r) = msg.strip_prefix("Unknown symbol ") {
        Kind::Unknown(first(r))
    } else if let Some(r) = msg.strip_prefix("disagrees about version of symbol ") {
        Kind::Disagrees(first(r))
    } else if msg.starts_with("invalid parameter") {
        Kind::Parameter
    } else {
        Kind::Other
    })
}

/// The log's load attempts of nvidia_peermem, oldest first.
pub fn attempts(log: &str) -> Vec<Attempt<'_>> {
    let mut all: Vec<Attempt> = Vec::new();
    for raw in log.lines() {
        let Some((secs, text)) = record(raw) else {
            continue;
        };
        let Some(kind) = kind(text) else {
            continue;
        };
        let l = Line { secs, text, kind };
        let starts = match kind {
            Kind::Loaded => true,
            Kind::Other => all.is_empty(),
            _ => !all.last().is_some_and(|a| a.joins(&l)),
        };
        if starts {
            let mut next = Attempt::default();
            if let (Some(prev), Kind::Loaded) = (all.last_mut(), kind) {
                next.lines = prev.take_preload(secs);
            }
            all.push(next);
        }
        if let Some(a) = all.last_mut() {
            a.lines.push(l);
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each attempt's kinds.
    fn kinds<'a>(all: &[Attempt<'a>]) -> Vec<Vec<Kind<'a>>> {
        all.iter()
            .map(|a| a.lines.iter().map(|l| l.kind).collect())
            .collect()
    }

    #[test]
    fn records() {
        assert_eq!(record("6,812,5123,-;text "), Some((Some(0.005123), "text")));
        assert_eq!(record("[   12.5] text"), Some((Some(12.5), "text")));
        assert_eq!(
            record("Jun  3 10:00:00 h kernel: [ 3.25] x: y"),
            Some((Some(3.25), "x: y"))
        );
        let bare = "nvidia_peermem: refused pid=1 [a] b";
        assert_eq!(record(bare), Some((None, bare)));
        assert_eq!(record(" SUBSYSTEM=pci"), None);
    }

    #[test]
    fn one_failed_insmod_is_one_attempt() {
        // Both lines of a CRC mismatch and the unknown symbols of one
        // insmod; the same symbols again a second later: another attempt.
        let log = "\
3,812,5123000,-;nvidia_peermem: disagrees about version of symbol ib_register_peer_memory_client
4,813,5123100,-;nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -22)
4,814,5123200,-;nvidia_peermem: Unknown symbol nvidia_p2p_get_pages (err -2)
 SUBSYSTEM=pci
4,815,5123300,-;other_mod: Unknown symbol foo (err -2)
4,816,5123400,-;nvidia_peermem: Unknown symbol nvidia_p2p_get_pages (err -2)
";
        let all = attempts(log);
        assert_eq!(
            kinds(&all),
            [
                vec![
                    Kind::Disagrees("ib_register_peer_memory_client"),
                    Kind::Unknown("ib_register_peer_memory_client"),
                    Kind::Unknown("nvidia_p2p_get_pages"),
                ],
                vec![Kind::Unknown("nvidia_p2p_get_pages")],
            ]
        );
        // Without time stamps a repeated line still starts another attempt.
        assert_eq!(
            attempts("nvidia_peermem: Unknown symbol a\nnvidia_peermem: Unknown symbol a\n").len(),
            2
        );
        assert!(attempts("").is_empty());
    }

    #[test]
    fn loads_unloads_and_a_wrapped_buffer() {
        // The ring buffer wrapped: the first attempt's first line is lost.
        // Then a load that waited, bound and registered; a reload (the
        // kernel logs no unload) whose GPU driver was refused at load; a
        // failed insmod a minute later; a signature refusal.
        let log = "\
[   10.000] nvidia_peermem: Unknown symbol ib_unregister_peer_memory_client (err -2)
[   20.000] nvidia_peermem: version 0.1.0 loaded, waiting for the peer-memory core (x): y
[   30.000] nvidia_peermem: bound to module ib_core; waiting for nothing
[   30.001] nvidia_peermem: registered with the peer-memory core: nv_mem (bound to module ib_core)
[   40.000] nvidia_peermem: refused the GPU driver in module nvidia: version '460.1' is not one
[   40.001] nvidia_peermem: version 0.1.0 loaded, waiting for the GPU driver (x): y
[  100.000] nvidia_peermem: invalid parameter path_policy=9 (0 to allow every path, 1..5 for PIX..SYS)
[  110.000] Loading of unsigned module is rejected
";
        let all = attempts(log);
        assert_eq!(
            kinds(&all),
            [
                vec![Kind::Unknown("ib_unregister_peer_memory_client")],
                vec![Kind::Loaded, Kind::Other, Kind::Other],
                vec![Kind::Other, Kind::Loaded],
                vec![Kind::Parameter],
                vec![Kind::Signature],
            ]
        );
        assert!(all[1].loaded().is_some() && all[3].loaded().is_none());
        assert_eq!(
            all[3].summary(),
            "failed at 100.0 s: \"nvidia_peermem: invalid parameter path_policy=9 (0 to allow \
             every path, 1..5 for PIX..SYS)\""
        );
        // A log that begins inside a loaded module's life: its lines make
        // an attempt whose load line is lost.
        let all =
            attempts("[ 5.0] nvidia_peermem: GPU 0000:01:00.0 and peer x: path PIX (IOMMU: off)\n");
        assert_eq!(kinds(&all), [vec![Kind::Other]]);
    }
}
