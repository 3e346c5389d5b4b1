// SPDX-License-Identifier: GPL-2.0 OR MIT

//! A [`Snapshot`] as a human table or as JSON.

use std::fmt::Write;

use serde::{Serialize, Serializer};

use crate::{
    detect::{self, RULES},
    diag::Obj,
    snapshot::Snapshot,
    sysfs::{Field, COUNTERS, MODULE_DIR, PEERS_DIR},
};

/// The module's counters the table explains (any other name is shown as is),
/// and its parameters reported as `param_*` lines (Prometheus help texts).
pub(crate) const KNOWN: &[(&str, &str)] = &[
    (
        "live_registrations",
        "registrations the core holds (acquired, not yet released)",
    ),
    (
        "pinned_bytes",
        "GPU bytes pinned now (orphaned and stranded pins included)",
    ),
    ("acquired", "ranges claimed as GPU memory"),
    ("declined", "ranges declined (not GPU memory)"),
    (
        "registrations",
        "registrations that reached the mapped state",
    ),
    ("releases", "registrations released"),
    ("invalidations", "free callbacks from the GPU driver"),
    ("core_invalidations", "calls of the core's invalidate hook"),
    ("sg_entries", "scatterlist entries handed out"),
    (
        "foreign_releases",
        "releases in another process than the pinning one",
    ),
    (
        "orphaned_pins",
        "pins released elsewhere, waiting for the GPU memory to be freed",
    ),
    (
        "stranded_pins",
        "pins whose unpin failed, waiting for the free callback",
    ),
    ("leaked_pins", "persistent pins whose unpin failed (lost)"),
    (
        "drain_revoked",
        "registrations the drain revoked through the core",
    ),
    (
        "topology_probes",
        "persistent pins made to ask the GPU driver's topology gate (one per GPU per load)",
    ),
    ("fail_bad_range", "empty or overflowing range"),
    ("fail_pin", "GPU driver refused to pin"),
    ("fail_page_table", "unknown page table version or page size"),
    ("fail_not_pci", "DMA device is not PCI"),
    ("fail_dma_map", "GPU driver refused to DMA-map"),
    (
        "fail_dma_mapping",
        "unknown DMA mapping version or page size",
    ),
    ("fail_no_memory", "out of memory"),
    ("fail_revoked", "GPU memory freed during registration"),
    ("fail_unpin", "GPU driver failed to unpin or unmap"),
    ("fail_order", "core called out of order"),
    (
        "fail_path_policy",
        "registration refused by the path policy",
    ),
    (
        "fail_topology",
        "registration refused by the GPU driver's topology gate, applied by the invalidating client",
    ),
    (
        "param_path_policy",
        "path policy: 0 = allow all; 1..5 = refuse paths worse than PIX, PXB, PHB, NODE, SYS",
    ),
    (
        "param_path_accounting",
        "per pair, GPU and process accounting: 1 = on, 0 = off",
    ),
    (
        "param_pair_table_slots",
        "GPU/peer pairs tracked (per-pair counts)",
    ),
    (
        "param_allow_unverified_paths",
        "invalidating client: 1 = map for a pair without a common switch whose topology verdict could not be learnt",
    ),
];

/// The description of a known counter or `param_*` line.
pub(crate) fn known(name: &str) -> Option<&'static str> {
    KNOWN.iter().find(|(k, _)| *k == name).map(|(_, w)| *w)
}

/// memory_peers files shown as columns, with their headers.
const PEER_COLUMNS: &[(&str, &str)] = &[
    ("num_alloc_mrs", "alloc_mrs"),
    ("num_dealloc_mrs", "dealloc_mrs"),
    ("num_reg_pages", "reg_pages"),
    ("num_dereg_pages", "dereg_pages"),
    ("num_reg_bytes", "reg_bytes"),
    ("num_dereg_bytes", "dereg_bytes"),
    ("num_free_callbacks", "free_cbs"),
];

/// Counter changes between two frames.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rates {
    #[serde(serialize_with = "round3")]
    pub interval_s: f64,
    /// None: unknown, or the counter went backwards (module reloaded).
    pub registrations: Option<u64>,
    pub invalidations: Option<u64>,
    #[serde(serialize_with = "round3_opt")]
    registrations_per_s: Option<f64>,
    #[serde(serialize_with = "round3_opt")]
    invalidations_per_s: Option<f64>,
}

impl Rates {
    pub fn between(prev: &Snapshot, cur: &Snapshot, interval_s: f64) -> Self {
        let delta = |n: &str| cur.stat(n)?.checked_sub(prev.stat(n)?);
        let mut r = Self {
            interval_s,
            registrations: delta("registrations"),
            invalidations: delta("invalidations"),
            registrations_per_s: None,
            invalidations_per_s: None,
        };
        r.registrations_per_s = r.per_s(r.registrations);
        r.invalidations_per_s = r.per_s(r.invalidations);
        r
    }

    pub fn per_s(&self, delta: Option<u64>) -> Option<f64> {
        Some(delta? as f64 / self.interval_s).filter(|_| self.interval_s > 0.0)
    }
}

/// Seconds and rates in JSON: 3 decimals, a whole number without them
/// (`2`, not `2.0`), null when not finite.
fn round3<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    round3_opt(&Some(*x), s)
}

fn round3_opt<S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match x.map(|x| (x * 1000.0).round() / 1000.0) {
        Some(x) if x.fract() == 0.0 && x.abs() < 1e15 => (x as i64).serialize(s),
        x => x.serialize(s),
    }
}

/// A field's value, or ERR (the reason is listed under "Unreadable fields").
fn show<T: ToString>(f: &Field<T>) -> String {
    match f {
        Ok(v) => v.to_string(),
        Err(_) => "ERR".into(),
    }
}

/// An optional file's value, or "-" when the file does not exist.
fn field_str<T: ToString>(f: &Option<Field<T>>) -> String {
    f.as_ref().map_or_else(|| "-".into(), show)
}

/// The human table of one frame.
pub fn table(s: &Snapshot, all: bool, rates: Option<&Rates>) -> String {
    let mut o = String::new();
    // Writing into a String cannot fail.
    let _ = write_table(&mut o, s, all, rates);
    o
}

fn write_table(o: &mut String, s: &Snapshot, all: bool, rates: Option<&Rates>) -> std::fmt::Result {
    let m = &s.module;
    if m.loaded {
        write!(
            o,
            "nvidia_peermem: loaded, version {}, refcnt {}",
            field_str(&m.version),
            field_str(&m.refcnt)
        )?;
        match s.implementation {
            Some(i) => writeln!(o, ", implementation {i}")?,
            None => writeln!(o)?,
        }
        if !m.parameters.is_empty() {
            let p: Vec<String> = m
                .parameters
                .iter()
                .map(|(n, v)| format!("{n}={}", show(v)))
                .collect();
            writeln!(o, "  parameters: {}", p.join(" "))?;
        }
    } else {
        writeln!(o, "nvidia_peermem: not loaded (no {MODULE_DIR})")?;
    }

    writeln!(o)?;
    match &s.stats {
        Ok(stats) => {
            let file = s.stats_file.unwrap_or(COUNTERS.sysfs);
            writeln!(o, "Counters ({file})")?;
            let mut hidden = 0;
            for (name, v) in stats {
                if !all && name.starts_with("fail_") && matches!(v, Ok(0)) {
                    hidden += 1;
                    continue;
                }
                let value = show(v);
                let what = known(name).unwrap_or("");
                writeln!(o, "  {name:<20} {value:>16}  {what}")?;
            }
            if hidden > 0 {
                writeln!(
                    o,
                    "  ({hidden} zero failure counters hidden; --all shows them)"
                )?;
            }
        }
        Err(why) => writeln!(o, "Counters: unavailable: {why}")?,
    }
    if let Some(r) = rates {
        let rate = |d: Option<u64>| match r.per_s(d) {
            Some(x) => format!("{x:.1}/s"),
            None => "n/a".into(),
        };
        writeln!(
            o,
            "  rates over {:.2} s: registrations {}, invalidations {}",
            r.interval_s,
            rate(r.registrations),
            rate(r.invalidations)
        )?;
    }

    writeln!(o)?;
    if s.peers.is_empty() {
        match &s.peers_error {
            Some(e) => writeln!(o, "Peer-memory clients: cannot read {PEERS_DIR}: {e}")?,
            None => writeln!(o, "Peer-memory clients: none (no {PEERS_DIR}/*)")?,
        }
    } else {
        writeln!(o, "Peer-memory clients ({PEERS_DIR})")?;
        let mut head = format!(
            "  {:<10} {:<10} {:>8} {:>14}",
            "client", "version", "live_mrs", "live_bytes"
        );
        for (_, h) in PEER_COLUMNS {
            let _ = write!(head, " {h:>12}");
        }
        writeln!(o, "{head}")?;
        for p in &s.peers {
            let opt = |v: Option<u64>| v.map_or("-".to_string(), |n| n.to_string());
            write!(
                o,
                "  {:<10} {:<10} {:>8} {:>14}",
                p.name,
                field_str(&p.version),
                opt(p.live_mrs()),
                opt(p.live_bytes())
            )?;
            for (file, _) in PEER_COLUMNS {
                let v = p.counters.iter().find(|(n, _)| n == file);
                write!(o, " {:>12}", v.map_or_else(|| "-".into(), |(_, v)| show(v)))?;
            }
            let extra: Vec<String> = p
                .counters
                .iter()
                .filter(|(n, _)| !PEER_COLUMNS.iter().any(|(c, _)| c == n))
                .map(|(n, v)| format!("{n}={}", show(v)))
                .collect();
            if !extra.is_empty() {
                write!(o, "  {}", extra.join(" "))?;
            }
            writeln!(o)?;
        }
    }

    writeln!(o)?;
    writeln!(o, "Detection (GPUDirect RDMA over IB verbs)")?;
    for d in &s.detection {
        match d.matched {
            Some(r) => writeln!(o, "  {:<9} YES  {}  ({})", d.stack, r.path, r.meaning)?,
            None => {
                let checked: Vec<&str> = RULES
                    .iter()
                    .filter(|r| r.stack == d.stack)
                    .map(|r| r.path)
                    .collect();
                writeln!(o, "  {:<9} NO   (none of {})", d.stack, checked.join(", "))?;
            }
        }
    }
    let b = &s.dmabuf;
    let ok = |v: Option<bool>| match v {
        Some(true) => "ok",
        Some(false) => "too old",
        None => "unknown",
    };
    if b.nvidia_loaded {
        writeln!(
            o,
            "  dma-buf   nvidia loaded, version {} ({}), kernel {} ({})",
            field_str(&b.nvidia_version),
            ok(b.driver_ok),
            field_str(&b.kernel),
            ok(b.kernel_ok)
        )?;
    } else {
        writeln!(
            o,
            "  dma-buf   nvidia not loaded (no {}), kernel {} ({})",
            detect::DMABUF.module,
            field_str(&b.kernel),
            ok(b.kernel_ok)
        )?;
    }
    writeln!(o, "            {} (informational)", detect::DMABUF.note)?;

    let errors = s.errors();
    if !errors.is_empty() {
        writeln!(o)?;
        writeln!(o, "Unreadable fields")?;
        for e in errors {
            writeln!(o, "  {e}")?;
        }
    }
    Ok(())
}

/// Named fields as one object, a value that could not be read as null (see
/// "errors").
fn fields<'a, T: 'a>(
    f: impl IntoIterator<Item = &'a (String, Field<T>)>,
) -> Obj<&'a str, Option<&'a T>> {
    Obj(f
        .into_iter()
        .map(|(n, v)| (n.as_str(), v.as_ref().ok()))
        .collect())
}

/// An optional file's value: null when absent or unreadable (see "errors").
fn ok<T>(f: &Option<Field<T>>) -> Option<&T> {
    f.as_ref()?.as_ref().ok()
}

/// One frame as JSON (keys always present, in this order).
#[derive(Serialize)]
pub struct Frame<'a> {
    module: ModuleJson<'a>,
    stats: Option<Obj<&'a str, Option<&'a u64>>>,
    stats_error: Option<&'a str>,
    peers: Obj<&'a str, PeerJson<'a>>,
    detection: Vec<DetectionJson>,
    dmabuf: DmaBufJson<'a>,
    rates: Option<&'a Rates>,
    errors: Vec<String>,
}

#[derive(Serialize)]
struct ModuleJson<'a> {
    loaded: bool,
    version: Option<&'a String>,
    implementation: Option<&'static str>,
    parameters: Obj<&'a str, Option<&'a String>>,
    refcnt: Option<&'a u64>,
}

#[derive(Serialize)]
struct PeerJson<'a> {
    version: Option<&'a String>,
    #[serde(flatten)]
    counters: Obj<&'a str, Option<&'a u64>>,
    live_mrs: Option<u64>,
    live_bytes: Option<u64>,
}

#[derive(Serialize)]
struct DetectionJson {
    stack: &'static str,
    enabled: bool,
    path: Option<&'static str>,
    meaning: Option<&'static str>,
}

#[derive(Serialize)]
struct DmaBufJson<'a> {
    nvidia_loaded: bool,
    nvidia_version: Option<&'a String>,
    kernel: Option<&'a String>,
    driver_ok: Option<bool>,
    kernel_ok: Option<bool>,
    note: &'static str,
}

/// One frame as JSON.
pub fn json<'a>(s: &'a Snapshot, rates: Option<&'a Rates>) -> Frame<'a> {
    let m = &s.module;
    let b = &s.dmabuf;
    Frame {
        module: ModuleJson {
            loaded: m.loaded,
            version: ok(&m.version),
            implementation: s.implementation,
            parameters: fields(&m.parameters),
            refcnt: ok(&m.refcnt),
        },
        stats: s.stats.as_ref().ok().map(fields),
        stats_error: s.stats.as_ref().err().map(String::as_str),
        peers: Obj(s
            .peers
            .iter()
            .map(|p| {
                let counters = p
                    .counters
                    .iter()
                    .filter(|(n, _)| !matches!(n.as_str(), "version" | "live_mrs" | "live_bytes"));
                let peer = PeerJson {
                    version: ok(&p.version),
                    counters: fields(counters),
                    live_mrs: p.live_mrs(),
                    live_bytes: p.live_bytes(),
                };
                (p.name.as_str(), peer)
            })
            .collect()),
        detection: s
            .detection
            .iter()
            .map(|d| DetectionJson {
                stack: d.stack,
                enabled: d.matched.is_some(),
                path: d.matched.map(|r| r.path),
                meaning: d.matched.map(|r| r.meaning),
            })
            .collect(),
        dmabuf: DmaBufJson {
            nvidia_loaded: b.nvidia_loaded,
            nvidia_version: ok(&b.nvidia_version),
            kernel: ok(&b.kernel),
            driver_ok: b.driver_ok,
            kernel_ok: b.kernel_ok,
            note: detect::DMABUF.note,
        },
        rates,
        errors: s.errors(),
    }
}
