// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The whole state in the Prometheus text exposition format 0.0.4, for
//! node_exporter's textfile collector: each family's `# HELP` and `# TYPE`
//! once, then its samples; no timestamps. Naming follows the exposition
//! conventions: a counter only for what only grows (it resets when the
//! module is reloaded), `_total` only on counters, the base unit (`_bytes`)
//! last before it. The tests read it back with a third-party parser.

use std::fmt::Write;

use crate::{
    render::known,
    snapshot::Snapshot,
    sysfs::{COUNTERS, GPUS, PATHS, PROCESSES},
};

const PREFIX: &str = "nvidia_peermem_";

/// Module counters that are current values, not running totals.
const GAUGES: &[&str] = &[
    "live_registrations",
    "pinned_bytes",
    "orphaned_pins",
    "stranded_pins",
];

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Counter,
    Gauge,
    Untyped,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Untyped => "untyped",
        }
    }
}

type Labels = Vec<(&'static str, String)>;

struct Family {
    name: String,
    help: String,
    kind: Kind,
    samples: Vec<(Labels, u64)>,
}

/// Families in first-use order, samples grouped under them.
#[derive(Default)]
struct Metrics(Vec<Family>);

impl Metrics {
    /// Adds a sample to the family `nvidia_peermem_<name>`; a label set
    /// already present, or a name already used with another type, is
    /// dropped (the exposition would be invalid).
    fn add(&mut self, name: &str, help: &str, kind: Kind, labels: Labels, value: u64) {
        let name = format!("{PREFIX}{}", sanitize(name));
        let i = match self.0.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                self.0.push(Family {
                    name,
                    help: help.to_string(),
                    kind,
                    samples: Vec::new(),
                });
                self.0.len() - 1
            }
        };
        let f = &mut self.0[i];
        if f.kind == kind && !f.samples.iter().any(|(l, _)| *l == labels) {
            f.samples.push((labels, value));
        }
    }

    fn write(&self) -> String {
        let mut o = String::new();
        for f in self.0.iter().filter(|f| !f.samples.is_empty()) {
            let _ = writeln!(o, "# HELP {} {}", f.name, escape_help(&f.help));
            let _ = writeln!(o, "# TYPE {} {}", f.name, f.kind.name());
            for (labels, v) in &f.samples {
                o.push_str(&f.name);
                if !labels.is_empty() {
                    let l: Vec<String> = labels
                        .iter()
                        .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
                        .collect();
                    let _ = write!(o, "{{{}}}", l.join(","));
                }
                let _ = writeln!(o, " {v}");
            }
        }
        o
    }
}

/// A metric name part: `[a-zA-Z0-9_]`, other characters become `_`.
fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// A label value: backslash, double quote and line feed escaped.
pub fn escape_label(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
    o
}

/// A HELP text: backslash and line feed escaped.
fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

fn l(pairs: &[(&'static str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// A parameter's value as a number (`Y`/`N` booleans as 1/0).
fn param_value(v: &str) -> Option<u64> {
    match v {
        "Y" | "y" => Some(1),
        "N" | "n" => Some(0),
        v => v.parse().ok(),
    }
}

/// The whole state of one snapshot.
pub fn prometheus(s: &Snapshot) -> String {
    let mut m = Metrics::default();
    let g = Kind::Gauge;
    let c = Kind::Counter;
    let md = &s.module;
    m.add(
        "up",
        "1 when nvidia_peermem is loaded, 0 when not",
        g,
        l(&[]),
        md.loaded.into(),
    );
    if md.loaded {
        let version = match &md.version {
            Some(Ok(v)) => v.as_str(),
            _ => "",
        };
        m.add(
            "info",
            "the loaded nvidia_peermem: version and implementation (peermem-rs, other or unknown)",
            g,
            l(&[
                ("version", version),
                ("implementation", s.implementation.unwrap_or("unknown")),
            ]),
            1,
        );
    }
    let readable = |t: bool| u64::from(md.loaded && t);
    for (file, ok) in [
        (COUNTERS, s.stats.is_ok()),
        (PATHS, s.diag.paths.is_ok()),
        (GPUS, s.diag.gpus.is_ok()),
        (PROCESSES, s.diag.processes.is_ok()),
    ] {
        m.add(
            "view_readable",
            "1 when the module's operator view could be read: /sys/module/nvidia_peermem/stats/<file> \
             (processes: root's debugfs file; from a peermem-rs older than its sysfs views, its debugfs \
             file: needs debugfs mounted and root)",
            g,
            l(&[("file", file.name)]),
            readable(ok),
        );
    }
    m.add(
        "read_errors",
        "fields and lines that could not be parsed (peermem-stat lists them)",
        g,
        l(&[]),
        s.errors().len() as u64,
    );

    for (name, v) in &md.parameters {
        let Some(v) = v.as_ref().ok().and_then(|v| param_value(v)) else {
            continue;
        };
        let help = known(&format!("param_{name}"))
            .map_or_else(|| format!("module parameter {name}"), str::to_string);
        m.add(&format!("param_{name}"), &help, g, l(&[]), v);
    }

    if let Ok(stats) = &s.stats {
        for (name, v) in stats {
            let Ok(v) = v else { continue };
            let help = known(name).unwrap_or("nvidia_peermem counter (stats/counters/<name>)");
            if let Some(cause) = name.strip_prefix("fail_") {
                m.add(
                    "failures_total",
                    "failed calls by cause (the module's fail_* counters)",
                    c,
                    l(&[("cause", cause)]),
                    *v,
                );
            } else if GAUGES.contains(&name.as_str()) {
                m.add(name, help, g, l(&[]), *v);
            } else if known(name).is_some() {
                m.add(&format!("{name}_total"), help, c, l(&[]), *v);
            } else {
                // A counter of a newer module: its type is not known here.
                m.add(name, help, Kind::Untyped, l(&[]), *v);
            }
        }
    }

    for p in &s.peers {
        let client = l(&[("client", &p.name)]);
        for (file, v) in &p.counters {
            let Ok(v) = v else { continue };
            let help = format!("RDMA core peer-memory client counter memory_peers/*/{file}");
            match file.strip_prefix("num_") {
                Some(what) => m.add(&format!("peer_{what}_total"), &help, c, client.clone(), *v),
                None => m.add(
                    &format!("peer_{file}"),
                    &help,
                    Kind::Untyped,
                    client.clone(),
                    *v,
                ),
            }
        }
        if let Some(v) = p.live_mrs() {
            let help = "peer-memory client MRs allocated and not deallocated";
            m.add("peer_live_mrs", help, g, client.clone(), v);
        }
        if let Some(v) = p.live_bytes() {
            let help = "peer-memory client bytes registered and not deregistered";
            m.add("peer_live_bytes", help, g, client.clone(), v);
        }
    }

    if let Ok(r) = &s.diag.paths {
        for p in &r.records {
            let pair = [("gpu", p.gpu.as_str()), ("hca", p.hca.as_str())];
            let with_class = l(&[pair[0], pair[1], ("class", p.class.as_str())]);
            m.add(
                "path_info",
                "PCIe path of a GPU/HCA pair: class (PIX PXB PHB NODE SYS unknown), ACS redirect (0/1), the HCA's IOMMU domain type",
                g,
                l(&[
                    pair[0],
                    pair[1],
                    ("class", p.class.as_str()),
                    ("acs_redirect", if p.acs_redirect { "1" } else { "0" }),
                    ("iommu", p.iommu.as_str()),
                ]),
                1,
            );
            m.add(
                "path_registrations_total",
                "registrations over a GPU/HCA pair",
                c,
                with_class.clone(),
                p.registrations,
            );
            m.add(
                "path_policy_refusals_total",
                "registrations over a GPU/HCA pair refused by the path policy",
                c,
                with_class,
                p.policy_refusals,
            );
            m.add(
                "path_failures_total",
                "failed registrations over a GPU/HCA pair",
                c,
                l(&[("gpu", p.gpu.as_str()), ("hca", p.hca.as_str())]),
                p.failures,
            );
        }
    }

    if let Ok(r) = &s.diag.gpus {
        for x in &r.records {
            let gpu = l(&[("gpu", x.gpu.as_str())]);
            m.add(
                "gpu_live_registrations",
                "live registrations of GPU memory by GPU",
                g,
                gpu.clone(),
                x.live,
            );
            m.add(
                "gpu_pinned_bytes",
                "GPU bytes pinned now by GPU",
                g,
                gpu.clone(),
                x.pinned_bytes,
            );
            m.add(
                "gpu_max_pinned_bytes",
                "high-water mark of GPU bytes pinned by GPU",
                g,
                gpu,
                x.max_pinned_bytes,
            );
        }
    }

    if let Ok(r) = &s.diag.processes {
        for p in &r.records {
            let tgid = p.tgid.to_string();
            let who = l(&[("tgid", tgid.as_str()), ("comm", p.comm.as_str())]);
            m.add(
                "process_live_registrations",
                "live registrations by process (only processes that have some)",
                g,
                who.clone(),
                p.live,
            );
            m.add(
                "process_pinned_bytes",
                "GPU bytes pinned now by process",
                g,
                who,
                p.pinned_bytes,
            );
        }
    }
    m.write()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_and_names() {
        assert_eq!(escape_label("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
        assert_eq!(escape_help("x\\y\nz\""), "x\\\\y\\nz\"");
        assert_eq!(sanitize("a-b.c_9"), "a_b_c_9");
        let mut m = Metrics::default();
        m.add("x_total", "h", Kind::Counter, l(&[("k", "v")]), 1);
        m.add("x_total", "h", Kind::Counter, l(&[("k", "v")]), 2);
        m.add("x_total", "h", Kind::Gauge, l(&[("k", "w")]), 3);
        m.add("empty", "h", Kind::Gauge, l(&[]), 4);
        m.add("x_total", "h", Kind::Counter, l(&[("k", "u")]), 5);
        assert_eq!(
            m.write(),
            "# HELP nvidia_peermem_x_total h\n# TYPE nvidia_peermem_x_total counter\n\
             nvidia_peermem_x_total{k=\"v\"} 1\nnvidia_peermem_x_total{k=\"u\"} 5\n\
             # HELP nvidia_peermem_empty h\n# TYPE nvidia_peermem_empty gauge\n\
             nvidia_peermem_empty 4\n"
        );
    }
}
