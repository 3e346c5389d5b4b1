// SPDX-License-Identifier: GPL-2.0 OR MIT

//! The path-diagnostics views: `paths` (a GPU x HCA matrix like
//! `nvidia-smi topo -m`), `--by-gpu` and `--by-process`, as tables or JSON.

use std::fmt::Write;

use serde::{ser::SerializeMap, Serialize, Serializer};

use crate::{
    diag::{self, pci_key, GpuRec, PathRec, ProcRec, Records, Table},
    snapshot::Snapshot,
};

/// Under the matrix, like nvidia-smi's legend.
pub const LEGEND: &str = "\
Legend:
  PIX  = at most one PCIe switch between GPU and HCA
  PXB  = several PCIe switches, not through the host bridge
  PHB  = through a PCIe host bridge (the CPU)
  NODE = across PCIe host bridges within a NUMA node
  SYS  = across NUMA nodes (the SMP interconnect)
  +A   = a bridge on the path redirects peer requests (ACS)
  +I   = the HCA's DMA is translated by the IOMMU (dma, dma-fq)
  -    = path not classified, or pair not seen
";

/// A matrix cell: the class (`-` when unknown) and its marks.
pub fn cell(p: &PathRec) -> String {
    let mut c = if p.class == "unknown" || p.class.is_empty() {
        "-".to_string()
    } else {
        p.class.clone()
    };
    if p.acs_redirect {
        c.push_str("+A");
    }
    if p.iommu_translated {
        c.push_str("+I");
    }
    c
}

/// Distinct values, sorted by PCI address.
fn addresses<'a>(it: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut v: Vec<&str> = it.collect();
    v.sort_by_cached_key(|s| pci_key(s));
    v.dedup();
    v
}

fn unreadable(o: &mut String, file: &str, errors: &[String]) -> std::fmt::Result {
    if !errors.is_empty() {
        writeln!(o, "Unreadable lines of {file}")?;
        for e in errors {
            writeln!(o, "  {e}")?;
        }
    }
    Ok(())
}

/// `peermem-stat paths`.
pub fn paths(s: &Snapshot) -> String {
    let mut o = String::new();
    // Writing into a String cannot fail.
    let _ = write_paths(&mut o, s);
    o
}

fn write_paths(o: &mut String, s: &Snapshot) -> std::fmt::Result {
    let r = match &s.diag.paths {
        Ok(r) => r,
        Err(why) => return writeln!(o, "Paths: unavailable: {why}"),
    };
    write!(o, "GPU/HCA paths ({})", r.file)?;
    match diag::path_policy(&s.module) {
        Some(p) => writeln!(o, ", path policy {p} ({})", diag::policy_meaning(p))?,
        None => writeln!(o)?,
    }
    if r.records.is_empty() {
        writeln!(o, "  no GPU/HCA pair recorded yet")?;
        return unreadable(o, r.file, &r.errors);
    }
    let gpus = addresses(r.records.iter().map(|p| p.gpu.as_str()));
    let hcas = addresses(r.records.iter().map(|p| p.hca.as_str()));
    let cells: Vec<Vec<String>> = gpus
        .iter()
        .map(|g| {
            hcas.iter()
                .map(|h| {
                    r.records
                        .iter()
                        .find(|p| p.gpu == *g && p.hca == *h)
                        .map_or_else(|| "-".into(), cell)
                })
                .collect()
        })
        .collect();
    let label = |i: usize, g: &str| format!("GPU{i} {g}");
    let lw = gpus
        .iter()
        .enumerate()
        .map(|(i, g)| label(i, g).len())
        .max()
        .unwrap_or(0);
    let cw = cells
        .iter()
        .flatten()
        .map(String::len)
        .chain((0..hcas.len()).map(|i| format!("HCA{i}").len()))
        .max()
        .unwrap_or(0);
    let mut head = format!("{:lw$}", "");
    for i in 0..hcas.len() {
        let _ = write!(head, "  {:<cw$}", format!("HCA{i}"));
    }
    writeln!(o, "{}", head.trim_end())?;
    for (i, (g, row)) in gpus.iter().zip(&cells).enumerate() {
        let mut line = format!("{:<lw$}", label(i, g));
        for c in row {
            let _ = write!(line, "  {c:<cw$}");
        }
        writeln!(o, "{}", line.trim_end())?;
    }
    writeln!(o)?;
    writeln!(o, "HCA Legend:")?;
    for (i, h) in hcas.iter().enumerate() {
        writeln!(o, "  HCA{i}: {h}")?;
    }
    writeln!(o)?;
    o.push_str(LEGEND);
    writeln!(o)?;

    let rows: Vec<[String; 9]> = r
        .records
        .iter()
        .map(|p| {
            [
                p.gpu.clone(),
                p.hca.clone(),
                p.class.clone(),
                if p.acs_redirect { "1" } else { "0" }.into(),
                p.iommu.clone(),
                p.registrations.to_string(),
                p.policy_refusals.to_string(),
                p.failures.to_string(),
                p.last_failure.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let head = [
        "gpu",
        "hca",
        "class",
        "acs",
        "iommu",
        "registrations",
        "policy_refusals",
        "failures",
        "last_failure",
    ];
    // Counts right-aligned, words left-aligned.
    let right = [false, false, false, true, false, true, true, true, false];
    writeln!(o, "Pairs")?;
    columns(o, &head, &right, &rows)?;
    unreadable(o, r.file, &r.errors)
}

/// Writes `rows` under `head`, each column as wide as its widest entry.
fn columns<const N: usize>(
    o: &mut String,
    head: &[&str; N],
    right: &[bool; N],
    rows: &[[String; N]],
) -> std::fmt::Result {
    let mut w = head.map(str::len);
    for r in rows {
        for (w, c) in w.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |o: &mut String, cells: [&str; N]| {
        let mut l = String::from(" ");
        for i in 0..N {
            let w = w[i];
            let _ = if right[i] {
                write!(l, " {:>w$}", cells[i])
            } else {
                write!(l, " {:<w$}", cells[i])
            };
        }
        writeln!(o, "{}", l.trim_end())
    };
    line(o, *head)?;
    for r in rows {
        line(o, std::array::from_fn(|i| r[i].as_str()))?;
    }
    Ok(())
}

/// `peermem-stat --by-gpu`.
pub fn by_gpu(s: &Snapshot) -> String {
    let mut o = String::new();
    let _ = write_table(&mut o, "GPUs", &s.diag.gpus, |o, r| {
        let head = ["gpu", "live", "pinned_bytes", "max_pinned_bytes"];
        let mut rows: Vec<[String; 4]> = r
            .records
            .iter()
            .map(|g: &GpuRec| {
                [
                    g.gpu.clone(),
                    g.live.to_string(),
                    g.pinned_bytes.to_string(),
                    g.max_pinned_bytes.to_string(),
                ]
            })
            .collect();
        if r.records.len() > 1 {
            let sum = |f: fn(&GpuRec) -> u64| {
                r.records
                    .iter()
                    .fold(0u64, |a, g| a.saturating_add(f(g)))
                    .to_string()
            };
            rows.push([
                "total".into(),
                sum(|g| g.live),
                sum(|g| g.pinned_bytes),
                "-".into(),
            ]);
        }
        columns(o, &head, &[false, true, true, true], &rows)
    });
    o
}

/// `peermem-stat --by-process`.
pub fn by_process(s: &Snapshot) -> String {
    let mut o = String::new();
    let _ = write_table(
        &mut o,
        "Processes with live registrations",
        &s.diag.processes,
        |o, r| {
            let head = ["tgid", "comm", "live", "pinned_bytes"];
            let rows: Vec<[String; 4]> = r
                .records
                .iter()
                .map(|p: &ProcRec| {
                    [
                        p.tgid.to_string(),
                        p.comm.clone(),
                        p.live.to_string(),
                        p.pinned_bytes.to_string(),
                    ]
                })
                .collect();
            columns(o, &head, &[true, false, true, true], &rows)
        },
    );
    o
}

fn write_table<T>(
    o: &mut String,
    title: &str,
    t: &Table<T>,
    body: impl FnOnce(&mut String, &Records<T>) -> std::fmt::Result,
) -> std::fmt::Result {
    let r = match t {
        Ok(r) => r,
        Err(why) => return writeln!(o, "{title}: unavailable: {why}"),
    };
    if r.records.is_empty() {
        writeln!(o, "{title}: none ({})", r.file)?;
    } else {
        writeln!(o, "{title} ({})", r.file)?;
        body(o, r)?;
    }
    unreadable(o, r.file, &r.errors)
}

/// A view as JSON: `{"<key>": [records] | null, "<key>_error": why | null,
/// "errors": [...]}`, for paths after `"path_policy"`.
pub struct ViewJson<'a, T> {
    key: &'static str,
    table: &'a Table<T>,
    path_policy: Option<Option<u64>>,
}

impl<T: Serialize> Serialize for ViewJson<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        if let Some(p) = &self.path_policy {
            m.serialize_entry("path_policy", p)?;
        }
        let (records, error, errors) = match self.table {
            Ok(r) => (Some(&r.records), None, &r.errors[..]),
            Err(why) => (None, Some(why), &[][..]),
        };
        m.serialize_entry(self.key, &records)?;
        m.serialize_entry(&format!("{}_error", self.key), &error)?;
        m.serialize_entry("errors", errors)?;
        m.end()
    }
}

/// `paths --json`: the pairs, plus the module's path policy.
pub fn paths_json(s: &Snapshot) -> ViewJson<'_, PathRec> {
    ViewJson {
        key: "paths",
        table: &s.diag.paths,
        path_policy: Some(diag::path_policy(&s.module)),
    }
}

/// `--by-gpu --json`.
pub fn by_gpu_json(s: &Snapshot) -> ViewJson<'_, GpuRec> {
    ViewJson {
        key: "gpus",
        table: &s.diag.gpus,
        path_policy: None,
    }
}

/// `--by-process --json`.
pub fn by_process_json(s: &Snapshot) -> ViewJson<'_, ProcRec> {
    ViewJson {
        key: "processes",
        table: &s.diag.processes,
        path_policy: None,
    }
}
