// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The module's path diagnostics: `paths`, `gpus` and `processes`, one
//! `key=value ...` record per line as `sysfs::read_view` reads them (from
//! any of the module's layouts). A malformed line becomes an error for that
//! line only; a missing file makes its view unavailable, with the reason.

use serde::{Serialize, Serializer};

use crate::sysfs::{parse_u64, read_view, Module, Sys, ViewFile, Views, GPUS, PATHS, PROCESSES};

/// Path classes, best first, in `nvidia-smi topo -m` vocabulary.
pub const CLASSES: &[&str] = &["PIX", "PXB", "PHB", "NODE", "SYS"];

/// One (GPU, HCA) pair of `paths` (its JSON record too).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PathRec {
    pub gpu: String,
    pub hca: String,
    /// One of [`CLASSES`] or `unknown` (other words are kept as they are).
    pub class: String,
    /// A bridge on the path redirects peer requests (ACS).
    pub acs_redirect: bool,
    /// The HCA's IOMMU domain type: none, identity, dma, dma-fq, other.
    pub iommu: String,
    /// The HCA's DMA goes through IOMMU translation (dma, dma-fq).
    pub iommu_translated: bool,
    pub registrations: u64,
    /// Failed registrations (earlier releases counted them by errno: the
    /// sum).
    pub failures: u64,
    pub last_failure: Option<String>,
    pub policy_refusals: u64,
}

impl PathRec {
    /// The class is one the module knows how to name.
    pub fn classified(&self) -> bool {
        CLASSES.contains(&self.class.as_str())
    }
}

/// One GPU of `gpus`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuRec {
    pub gpu: String,
    pub live: u64,
    pub pinned_bytes: u64,
    pub max_pinned_bytes: u64,
    /// BAR1 size, use (each pinned run once) and the pins the BAR1 guard
    /// refused (releases with the guard).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bar1_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bar1_used: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bar1_refused: Option<u64>,
}

/// One process of `processes` (only those with live registrations).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcRec {
    pub tgid: u64,
    pub comm: String,
    pub live: u64,
    pub pinned_bytes: u64,
}

/// A file's records, sorted, and its malformed lines ("line N: why").
#[derive(Debug, Clone, PartialEq)]
pub struct Records<T> {
    /// The file read (sysfs, or debugfs for an older peermem-rs); empty
    /// when parsed from a string.
    pub file: &'static str,
    pub records: Vec<T>,
    pub errors: Vec<String>,
}

/// A file's records, or why the file could not be read.
pub type Table<T> = Result<Records<T>, String>;

/// The three files.
#[derive(Debug)]
pub struct Diag {
    pub paths: Table<PathRec>,
    pub gpus: Table<GpuRec>,
    pub processes: Table<ProcRec>,
}

impl Diag {
    /// Reads the files where `views` says they are: sysfs first, then
    /// debugfs.
    pub fn read(sys: &Sys, views: &Views) -> Self {
        fn table<T>(
            sys: &Sys,
            views: &Views,
            f: &ViewFile,
            parse: fn(&str) -> Records<T>,
        ) -> Table<T> {
            read_view(sys, views, f).map(|(text, file)| Records {
                file,
                ..parse(&text)
            })
        }
        Self {
            paths: table(sys, views, &PATHS, parse_paths),
            gpus: table(sys, views, &GPUS, parse_gpus),
            processes: table(sys, views, &PROCESSES, parse_processes),
        }
    }

    /// Every malformed line, as "file: line N: why".
    pub fn errors(&self) -> Vec<String> {
        fn add<T>(out: &mut Vec<String>, t: &Table<T>) {
            if let Ok(r) = t {
                out.extend(r.errors.iter().map(|e| format!("{}: {e}", r.file)));
            }
        }
        let mut out = Vec::new();
        add(&mut out, &self.paths);
        add(&mut out, &self.gpus);
        add(&mut out, &self.processes);
        out
    }
}

/// Sort key of a PCI address `dddd:bb:dd.f` (any domain width); other
/// strings sort after the addresses, by text.
pub fn pci_key(s: &str) -> (bool, u64, String) {
    let parsed = (|| {
        let (domain, rest) = s.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (dev, func) = rest.split_once('.')?;
        let hex = |p: &str, max: u64| u64::from_str_radix(p, 16).ok().filter(|&v| v <= max);
        if domain.is_empty() || domain.len() > 8 || bus.len() != 2 || dev.len() != 2 {
            return None;
        }
        let n = (hex(domain, u32::MAX as u64)? << 16)
            | (hex(bus, 0xff)? << 8)
            | (hex(dev, 0x1f)? << 3)
            | hex(func, 7)?;
        (func.len() == 1).then_some(n)
    })();
    (parsed.is_none(), parsed.unwrap_or(0), s.to_string())
}

/// The `key=value` words of one line, in order.
struct Line<'a>(Vec<(&'a str, &'a str)>);

impl<'a> Line<'a> {
    fn parse(line: &'a str) -> Result<Self, String> {
        line.split_whitespace()
            .map(|w| match w.split_once('=') {
                Some((k, v)) if !k.is_empty() => Ok((k, v)),
                _ => Err(format!("not key=value: {:?}", short(w))),
            })
            .collect::<Result<_, _>>()
            .map(Line)
    }

    /// A key's value (the first, if repeated); unknown keys are ignored,
    /// so a newer module may add some.
    fn get(&self, key: &str) -> Result<&'a str, String> {
        match self.0.iter().find(|(k, _)| *k == key) {
            Some((_, v)) if !v.is_empty() => Ok(v),
            Some(_) => Err(format!("{key} is empty")),
            None => Err(format!("no {key}")),
        }
    }

    /// A value that may be empty.
    fn any(&self, key: &str) -> Result<&'a str, String> {
        match self.0.iter().find(|(k, _)| *k == key) {
            Some((_, v)) => Ok(v),
            None => Err(format!("no {key}")),
        }
    }

    fn num(&self, key: &str) -> Result<u64, String> {
        parse_u64(self.get(key)?).map_err(|e| format!("{key}: {e}"))
    }

    /// `-` is none.
    fn opt(&self, key: &str) -> Result<Option<&'a str>, String> {
        self.get(key).map(|v| (v != "-").then_some(v))
    }
}

fn short(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Parses every non-empty line with `f`, drops repeated keys (the first
/// record wins), sorts by `key`.
fn records<T, K: Ord + Clone>(
    text: &str,
    f: impl Fn(&Line) -> Result<T, String>,
    key: impl Fn(&T) -> K,
    shown: impl Fn(&T) -> String,
) -> Records<T> {
    let mut out: Vec<(K, T)> = Vec::new();
    let mut errors = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match Line::parse(line).and_then(|l| f(&l)) {
            Ok(r) => {
                let k = key(&r);
                if out.iter().any(|(o, _)| *o == k) {
                    errors.push(format!("line {}: {} repeated", i + 1, shown(&r)));
                } else {
                    out.push((k, r));
                }
            }
            Err(e) => errors.push(format!("line {}: {e}", i + 1)),
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Records {
        file: "",
        records: out.into_iter().map(|(_, r)| r).collect(),
        errors,
    }
}

fn path_line(l: &Line) -> Result<PathRec, String> {
    // Checked in the file's key order: the first bad key is reported.
    let gpu = l.get("gpu")?.into();
    let hca = l.get("hca")?.into();
    let class = l.get("class")?.into();
    let acs_redirect = match l.get("acs_redirect")? {
        "0" => false,
        "1" => true,
        v => return Err(format!("acs_redirect: not 0 or 1: {:?}", short(v))),
    };
    let iommu: String = l.get("iommu")?.into();
    let registrations = l.num("registrations")?;
    // A count, or (earlier releases) `errno:count,...`.
    let failures = match l.opt("failures")? {
        None => 0,
        Some(n) if !n.contains(':') => parse_u64(n).map_err(|e| format!("failures: {e}"))?,
        Some(list) => list
            .split(',')
            .map(|p| match p.split_once(':') {
                Some((name, n)) if !name.is_empty() => {
                    parse_u64(n).map_err(|e| format!("failures: {e}"))
                }
                _ => Err(format!("failures: not errno:count: {:?}", short(p))),
            })
            .sum::<Result<_, _>>()?,
    };
    Ok(PathRec {
        gpu,
        hca,
        class,
        acs_redirect,
        iommu_translated: matches!(iommu.as_str(), "dma" | "dma-fq"),
        iommu,
        registrations,
        failures,
        last_failure: l.opt("last_failure")?.map(str::to_string),
        policy_refusals: l.num("policy_refusals")?,
    })
}

pub fn parse_paths(text: &str) -> Records<PathRec> {
    records(
        text,
        path_line,
        |r| (pci_key(&r.gpu), pci_key(&r.hca)),
        |r| format!("gpu={} hca={}", r.gpu, r.hca),
    )
}

pub fn parse_gpus(text: &str) -> Records<GpuRec> {
    records(
        text,
        |l| {
            Ok(GpuRec {
                gpu: l.get("gpu")?.into(),
                live: l.num("live")?,
                pinned_bytes: l.num("pinned_bytes")?,
                max_pinned_bytes: l.num("max_pinned_bytes")?,
                bar1_size: l.num("bar1_size").ok(),
                bar1_used: l.num("bar1_used").ok(),
                bar1_refused: l.num("bar1_refused").ok(),
            })
        },
        |r| pci_key(&r.gpu),
        |r| format!("gpu={}", r.gpu),
    )
}

pub fn parse_processes(text: &str) -> Records<ProcRec> {
    records(
        text,
        |l| {
            Ok(ProcRec {
                tgid: l.num("tgid")?,
                // A task may name itself "" (prctl PR_SET_NAME).
                comm: l.any("comm")?.into(),
                live: l.num("live")?,
                pinned_bytes: l.num("pinned_bytes")?,
            })
        },
        |r| r.tgid,
        |r| format!("tgid={}", r.tgid),
    )
}

/// The module's `path_policy` parameter, if reported and numeric.
pub fn path_policy(m: &Module) -> Option<u64> {
    m.parameters
        .iter()
        .find(|(n, _)| n == "path_policy")
        .and_then(|(_, v)| v.as_ref().ok()?.parse().ok())
}

/// What a `path_policy` value means.
pub fn policy_meaning(p: u64) -> String {
    match p {
        0 => "allow all paths".into(),
        n => match CLASSES.get(n as usize - 1) {
            Some(c) => format!("refuse paths worse than {c}"),
            None => "unknown policy".into(),
        },
    }
}

/// Pairs as one JSON object, in their order.
pub(crate) struct Obj<K, V>(pub(crate) Vec<(K, V)>);

impl<K: Serialize, V: Serialize> Serialize for Obj<K, V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_lines() {
        let r = parse_paths(
            "gpu=0000:00:04.0 hca=0000:00:02.0 class=SYS acs_redirect=1 iommu=dma-fq registrations=0 failures=- last_failure=- policy_refusals=3 future=1\n\
             \n\
             gpu=0000:00:03.0 hca=0000:00:02.0 class=PHB acs_redirect=0 iommu=dma registrations=12 failures=EOPNOTSUPP:1,ENOMEM:2 last_failure=EOPNOTSUPP policy_refusals=0\n\
             gpu=0000:00:03.0 hca=0000:00:02.0 class=PIX acs_redirect=0 iommu=none registrations=1 failures=- last_failure=- policy_refusals=0\n\
             gpu=0000:00:05.0 hca=x class=PIX acs_redirect=2 iommu=none registrations=1 failures=- last_failure=- policy_refusals=0\n\
             gpu=0000:00:05.0 hca=x class=PIX acs_redirect=0 iommu=none registrations=1 failures=E:x last_failure=- policy_refusals=0\n\
             gpu=0000:00:05.0 hca=x class=PIX\n\
             junk\n",
        );
        assert_eq!(r.records.len(), 2);
        let a = &r.records[0];
        assert_eq!((a.gpu.as_str(), a.class.as_str()), ("0000:00:03.0", "PHB"));
        // Earlier releases' errno histogram: its sum.
        assert_eq!(a.failures, 3);
        assert_eq!(a.last_failure.as_deref(), Some("EOPNOTSUPP"));
        assert!(a.iommu_translated && !a.acs_redirect);
        let b = &r.records[1];
        assert!(b.acs_redirect && b.iommu_translated && b.failures == 0);
        assert_eq!(b.policy_refusals, 3);
        assert_eq!(r.errors.len(), 5, "{:?}", r.errors);
        assert!(r.errors[0].starts_with("line 4: gpu=0000:00:03.0 hca=0000:00:02.0 repeated"));
        assert!(r.errors[1].contains("acs_redirect"));
        assert!(r.errors[3].contains("no acs_redirect"), "{:?}", r.errors);
        assert!(r.errors[4].starts_with("line 8: not key=value"));
    }

    /// This release's line (`sysfs::from_files`): sorted fields, a count of
    /// failures.
    #[test]
    fn path_line_of_files() {
        let r = parse_paths(
            "gpu=0000:00:03.0 hca=0000:00:02.0 acs_redirect=0 class=PHB failures=4 iommu=dma last_failure=EPERM policy_refusals=4 registrations=2\n",
        );
        assert_eq!(r.errors, Vec::<String>::new());
        let a = &r.records[0];
        assert_eq!((a.failures, a.policy_refusals, a.registrations), (4, 4, 2));
        assert_eq!(a.last_failure.as_deref(), Some("EPERM"));
        assert!(parse_paths("gpu=a hca=b acs_redirect=0 class=PHB failures=x iommu=dma last_failure=- policy_refusals=0 registrations=0\n").records.is_empty());
    }

    #[test]
    fn gpu_and_process_lines() {
        let g = parse_gpus(
            "gpu=0000:00:03.0 live=3 pinned_bytes=196608 max_pinned_bytes=262144\ngpu=a live=1\n",
        );
        assert_eq!(g.records.len(), 1);
        assert_eq!(g.records[0].max_pinned_bytes, 262144);
        assert_eq!(g.errors, ["line 2: no pinned_bytes"]);
        let p = parse_processes(
            "tgid=9 comm=b live=1 pinned_bytes=1\ntgid=8 comm= live=2 pinned_bytes=3\ntgid=x comm=c live=1 pinned_bytes=1\n",
        );
        assert_eq!(p.records.iter().map(|p| p.tgid).collect::<Vec<_>>(), [8, 9]);
        assert_eq!(p.records[0].comm, "");
        assert_eq!(p.errors.len(), 1);
    }

    #[test]
    fn pci_order() {
        let mut v = vec![
            "0000:81:00.0",
            "zz",
            "0000:0a:00.1",
            "10000:00:00.0",
            "0000:0a:00.0",
        ];
        v.sort_by_key(|s| pci_key(s));
        assert_eq!(
            v,
            [
                "0000:0a:00.0",
                "0000:0a:00.1",
                "0000:81:00.0",
                "10000:00:00.0",
                "zz"
            ]
        );
    }

    #[test]
    fn policies() {
        assert_eq!(policy_meaning(0), "allow all paths");
        assert_eq!(policy_meaning(1), "refuse paths worse than PIX");
        assert_eq!(policy_meaning(5), "refuse paths worse than SYS");
        assert_eq!(policy_meaning(6), "unknown policy");
    }
}
