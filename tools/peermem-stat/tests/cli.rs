// SPDX-License-Identifier: GPL-2.0 OR MIT

//! peermem-stat against fake sysfs trees (and the debugfs of a peermem-rs
//! older than its sysfs views).

use std::{
    fs,
    io::{BufRead, BufReader},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
};

use peermem_stat::{render::Rates, snapshot::Snapshot, sysfs::Sys};
use prometheus_parse::{Scrape, Value as PromValue};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_peermem-stat");

/// A fake root, removed on drop.
struct Tree(PathBuf);

impl Tree {
    fn new(name: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "peermem-stat-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Tree(dir)
    }

    fn at(&self, abs: &str) -> PathBuf {
        self.0.join(abs.trim_start_matches('/'))
    }

    /// Writes a file atomically (a running reader never sees it half-written).
    fn file(&self, abs: &str, content: impl AsRef<[u8]>) -> &Self {
        let p = self.at(abs);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        let tmp = p.with_extension("tmp~");
        fs::write(&tmp, content).unwrap();
        fs::rename(&tmp, &p).unwrap();
        self
    }

    fn dir(&self, abs: &str) -> &Self {
        fs::create_dir_all(self.at(abs)).unwrap();
        self
    }

    fn root(&self) -> &Path {
        &self.0
    }

    /// Runs the tool in-process: (exit status, stdout, stderr).
    fn run(&self, args: &[&str]) -> (i32, String, String) {
        let mut all = vec!["--root".to_string(), self.0.display().to_string()];
        all.extend(args.iter().map(|s| s.to_string()));
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = peermem_stat::run(all, &mut out, &mut err, false);
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    fn json(&self) -> Value {
        let (code, out, err) = self.run(&["--json"]);
        assert_eq!(out.lines().count(), 1, "one line: {out}");
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        assert!(code == 0 || code == 2, "exit {code}: {err}");
        v
    }

    /// Our module, loaded, with every counter, its two clients and nvidia.
    fn ours(name: &str) -> Self {
        let t = Tree::new(name);
        t.file("/sys/module/nvidia_peermem/version", "0.1.0\n")
            .file(
                "/sys/module/nvidia_peermem/parameters/persistent_api_support",
                "0\n",
            )
            .file(
                "/sys/module/nvidia_peermem/parameters/peerdirect_support",
                "1\n",
            )
            .file("/sys/module/nvidia_peermem/refcnt", "2\n")
            .file("/sys/module/nvidia_peermem/stats/counters", STATS)
            .file("/sys/kernel/debug/nv_p2p_emu/inject", "")
            .file("/sys/module/nvidia/version", "580.65.06\n")
            .file("/proc/sys/kernel/osrelease", "7.3.0-1-amd64\n");
        peer(&t, "nv_mem", 10, 7, 1_048_576, 851_968);
        peer(&t, "nv_mem_nc", 4, 4, 8192, 8192);
        t
    }

    /// The module's views moved to where a peermem-rs older than its sysfs
    /// views kept them: debugfs (`counters` was `stats` there).
    fn into_debugfs(self) -> Self {
        fs::create_dir_all(self.at(OLD)).unwrap();
        for (new, old) in [
            ("counters", "stats"),
            ("paths", "paths"),
            ("gpus", "gpus"),
            ("processes", "processes"),
        ] {
            let from = self.at(&format!("{VIEWS}/{new}"));
            if from.exists() {
                fs::rename(from, self.at(&format!("{OLD}/{old}"))).unwrap();
            }
        }
        fs::remove_dir(self.at(VIEWS)).unwrap();
        self
    }

    /// The module's tables turned into this release's layout: a file per
    /// counter and per field of each GPU and pair (the failures counted,
    /// no longer by errno), the parameters only in `parameters/`, and the
    /// processes in root's debugfs file.
    fn into_files(self) -> Self {
        let read = |n: &str| fs::read_to_string(self.at(&format!("{VIEWS}/{n}")));
        let (counters, procs) = (read("counters").unwrap(), read("processes"));
        let tables = [("paths", read("paths")), ("gpus", read("gpus"))];
        fs::remove_dir_all(self.at(VIEWS)).unwrap();
        fs::create_dir_all(self.at(&format!("{VIEWS}/counters"))).unwrap();
        for (n, v) in counters.lines().filter_map(|l| l.split_once(' ')) {
            match n.strip_prefix("param_") {
                Some(p) => self.file(&format!("{MODULE_DIR}/parameters/{p}"), format!("{v}\n")),
                None => self.file(&format!("{VIEWS}/counters/{n}"), format!("{v}\n")),
            };
        }
        for (view, text) in tables {
            fs::create_dir_all(self.at(&format!("{VIEWS}/{view}"))).unwrap();
            for line in text.unwrap_or_default().lines() {
                let f: Vec<(&str, &str)> = line
                    .split_whitespace()
                    .filter_map(|w| w.split_once('='))
                    .collect();
                let get = |k: &str| f.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
                let dir = match get("hca") {
                    Some(hca) => format!("{}-{hca}", get("gpu").unwrap()),
                    None => get("gpu").unwrap().to_string(),
                };
                for (k, v) in f.iter().filter(|(k, _)| !["gpu", "hca"].contains(k)) {
                    let v = match *k {
                        "failures" => v
                            .split(',')
                            .filter_map(|e| e.split_once(':')?.1.parse::<u64>().ok())
                            .sum::<u64>()
                            .to_string(),
                        _ => v.to_string(),
                    };
                    self.file(&format!("{VIEWS}/{view}/{dir}/{k}"), format!("{v}\n"));
                }
            }
        }
        if let Ok(p) = procs {
            self.file(&format!("{OLD}/processes"), p);
        }
        self
    }

    /// Debugfs not mounted: its mount point empty, as in a container.
    fn unmount_debugfs(&self) -> &Self {
        fs::remove_dir_all(self.at("/sys/kernel/debug")).unwrap();
        fs::create_dir(self.at("/sys/kernel/debug")).unwrap();
        self
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

const STATS: &str = "live_registrations 3
pinned_bytes 196608
acquired 12
declined 1
registrations 11
releases 8
invalidations 2
core_invalidations 2
sg_entries 40
fail_bad_range 0
fail_pin 0
fail_page_table 0
fail_not_pci 0
fail_dma_map 5
fail_dma_mapping 0
fail_no_memory 0
fail_revoked 0
fail_unpin 0
fail_order 0
";

fn peer(t: &Tree, name: &str, alloc: u64, dealloc: u64, reg: u64, dereg: u64) {
    let d = format!("/sys/kernel/mm/memory_peers/{name}");
    t.file(&format!("{d}/version"), "0.1.0\n")
        .file(&format!("{d}/num_alloc_mrs"), format!("{alloc}\n"))
        .file(&format!("{d}/num_dealloc_mrs"), format!("{dealloc}\n"))
        .file(&format!("{d}/num_reg_pages"), format!("{}\n", reg / 4096))
        .file(
            &format!("{d}/num_dereg_pages"),
            format!("{}\n", dereg / 4096),
        )
        .file(&format!("{d}/num_reg_bytes"), format!("{reg}\n"))
        .file(&format!("{d}/num_dereg_bytes"), format!("{dereg}\n"))
        .file(&format!("{d}/num_free_callbacks"), "2\n");
}

/// (enabled, path) per stack.
fn detection(v: &Value) -> Vec<(String, bool, Option<String>)> {
    v["detection"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["stack"].as_str().unwrap().to_string(),
                d["enabled"].as_bool().unwrap(),
                d["path"].as_str().map(str::to_string),
            )
        })
        .collect()
}

fn det(stack: &str, path: Option<&str>) -> (String, bool, Option<String>) {
    (stack.to_string(), path.is_some(), path.map(str::to_string))
}

const NV_MEM: &str = "/sys/kernel/mm/memory_peers/nv_mem/version";
/// The module's operator views (sysfs).
const VIEWS: &str = "/sys/module/nvidia_peermem/stats";
const MODULE_DIR: &str = "/sys/module/nvidia_peermem";
/// Where a peermem-rs older than its sysfs views kept them (debugfs).
const OLD: &str = "/sys/kernel/debug/nvidia_peermem";
const NV_MEM_NC: &str = "/sys/kernel/mm/memory_peers/nv_mem_nc/version";
const MODULE: &str = "/sys/module/nvidia_peermem/version";

#[test]
fn json_of_our_module() {
    let t = Tree::ours("ours");
    let v = t.json();
    let m = &v["module"];
    assert_eq!(m["loaded"], true);
    assert_eq!(m["version"], "0.1.0");
    assert_eq!(m["implementation"], "peermem-rs");
    assert_eq!(m["refcnt"], 2);
    assert_eq!(m["parameters"]["persistent_api_support"], "0");
    assert_eq!(m["parameters"]["peerdirect_support"], "1");
    let s = &v["stats"];
    assert_eq!(s.as_object().unwrap().len(), 19);
    assert_eq!(s["live_registrations"], 3);
    assert_eq!(s["pinned_bytes"], 196608);
    assert_eq!(s["registrations"], 11);
    assert_eq!(s["fail_dma_map"], 5);
    assert_eq!(s["fail_order"], 0);
    assert_eq!(v["stats_error"], Value::Null);
    let p = &v["peers"];
    assert_eq!(p.as_object().unwrap().len(), 2);
    assert_eq!(p["nv_mem"]["version"], "0.1.0");
    assert_eq!(p["nv_mem"]["num_alloc_mrs"], 10);
    assert_eq!(p["nv_mem"]["num_reg_pages"], 256);
    assert_eq!(p["nv_mem"]["num_free_callbacks"], 2);
    assert_eq!(p["nv_mem"]["live_mrs"], 3);
    assert_eq!(p["nv_mem"]["live_bytes"], 196608);
    assert_eq!(p["nv_mem_nc"]["live_mrs"], 0);
    assert_eq!(p["nv_mem_nc"]["live_bytes"], 0);
    assert_eq!(
        detection(&v),
        [
            det("NCCL", Some(NV_MEM)),
            det("UCX", Some(NV_MEM)),
            det("Open MPI", Some(NV_MEM)),
            det("NVSHMEM", Some(NV_MEM)),
            det("nvidia-fs", Some(NV_MEM)),
        ]
    );
    let d = &v["dmabuf"];
    assert_eq!(d["nvidia_loaded"], true);
    assert_eq!(d["nvidia_version"], "580.65.06");
    assert_eq!(d["kernel"], "7.3.0-1-amd64");
    assert_eq!(d["driver_ok"], true);
    assert_eq!(d["kernel_ok"], true);
    assert_eq!(v["rates"], Value::Null);
    assert_eq!(v["errors"], serde_json::json!([]));
    // Stable key order.
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(keys.len(), 8);
}

#[test]
fn table_of_our_module() {
    let t = Tree::ours("table");
    let (code, out, err) = t.run(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("nvidia_peermem: loaded, version 0.1.0, refcnt 2, implementation peermem-rs")
    );
    assert!(out.contains("parameters: peerdirect_support=1 persistent_api_support=0"));
    let line = |name: &str| out.lines().find(|l| l.trim_start().starts_with(name));
    let lr = line("live_registrations ").expect(&out);
    assert!(lr.split_whitespace().nth(1) == Some("3"), "{lr}");
    assert!(line("fail_dma_map ").unwrap().contains(" 5 "));
    // Zero failures hidden unless --all.
    assert!(line("fail_pin ").is_none(), "{out}");
    assert!(out.contains("9 zero failure counters hidden"));
    let nv = line("nv_mem ").expect(&out);
    let cols: Vec<&str> = nv.split_whitespace().collect();
    assert_eq!(&cols[..5], ["nv_mem", "0.1.0", "3", "196608", "10"]);
    assert!(out.contains("NCCL      YES  /sys/kernel/mm/memory_peers/nv_mem/version"));
    assert!(out.contains("Open MPI  YES"));
    assert!(out.contains("version 580.65.06 (ok)"));
    assert!(!out.contains("Unreadable"));

    let (_, all, _) = t.run(&["--all"]);
    assert!(all.lines().any(|l| l.trim_start().starts_with("fail_pin ")));
    assert!(all
        .lines()
        .any(|l| l.trim_start().starts_with("fail_order ")));
    assert!(!all.contains("zero failure counters hidden"));
}

#[test]
fn detection_combinations() {
    let none = Tree::new("none");
    let v = none.json();
    assert_eq!(
        detection(&v),
        [
            det("NCCL", None),
            det("UCX", None),
            det("Open MPI", None),
            det("NVSHMEM", None),
            det("nvidia-fs", None)
        ]
    );
    assert_eq!(v["module"]["loaded"], false);
    assert_eq!(v["module"]["implementation"], Value::Null);
    assert_eq!(v["dmabuf"]["nvidia_loaded"], false);

    let module_only = Tree::new("module-only");
    module_only.file(MODULE, "0.1.0\n");
    assert_eq!(
        detection(&module_only.json()),
        [
            det("NCCL", Some(MODULE)),
            det("UCX", Some(MODULE)),
            det("Open MPI", None),
            det("NVSHMEM", Some(MODULE)),
            det("nvidia-fs", None)
        ]
    );
    let (_, out, _) = module_only.run(&[]);
    assert!(out.contains("Open MPI  NO"), "{out}");
    assert!(out.contains("NCCL      YES  /sys/module/nvidia_peermem/version"));

    let nv_mem_only = Tree::new("nv-mem-only");
    nv_mem_only.file(NV_MEM, "1.0\n");
    let v = nv_mem_only.json();
    assert_eq!(
        detection(&v),
        [
            det("NCCL", Some(NV_MEM)),
            det("UCX", Some(NV_MEM)),
            det("Open MPI", Some(NV_MEM)),
            det("NVSHMEM", Some(NV_MEM)),
            det("nvidia-fs", Some(NV_MEM))
        ]
    );
    assert_eq!(v["module"]["loaded"], false);
    assert_eq!(v["peers"]["nv_mem"]["version"], "1.0");
    assert_eq!(v["peers"]["nv_mem"]["live_mrs"], Value::Null);

    let nc_only = Tree::new("nc-only");
    nc_only.file(NV_MEM_NC, "1.0\n");
    assert_eq!(
        detection(&nc_only.json()),
        [
            det("NCCL", Some(NV_MEM_NC)),
            det("UCX", None),
            det("Open MPI", None),
            det("NVSHMEM", None),
            det("nvidia-fs", None)
        ]
    );
}

#[test]
fn nvidia_c_module_and_missing_views() {
    // NVIDIA's module: version file, debugfs mounted, no views of ours.
    let c = Tree::new("c-module");
    c.file(MODULE, "580.65.06\n")
        .file("/sys/module/nvidia_peermem/refcnt", "0\n")
        .dir("/sys/kernel/debug/dri");
    let v = c.json();
    assert_eq!(v["module"]["loaded"], true);
    assert_eq!(v["module"]["implementation"], "other");
    assert_eq!(v["stats"], Value::Null);
    let c_module = "no /sys/module/nvidia_peermem/stats nor /sys/kernel/debug/nvidia_peermem: \
                    NVIDIA's C module, which has no counters";
    assert_eq!(v["stats_error"], c_module);
    let (code, out, _) = c.run(&[]);
    assert_eq!(code, 0);
    assert!(
        out.contains(&format!("Counters: unavailable: {c_module}\n")),
        "{out}"
    );
    assert!(out.contains("implementation other"));

    // Our module, debugfs not mounted: its sysfs views need none.
    let t = Tree::ours("no-debugfs");
    t.unmount_debugfs();
    let v = t.json();
    assert_eq!(v["stats"]["registrations"], 11);
    assert_eq!(v["stats_error"], Value::Null);
    assert_eq!(v["module"]["implementation"], "peermem-rs");

    // An older peermem-rs (debugfs only), debugfs not mounted: say so,
    // show the rest.
    let t = Tree::ours("no-debugfs-old").into_debugfs();
    t.unmount_debugfs();
    let v = t.json();
    assert_eq!(v["stats"], Value::Null);
    assert_eq!(v["module"]["implementation"], Value::Null);
    let e = v["stats_error"].as_str().unwrap();
    assert!(e.contains("mount -t debugfs none /sys/kernel/debug"), "{e}");
    assert_eq!(v["peers"]["nv_mem"]["live_mrs"], 3);
    let (code, out, _) = t.run(&[]);
    assert_eq!(code, 0);
    assert!(out.contains(
        "Counters: unavailable: no /sys/module/nvidia_peermem/stats: NVIDIA's C module (it has \
         no counters), or a peermem-rs older than its sysfs views with debugfs not mounted"
    ));
    assert!(out.contains("Peer-memory clients"));
}

#[test]
fn malformed_files_do_not_panic() {
    let t = Tree::ours("malformed");
    t.file(
        "/sys/module/nvidia_peermem/stats/counters",
        "live_registrations 3\npinned_bytes abc\n\n  \nlonely\nregistrations 1 2\nacquired 99999999999999999999\nreleases 4\n",
    )
    .file("/sys/module/nvidia_peermem/refcnt", "-1\n")
    .file("/sys/module/nvidia_peermem/version", b"0.1\"\\\x01\xff\n")
    .file("/sys/kernel/mm/memory_peers/nv_mem/num_alloc_mrs", "zz\n")
    .file("/sys/kernel/mm/memory_peers/nv_mem/num_reg_bytes", "")
    .file("/sys/module/nvidia/version", "garbage\n")
    .file("/proc/sys/kernel/osrelease", "\n");
    let v = t.json();
    assert_eq!(v["module"]["version"], "0.1\"\\\u{1}\u{fffd}");
    assert_eq!(v["module"]["refcnt"], Value::Null);
    let s = &v["stats"];
    assert_eq!(s["live_registrations"], 3);
    assert_eq!(s["releases"], 4);
    for bad in ["pinned_bytes", "lonely", "registrations", "acquired"] {
        assert_eq!(s[bad], Value::Null, "{bad}");
    }
    assert_eq!(v["peers"]["nv_mem"]["num_alloc_mrs"], Value::Null);
    assert_eq!(v["peers"]["nv_mem"]["live_mrs"], Value::Null);
    assert_eq!(v["peers"]["nv_mem"]["live_bytes"], Value::Null);
    assert_eq!(v["peers"]["nv_mem_nc"]["live_mrs"], 0);
    assert_eq!(v["dmabuf"]["driver_ok"], Value::Null);
    assert_eq!(v["dmabuf"]["kernel_ok"], Value::Null);
    let errors: Vec<&str> = v["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(errors.len(), 7, "{errors:?}");
    assert!(errors
        .iter()
        .any(|e| e.starts_with("/sys/kernel/mm/memory_peers/nv_mem/num_alloc_mrs: not a number")));
    let (code, out, _) = t.run(&["--all"]);
    assert_eq!(code, 0);
    assert!(out.contains("Unreadable fields"));
    assert!(out.contains("refcnt ERR"));

    // A directory where a file should be, and a file where a directory should be.
    // (One value per file: a directory where a counter should be.)
    for (name, counters, made) in [
        (
            "odd",
            "/sys/module/nvidia_peermem/stats/counters",
            "/sys/module/nvidia_peermem/stats/counters/registrations",
        ),
        (
            "odd-old",
            "/sys/kernel/debug/nvidia_peermem/stats",
            "/sys/kernel/debug/nvidia_peermem/stats",
        ),
    ] {
        let odd = Tree::new(name);
        odd.dir("/sys/module/nvidia_peermem/version")
            .dir(made)
            .file("/sys/kernel/mm/memory_peers", "not a dir");
        let v = odd.json();
        assert_eq!(v["module"]["loaded"], true);
        assert_eq!(v["module"]["version"], Value::Null);
        assert_eq!(v["stats"], Value::Null);
        let e = v["stats_error"].as_str().unwrap();
        assert!(e.starts_with(&format!("{counters}: ")), "{e}");
        assert_eq!(v["peers"], serde_json::json!({}));
    }
}

#[test]
fn rates_between_snapshots() {
    let t = Tree::ours("rates");
    let a = Snapshot::read(&Sys::new(t.root()));
    t.file(
        "/sys/module/nvidia_peermem/stats/counters",
        STATS
            .replace("registrations 11", "registrations 31")
            .replace("invalidations 2\n", "invalidations 7\n"),
    );
    let b = Snapshot::read(&Sys::new(t.root()));
    let r = Rates::between(&a, &b, 2.0);
    assert_eq!(r.registrations, Some(20));
    assert_eq!(r.invalidations, Some(5));
    assert_eq!(r.per_s(r.registrations), Some(10.0));
    assert_eq!(r.per_s(r.invalidations), Some(2.5));
    // Backwards (module reloaded): unknown, not a huge number.
    let r = Rates::between(&b, &a, 2.0);
    assert_eq!(r.registrations, None);
    let table = peermem_stat::render::table(&b, false, Some(&Rates::between(&a, &b, 2.0)));
    assert!(
        table.contains("rates over 2.00 s: registrations 10.0/s, invalidations 2.5/s"),
        "{table}"
    );
}

#[test]
fn watch_prints_frames_and_rates() {
    let t = Tree::ours("watch");
    // Human: two frames, the second with rates.
    let out = Command::new(BIN)
        .args([
            "--root",
            t.root().to_str().unwrap(),
            "--watch",
            "0.1",
            "--count",
            "2",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.matches("--- frame ").count(), 2, "{text}");
    assert!(text.contains("--- frame 2 "));
    assert_eq!(text.matches("rates over").count(), 1);
    assert_eq!(text.matches("nvidia_peermem: loaded").count(), 2);

    // JSON: one object per line; counters change between the frames.
    let mut child = Command::new(BIN)
        .args([
            "--root",
            t.root().to_str().unwrap(),
            "--json",
            "--watch",
            "1",
            "--count",
            "2",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    t.file(
        "/sys/module/nvidia_peermem/stats/counters",
        STATS
            .replace("registrations 11", "registrations 21")
            .replace("invalidations 2\n", "invalidations 6\n"),
    );
    let second: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert!(lines.next().is_none());
    assert!(child.wait().unwrap().success());
    assert_eq!(first["rates"], Value::Null);
    assert_eq!(first["stats"]["registrations"], 11);
    assert_eq!(second["stats"]["registrations"], 21);
    let r = &second["rates"];
    assert_eq!(r["registrations"], 10);
    assert_eq!(r["invalidations"], 4);
    let dt = r["interval_s"].as_f64().unwrap();
    assert!((0.99..10.0).contains(&dt), "interval {dt}");
    let per_s = r["registrations_per_s"].as_f64().unwrap();
    assert!((per_s - 10.0 / dt).abs() < 0.01, "{per_s} vs {dt}");
    let inv = r["invalidations_per_s"].as_f64().unwrap();
    assert!((inv - 4.0 / dt).abs() < 0.01, "{inv} vs {dt}");
}

#[test]
fn exit_codes() {
    let empty = Tree::new("empty");
    let out = Command::new(BIN)
        .args(["--root", empty.root().to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("nothing found: nvidia_peermem is not loaded"),
        "{err}"
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("nvidia_peermem: not loaded"));
    assert!(text.contains("NCCL      NO"));
    // JSON still printed, still valid.
    let (code, out, _) = empty.run(&["--json"]);
    assert_eq!(code, 2);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["peers"], serde_json::json!({}));

    // Only a peer-memory client (e.g. an OFED nv_peer_mem): found.
    let peers = Tree::new("peers-only");
    peers.file(NV_MEM, "1.0\n");
    assert_eq!(peers.run(&[]).0, 0);

    for bad in [&["--bogus"][..], &["--watch", "x"], &["--count", "3"]] {
        let out = Command::new(BIN).args(bad).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{bad:?}");
        assert!(String::from_utf8(out.stderr).unwrap().contains("--help"));
    }
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8(out.stdout)
        .unwrap()
        .starts_with("peermem-stat: "));
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("peermem-stat {}\n", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn parameters_from_counters_when_sysfs_has_none() {
    // Linux 7.3 gives Rust module parameters no parameters/ files: the
    // module reports them as param_* lines in its counters.
    let t = Tree::new("params-counters");
    t.file(MODULE, "0.1.0\n").file(
        "/sys/module/nvidia_peermem/stats/counters",
        format!("{STATS}param_persistent_api_support 1\nparam_peerdirect_support 0\n"),
    );
    let v = t.json();
    assert_eq!(v["module"]["parameters"]["persistent_api_support"], "1");
    assert_eq!(v["module"]["parameters"]["peerdirect_support"], "0");
    assert_eq!(v["stats"]["live_registrations"], 3);
    assert!(v["stats"].get("param_persistent_api_support").is_none());
    let (_, out, _) = t.run(&[]);
    assert!(
        out.contains("parameters: peerdirect_support=0 persistent_api_support=1"),
        "{out}"
    );
    // parameters/ wins where it has the parameter.
    t.file(
        "/sys/module/nvidia_peermem/parameters/persistent_api_support",
        "0\n",
    );
    assert_eq!(
        t.json()["module"]["parameters"]["persistent_api_support"],
        "0"
    );
    // An older peermem-rs: the same lines, from debugfs.
    let t = Tree::new("params-counters-old");
    t.file(MODULE, "0.1.0\n").file(
        &format!("{OLD}/stats"),
        format!("{STATS}param_path_policy 3\n"),
    );
    let v = t.json();
    assert_eq!(v["module"]["parameters"]["path_policy"], "3");
    assert!(v["stats"].get("param_path_policy").is_none());
}

// Path diagnostics: paths, gpus, processes.

/// Two GPUs x two HCAs, every mark, lines out of order.
const PATHS: &str = "\
gpu=0000:81:00.0 hca=0000:82:00.0 class=NODE acs_redirect=1 iommu=identity registrations=7 failures=- last_failure=- policy_refusals=0
gpu=0000:00:03.0 hca=0000:82:00.0 class=SYS acs_redirect=1 iommu=dma registrations=0 failures=EREMOTEIO:4 last_failure=EREMOTEIO policy_refusals=9
gpu=0000:00:03.0 hca=0000:00:02.0 class=PIX acs_redirect=0 iommu=none registrations=12 failures=EOPNOTSUPP:1,ENOMEM:2 last_failure=EOPNOTSUPP policy_refusals=0
gpu=0000:81:00.0 hca=0000:00:02.0 class=unknown acs_redirect=0 iommu=dma-fq registrations=3 failures=- last_failure=- policy_refusals=0
";

const GPUS: &str = "\
gpu=0000:81:00.0 live=1 pinned_bytes=65536 max_pinned_bytes=1048576
gpu=0000:00:03.0 live=3 pinned_bytes=196608 max_pinned_bytes=262144
";

const PROCESSES: &str = "\
tgid=123 comm=peermem-e2e live=2 pinned_bytes=131072
tgid=77 comm=say\"hi\\ live=2 pinned_bytes=131072
";

/// Our module with path diagnostics and path policy 3.
fn with_diag(name: &str) -> Tree {
    let t = Tree::ours(name);
    t.file(
        &format!("{VIEWS}/counters"),
        format!("{STATS}fail_path_policy 9\nparam_path_policy 3\n"),
    )
    .file(&format!("{VIEWS}/paths"), PATHS)
    .file(&format!("{VIEWS}/gpus"), GPUS)
    .file(&format!("{VIEWS}/processes"), PROCESSES);
    t
}

#[test]
fn paths_matrix_with_every_mark() {
    let t = with_diag("paths");
    let (code, out, err) = t.run(&["paths"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "GPU/HCA paths (/sys/module/nvidia_peermem/stats/paths), path policy 3 (refuse paths worse than PHB)"
    );
    assert_eq!(lines[1], format!("{:17}  HCA0     HCA1", ""));
    assert_eq!(lines[2], "GPU0 0000:00:03.0  PIX      SYS+A+I");
    assert_eq!(lines[3], "GPU1 0000:81:00.0  -+I      NODE+A");
    assert!(out.contains("HCA Legend:\n  HCA0: 0000:00:02.0\n  HCA1: 0000:82:00.0\n"));
    assert!(out.contains(peermem_stat::views::LEGEND), "{out}");
    for class in ["PIX", "PXB", "PHB", "NODE", "SYS", "+A", "+I"] {
        assert!(
            out.lines().any(|l| l.starts_with(&format!("  {class} "))),
            "legend of {class}"
        );
    }
    // One line per pair, sorted by GPU then HCA.
    let pairs: Vec<Vec<&str>> = out
        .lines()
        .skip_while(|l| *l != "Pairs")
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        pairs[0],
        [
            "gpu",
            "hca",
            "class",
            "acs",
            "iommu",
            "registrations",
            "policy_refusals",
            "failures",
            "last_failure"
        ]
    );
    assert_eq!(
        pairs[1..],
        [
            vec![
                "0000:00:03.0",
                "0000:00:02.0",
                "PIX",
                "0",
                "none",
                "12",
                "0",
                "3",
                "EOPNOTSUPP"
            ],
            vec![
                "0000:00:03.0",
                "0000:82:00.0",
                "SYS",
                "1",
                "dma",
                "0",
                "9",
                "4",
                "EREMOTEIO"
            ],
            vec![
                "0000:81:00.0",
                "0000:00:02.0",
                "unknown",
                "0",
                "dma-fq",
                "3",
                "0",
                "0",
                "-"
            ],
            vec![
                "0000:81:00.0",
                "0000:82:00.0",
                "NODE",
                "1",
                "identity",
                "7",
                "0",
                "0",
                "-"
            ],
        ]
    );

    // A pair the module has not seen: `-`; no policy parameter: no policy.
    let t = Tree::ours("paths-missing-pair");
    t.file(
        &format!("{VIEWS}/paths"),
        PATHS.lines().skip(1).collect::<Vec<_>>().join("\n"),
    );
    let (_, out, _) = t.run(&["paths"]);
    assert!(out.starts_with("GPU/HCA paths (/sys/module/nvidia_peermem/stats/paths)\n"));
    assert!(out.contains("\nGPU1 0000:81:00.0  -+I      -\n"), "{out}");
}

#[test]
fn absent_diagnostics_files() {
    // A module with counters only. Each view says so in one line.
    let t = Tree::ours("no-diag");
    for (args, line) in [
        (&["paths"][..], "Paths: unavailable: no /sys/module/nvidia_peermem/stats/paths: this nvidia_peermem has no path diagnostics\n"),
        (&["--by-gpu"], "GPUs: unavailable: no /sys/module/nvidia_peermem/stats/gpus: this nvidia_peermem has no path diagnostics\n"),
        (&["--by-process"], "Processes with live registrations: unavailable: no /sys/module/nvidia_peermem/stats/processes: this nvidia_peermem has no path diagnostics\n"),
    ] {
        let (code, out, err) = t.run(args);
        assert_eq!((code, out.as_str(), err.as_str()), (0, line, ""), "{args:?}");
    }
    // The other views are unaffected.
    let (code, out, _) = t.run(&[]);
    assert_eq!(code, 0);
    assert!(out.contains("Counters (") && !out.contains("Unreadable"));
    assert_eq!(t.json()["stats"]["registrations"], 11);
    // Only one file missing: the others still shown.
    t.file(&format!("{VIEWS}/gpus"), GPUS);
    assert!(t.run(&["--by-gpu"]).1.starts_with("GPUs (/sys"));
    let (_, v) = view_json(&t, "paths");
    assert_eq!(v["paths"], Value::Null);
    assert!(v["paths_error"]
        .as_str()
        .unwrap()
        .contains("no path diagnostics"));

    // An older peermem-rs with stats only, in debugfs: the same, naming
    // the debugfs files.
    let t = Tree::ours("no-diag-old").into_debugfs();
    for (args, line) in [
        (&["paths"][..], "Paths: unavailable: no /sys/kernel/debug/nvidia_peermem/paths: this nvidia_peermem has no path diagnostics\n"),
        (&["--by-gpu"], "GPUs: unavailable: no /sys/kernel/debug/nvidia_peermem/gpus: this nvidia_peermem has no path diagnostics\n"),
        (&["--by-process"], "Processes with live registrations: unavailable: no /sys/kernel/debug/nvidia_peermem/processes: this nvidia_peermem has no path diagnostics\n"),
    ] {
        let (code, out, err) = t.run(args);
        assert_eq!((code, out.as_str(), err.as_str()), (0, line, ""), "{args:?}");
    }
    assert_eq!(t.json()["stats"]["registrations"], 11);

    // Not loaded: nothing found; no views: the counters' reason.
    let none = Tree::new("no-diag-none");
    let (code, out, _) = none.run(&["paths"]);
    assert_eq!(code, 2);
    assert_eq!(out, "Paths: unavailable: nvidia_peermem is not loaded\n");
    let (code, v) = view_json(&none, "--by-process");
    assert_eq!(code, 2);
    assert_eq!(v["processes_error"], "nvidia_peermem is not loaded");
    let t = with_diag("no-diag-debugfs").into_debugfs();
    t.unmount_debugfs();
    let (code, out, _) = t.run(&["--by-gpu"]);
    assert_eq!(code, 0);
    let why = t.json()["stats_error"].as_str().unwrap().to_string();
    assert!(why.contains("debugfs not mounted"), "{why}");
    assert_eq!(out, format!("GPUs: unavailable: {why}\n"));

    // Empty files: nothing recorded yet.
    let t = Tree::ours("diag-empty");
    for f in ["paths", "gpus", "processes"] {
        t.file(&format!("{VIEWS}/{f}"), "");
    }
    assert!(t.run(&["paths"]).1.contains("no GPU/HCA pair recorded yet"));
    assert!(t
        .run(&["--by-process"])
        .1
        .starts_with("Processes with live registrations: none"));
    assert_eq!(view_json(&t, "--by-gpu").1["gpus"], serde_json::json!([]));
}

/// A view's JSON: (exit status, the one object).
fn view_json(t: &Tree, view: &str) -> (i32, Value) {
    let (code, out, err) = t.run(&[view, "--json"]);
    assert_eq!(out.lines().count(), 1, "one line: {out} {err}");
    let v = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    (code, v)
}

#[test]
fn views_as_json() {
    let t = with_diag("diag-json");
    let (code, v) = view_json(&t, "paths");
    assert_eq!(code, 0);
    assert_eq!(v["path_policy"], 3);
    assert_eq!(v["paths_error"], Value::Null);
    assert_eq!(v["errors"], serde_json::json!([]));
    let p = v["paths"].as_array().unwrap();
    assert_eq!(p.len(), 4);
    assert_eq!(
        p[0],
        serde_json::json!({
            "gpu": "0000:00:03.0", "hca": "0000:00:02.0", "class": "PIX",
            "acs_redirect": false, "iommu": "none", "iommu_translated": false,
            "registrations": 12, "failures": 3,
            "last_failure": "EOPNOTSUPP", "policy_refusals": 0
        })
    );
    assert_eq!(p[1]["acs_redirect"], true);
    assert_eq!(p[1]["iommu_translated"], true);
    assert_eq!(p[1]["policy_refusals"], 9);
    assert_eq!(p[2]["class"], "unknown");
    assert_eq!(p[2]["failures"], 0);
    assert_eq!(p[2]["last_failure"], Value::Null);

    let (_, v) = view_json(&t, "--by-gpu");
    assert_eq!(
        v,
        serde_json::json!({
            "gpus": [
                {"gpu": "0000:00:03.0", "live": 3, "pinned_bytes": 196608, "max_pinned_bytes": 262144},
                {"gpu": "0000:81:00.0", "live": 1, "pinned_bytes": 65536, "max_pinned_bytes": 1048576}
            ],
            "gpus_error": null,
            "errors": []
        })
    );
    let (_, v) = view_json(&t, "--by-process");
    assert_eq!(
        v["processes"],
        serde_json::json!([
            {"tgid": 77, "comm": "say\"hi\\", "live": 2, "pinned_bytes": 131072},
            {"tgid": 123, "comm": "peermem-e2e", "live": 2, "pinned_bytes": 131072}
        ])
    );
    // The overview also knows the new counter and the parameter.
    let v = t.json();
    assert_eq!(v["stats"]["fail_path_policy"], 9);
    assert_eq!(v["module"]["parameters"]["path_policy"], "3");
}

#[test]
fn by_gpu_and_by_process_tables() {
    let t = with_diag("diag-tables");
    let (code, out, _) = t.run(&["--by-gpu"]);
    assert_eq!(code, 0);
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        out.lines().next(),
        Some("GPUs (/sys/module/nvidia_peermem/stats/gpus)")
    );
    assert_eq!(
        rows[1..],
        [
            vec!["gpu", "live", "pinned_bytes", "max_pinned_bytes"],
            vec!["0000:00:03.0", "3", "196608", "262144"],
            vec!["0000:81:00.0", "1", "65536", "1048576"],
            vec!["total", "4", "262144", "-"],
        ]
    );
    let (code, out, _) = t.run(&["--by-process"]);
    assert_eq!(code, 0);
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows[1..],
        [
            vec!["tgid", "comm", "live", "pinned_bytes"],
            vec!["77", "say\"hi\\", "2", "131072"],
            vec!["123", "peermem-e2e", "2", "131072"],
        ]
    );
    // The overview describes the new counter.
    let (_, out, _) = t.run(&[]);
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("fail_path_policy "))
        .expect(&out);
    assert!(
        line.ends_with("registration refused by the path policy"),
        "{line}"
    );
    assert!(out.contains("path_policy=3"));

    // Malformed lines: listed, the rest shown.
    t.file(
        &format!("{VIEWS}/gpus"),
        format!("{GPUS}gpu=0000:00:03.0 live=9 pinned_bytes=0 max_pinned_bytes=0\ngpu=x live=-1\n"),
    );
    let (_, out, _) = t.run(&["--by-gpu"]);
    assert!(out.contains("Unreadable lines of /sys/module/nvidia_peermem/stats/gpus\n  line 3: gpu=0000:00:03.0 repeated\n  line 4: live: not a number"), "{out}");
    assert!(out.contains("\n  0000:00:03.0    3 "), "{out}");
    let (_, v) = view_json(&t, "--by-gpu");
    assert_eq!(v["errors"].as_array().unwrap().len(), 2);
    assert_eq!(t.json()["errors"].as_array().unwrap().len(), 2);

    // --watch repeats the view.
    let out = Command::new(BIN)
        .args([
            "--root",
            t.root().to_str().unwrap(),
            "paths",
            "--watch",
            "0.05",
            "--count",
            "2",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.matches("--- frame ").count(), 2);
    assert_eq!(text.matches("HCA Legend:").count(), 2);
}

/// Reads an exposition back with prometheus-parse (a parser this tool did
/// not write) and checks the conventions: every family once with HELP and
/// TYPE, counters and only counters named `_total`, the base unit last
/// (`_bytes`, `_bytes_total`), no series twice.
fn exposition(text: &str) -> Scrape {
    assert!(text.ends_with('\n'));
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    // The parser skips lines it cannot read: each sample line must be one.
    let lines = text.lines().filter(|l| !l.starts_with('#')).count();
    assert_eq!(scrape.samples.len(), lines, "unparsed lines in\n{text}");
    let types: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .collect();
    for (i, t) in types.iter().enumerate() {
        assert!(!types[..i].contains(t), "TYPE twice: {t}");
    }
    for (i, s) in scrape.samples.iter().enumerate() {
        let name = s.metric.as_str();
        assert!(name.starts_with("nvidia_peermem_"), "{name}");
        assert!(scrape.docs.contains_key(name), "no HELP for {name}");
        let (kind, _) = value(s);
        assert!(
            types.contains(&format!("{name} {kind}").as_str()),
            "{name} {kind}"
        );
        assert_eq!(
            kind == "counter",
            name.ends_with("_total"),
            "{name} is a {kind}"
        );
        if name.contains("bytes") {
            assert!(
                name.ends_with("_bytes") || name.ends_with("_bytes_total"),
                "{name}"
            );
        }
        assert!(
            !scrape.samples[..i]
                .iter()
                .any(|o| o.metric == s.metric && o.labels == s.labels),
            "series twice: {name} {:?}",
            s.labels
        );
    }
    scrape
}

/// A sample's type and value.
fn value(s: &prometheus_parse::Sample) -> (&'static str, f64) {
    match s.value {
        PromValue::Counter(v) => ("counter", v),
        PromValue::Gauge(v) => ("gauge", v),
        PromValue::Untyped(v) => ("untyped", v),
        _ => panic!("{} is a histogram or summary", s.metric),
    }
}

/// The (type, value) of a series; label values as written (this parser
/// does not undo their escapes).
fn series(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> Option<(&'static str, f64)> {
    s.samples
        .iter()
        .find(|x| {
            x.metric == name
                && x.labels.len() == labels.len()
                && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v))
        })
        .map(value)
}

#[test]
fn prometheus_exposition() {
    let t = with_diag("prom");
    let (code, out, err) = t.run(&["--prometheus"]);
    assert_eq!((code, err.as_str()), (0, ""));
    let s = exposition(&out);
    let get = |n: &str, l: &[(&str, &str)]| {
        series(&s, n, l).unwrap_or_else(|| panic!("{n} {l:?}:\n{out}"))
    };
    let gauge = |n: &str, l: &[(&str, &str)], v: f64| assert_eq!(get(n, l), ("gauge", v), "{n}");
    let counter =
        |n: &str, l: &[(&str, &str)], v: f64| assert_eq!(get(n, l), ("counter", v), "{n}");
    gauge("nvidia_peermem_up", &[], 1.0);
    gauge(
        "nvidia_peermem_info",
        &[("version", "0.1.0"), ("implementation", "peermem-rs")],
        1.0,
    );
    counter("nvidia_peermem_registrations_total", &[], 11.0);
    counter("nvidia_peermem_sg_entries_total", &[], 40.0);
    gauge("nvidia_peermem_live_registrations", &[], 3.0);
    gauge("nvidia_peermem_pinned_bytes", &[], 196608.0);
    let cause = |c| [("cause", c)];
    counter("nvidia_peermem_failures_total", &cause("dma_map"), 5.0);
    counter("nvidia_peermem_failures_total", &cause("path_policy"), 9.0);
    counter("nvidia_peermem_failures_total", &cause("pin"), 0.0);
    gauge("nvidia_peermem_param_path_policy", &[], 3.0);
    gauge("nvidia_peermem_param_persistent_api_support", &[], 0.0);
    let nv_mem = [("client", "nv_mem")];
    gauge("nvidia_peermem_peer_live_mrs", &nv_mem, 3.0);
    gauge("nvidia_peermem_peer_live_bytes", &nv_mem, 196608.0);
    counter("nvidia_peermem_peer_reg_bytes_total", &nv_mem, 1048576.0);
    counter("nvidia_peermem_peer_free_callbacks_total", &nv_mem, 2.0);
    let pair = [("gpu", "0000:00:03.0"), ("hca", "0000:82:00.0")];
    let sys = [pair[0], pair[1], ("class", "SYS")];
    counter("nvidia_peermem_path_registrations_total", &sys, 0.0);
    counter("nvidia_peermem_path_policy_refusals_total", &sys, 9.0);
    counter("nvidia_peermem_path_failures_total", &pair, 4.0);
    counter(
        "nvidia_peermem_path_failures_total",
        &[("gpu", "0000:00:03.0"), ("hca", "0000:00:02.0")],
        3.0,
    );
    gauge(
        "nvidia_peermem_path_info",
        &[
            sys[0],
            sys[1],
            sys[2],
            ("acs_redirect", "1"),
            ("iommu", "dma"),
        ],
        1.0,
    );
    let infos = s
        .samples
        .iter()
        .filter(|x| x.metric == "nvidia_peermem_path_info");
    assert_eq!(infos.count(), 4);
    let gpu = [("gpu", "0000:81:00.0")];
    gauge("nvidia_peermem_gpu_pinned_bytes", &gpu, 65536.0);
    gauge("nvidia_peermem_gpu_max_pinned_bytes", &gpu, 1048576.0);
    gauge("nvidia_peermem_gpu_live_registrations", &gpu, 1.0);
    // The quote and the backslash of a comm, escaped.
    let who = [("tgid", "77"), ("comm", r#"say\"hi\\"#)];
    gauge("nvidia_peermem_process_pinned_bytes", &who, 131072.0);
    gauge("nvidia_peermem_process_live_registrations", &who, 2.0);
    assert!(
        out.contains("{tgid=\"77\",comm=\"say\\\"hi\\\\\"} 2\n"),
        "{out}"
    );
    gauge("nvidia_peermem_read_errors", &[], 0.0);
    // What the end-to-end test looks for, as it looks for it.
    assert!(out
        .lines()
        .any(|l| l == "nvidia_peermem_gpu_live_registrations{gpu=\"0000:81:00.0\"} 1"));
    assert!(out.lines().any(|l| l == "nvidia_peermem_up 1"));

    // A counter of a newer module: untyped, under its own name.
    t.file(
        &format!("{VIEWS}/counters"),
        format!("{STATS}fail_path_policy 9\nparam_path_policy 3\nnew_thing 4\n"),
    );
    let (_, out, _) = t.run(&["--prometheus"]);
    let s = exposition(&out);
    assert_eq!(
        series(&s, "nvidia_peermem_new_thing", &[]),
        Some(("untyped", 4.0))
    );

    // Older module: no path families, the files marked unreadable.
    let t = Tree::ours("prom-old");
    let (code, out, _) = t.run(&["--prometheus"]);
    assert_eq!(code, 0);
    let s = exposition(&out);
    assert_eq!(series(&s, "nvidia_peermem_up", &[]), Some(("gauge", 1.0)));
    let readable = |f| series(&s, "nvidia_peermem_view_readable", &[("file", f)]);
    assert_eq!(readable("paths"), Some(("gauge", 0.0)));
    assert_eq!(readable("counters"), Some(("gauge", 1.0)));
    assert!(!out.contains("debugfs_readable"), "{out}");
    assert!(!out.contains("nvidia_peermem_path_") && !out.contains("nvidia_peermem_gpu_"));

    // Nothing loaded: still an exposition, up 0, exit 0 (a cron job keeps
    // replacing the file).
    let none = Tree::new("prom-none");
    let out = Command::new(BIN)
        .args(["--root", none.root().to_str().unwrap(), "--prometheus"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        series(&exposition(&text), "nvidia_peermem_up", &[]),
        Some(("gauge", 0.0))
    );
}

// Where the views are: sysfs, debugfs (an older peermem-rs), neither.

/// Every view of `t` (with_diag's fixture, wherever its files are) as
/// read from `dir`: the overview, paths, --by-gpu, --by-process, their
/// JSON, the Prometheus exposition and doctor.
fn every_view_reads(t: &Tree, counters: &str, dir: &str) {
    let (code, out, err) = t.run(&[]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(
        out.contains("implementation peermem-rs") && out.contains("path_policy=3"),
        "{out}"
    );
    assert!(out.contains(&format!("\nCounters ({counters})\n")), "{out}");
    assert!(
        !out.contains("unavailable") && !out.contains("Unreadable"),
        "{out}"
    );
    let v = t.json();
    assert_eq!(v["module"]["implementation"], "peermem-rs");
    assert_eq!(v["module"]["parameters"]["path_policy"], "3");
    assert_eq!(v["stats"]["registrations"], 11);
    assert_eq!(v["stats"]["fail_path_policy"], 9);
    assert_eq!(v["stats_error"], Value::Null);
    assert_eq!(v["errors"], serde_json::json!([]));

    let (code, out, _) = t.run(&["paths"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with(&format!(
            "GPU/HCA paths ({dir}/paths), path policy 3 (refuse paths worse than PHB)\n"
        )),
        "{out}"
    );
    assert!(
        out.contains("\nGPU0 0000:00:03.0  PIX      SYS+A+I\n"),
        "{out}"
    );
    let (_, out, _) = t.run(&["--by-gpu"]);
    assert!(out.starts_with(&format!("GPUs ({dir}/gpus)\n")), "{out}");
    assert!(out.contains("\n  total "), "{out}");
    let (_, out, _) = t.run(&["--by-process"]);
    assert!(
        out.starts_with(&format!(
            "Processes with live registrations ({dir}/processes)\n"
        )),
        "{out}"
    );
    assert!(out.contains(" peermem-e2e "), "{out}");
    for (view, key, n) in [
        ("paths", "paths", 4),
        ("--by-gpu", "gpus", 2),
        ("--by-process", "processes", 2),
    ] {
        let (code, v) = view_json(t, view);
        assert_eq!(code, 0);
        assert_eq!(v[key].as_array().unwrap().len(), n, "{view}");
        assert_eq!(v[format!("{key}_error")], Value::Null, "{view}");
    }

    let (code, out, err) = t.run(&["--prometheus"]);
    assert_eq!((code, err.as_str()), (0, ""));
    let s = exposition(&out);
    for f in ["counters", "paths", "gpus", "processes"] {
        assert_eq!(
            series(&s, "nvidia_peermem_view_readable", &[("file", f)]),
            Some(("gauge", 1.0)),
            "{f}"
        );
    }
    assert_eq!(
        series(
            &s,
            "nvidia_peermem_info",
            &[("version", "0.1.0"), ("implementation", "peermem-rs")]
        ),
        Some(("gauge", 1.0))
    );
    assert_eq!(
        series(&s, "nvidia_peermem_registrations_total", &[]),
        Some(("counter", 11.0))
    );
    assert_eq!(
        series(
            &s,
            "nvidia_peermem_gpu_live_registrations",
            &[("gpu", "0000:81:00.0")]
        ),
        Some(("gauge", 1.0))
    );
    assert_eq!(
        series(
            &s,
            "nvidia_peermem_process_pinned_bytes",
            &[("tgid", "123"), ("comm", "peermem-e2e")]
        ),
        Some(("gauge", 131072.0))
    );

    // Doctor: its findings from these files, nothing left unchecked.
    let (code, lines, err) = doctor(t, &[]);
    assert_eq!((code, err.as_str()), (3, ""));
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with(
            "path-policy-refusals: 9 registrations refused by the path policy (path_policy=3: \
             refuse paths worse than PHB): GPU 0000:00:03.0 - HCA 0000:82:00.0 (SYS) 9. Fix:"
        ),
        "{lines:?}"
    );
}

#[test]
fn sysfs_views_without_debugfs() {
    // A container that mounts only /sys, or a node under lockdown: no
    // debugfs at all, not even its mount point.
    let t = with_diag("sysfs-only");
    fs::remove_dir_all(t.at("/sys/kernel/debug")).unwrap();
    every_view_reads(&t, "/sys/module/nvidia_peermem/stats/counters", VIEWS);
    // Pins of an exited process, from the sysfs processes file.
    t.file(
        &format!("{VIEWS}/processes"),
        format!("{PROCESSES}tgid=4242 comm= live=2 pinned_bytes=131072\n"),
    );
    assert_eq!(
        findings(&t, &[]),
        ["path-policy-refusals", "pins-after-exit"]
    );
    // Malformed lines name the sysfs file.
    t.file(&format!("{VIEWS}/gpus"), format!("{GPUS}gpu=x live=-1\n"));
    let errors = t.json()["errors"].clone();
    assert_eq!(
        errors,
        serde_json::json!([
            "/sys/module/nvidia_peermem/stats/gpus: line 3: live: not a number: \"-1\""
        ])
    );

    // Sysfs first: a stale copy in debugfs is not read.
    t.file(
        &format!("{OLD}/stats"),
        STATS.replace("registrations 11", "registrations 99"),
    )
    .file(&format!("{OLD}/paths"), "");
    assert_eq!(t.json()["stats"]["registrations"], 11);
    assert_eq!(
        view_json(&t, "paths").1["paths"].as_array().unwrap().len(),
        4
    );
}

#[test]
fn debugfs_views_of_an_older_module() {
    // A peermem-rs older than its sysfs views: the same files in debugfs
    // (mounted, read as root).
    let t = with_diag("old-layout").into_debugfs();
    assert!(!t.at(VIEWS).exists() && t.at(&format!("{OLD}/stats")).exists());
    every_view_reads(&t, "/sys/kernel/debug/nvidia_peermem/stats", OLD);
    // Malformed lines name the debugfs files.
    t.file(
        &format!("{OLD}/stats"),
        format!("{STATS}pinned_bytes x\nbad\n"),
    )
    .file(&format!("{OLD}/gpus"), format!("{GPUS}gpu=x live=-1\n"));
    let errors = t.json()["errors"].clone();
    assert_eq!(
        errors,
        serde_json::json!([
            "/sys/kernel/debug/nvidia_peermem/stats: bad: no value",
            "/sys/kernel/debug/nvidia_peermem/gpus: line 3: live: not a number: \"-1\""
        ])
    );
    assert!(t
        .run(&["--by-gpu"])
        .1
        .contains("Unreadable lines of /sys/kernel/debug/nvidia_peermem/gpus\n"));

    // A module with sysfs views lacking one file: that file from debugfs.
    let t = with_diag("mixed-layout");
    fs::remove_file(t.at(&format!("{VIEWS}/gpus"))).unwrap();
    t.file(&format!("{OLD}/gpus"), GPUS);
    assert!(t
        .run(&["--by-gpu"])
        .1
        .starts_with("GPUs (/sys/kernel/debug/nvidia_peermem/gpus)\n"));
    fs::remove_file(t.at(&format!("{OLD}/gpus"))).unwrap();
    assert_eq!(
        t.run(&["--by-gpu"]).1,
        "GPUs: unavailable: no /sys/module/nvidia_peermem/stats/gpus: \
         this nvidia_peermem has no path diagnostics\n"
    );
}

/// Every view of `t` gives `why`, in one line each; the rest is shown.
fn every_view_says(t: &Tree, why: &str, implementation: &str) {
    for (args, title) in [
        (&["paths"][..], "Paths"),
        (&["--by-gpu"], "GPUs"),
        (&["--by-process"], "Processes with live registrations"),
    ] {
        let (code, out, err) = t.run(args);
        assert_eq!(
            (code, out.as_str(), err.as_str()),
            (0, format!("{title}: unavailable: {why}\n").as_str(), ""),
            "{args:?}"
        );
    }
    let (code, out, _) = t.run(&[]);
    assert_eq!(code, 0);
    assert!(
        out.contains(&format!("\nCounters: unavailable: {why}\n")),
        "{out}"
    );
    assert!(out.contains("Peer-memory clients (") && out.contains("NCCL      YES"));
    let v = t.json();
    assert_eq!(v["stats"], Value::Null);
    assert_eq!(v["stats_error"], why);
    assert_eq!(v["peers"]["nv_mem"]["live_mrs"], 3);
    for (view, key) in [
        ("paths", "paths"),
        ("--by-gpu", "gpus"),
        ("--by-process", "processes"),
    ] {
        let (code, v) = view_json(t, view);
        assert_eq!(code, 0);
        assert_eq!(v[key], Value::Null, "{view}");
        assert_eq!(v[format!("{key}_error")], why, "{view}");
    }
    let (code, out, _) = t.run(&["--prometheus"]);
    assert_eq!(code, 0);
    let s = exposition(&out);
    assert_eq!(series(&s, "nvidia_peermem_up", &[]), Some(("gauge", 1.0)));
    assert_eq!(
        series(
            &s,
            "nvidia_peermem_info",
            &[("version", "0.1.0"), ("implementation", implementation)]
        ),
        Some(("gauge", 1.0))
    );
    for f in ["counters", "paths", "gpus", "processes"] {
        assert_eq!(
            series(&s, "nvidia_peermem_view_readable", &[("file", f)]),
            Some(("gauge", 0.0)),
            "{f}"
        );
    }
    assert!(
        !out.contains("nvidia_peermem_registrations_total")
            && !out.contains("nvidia_peermem_gpu_")
            && out.contains("nvidia_peermem_peer_live_mrs"),
        "{out}"
    );
    let (code, lines, err) = doctor(t, &[]);
    assert_eq!((code, lines), (0, vec!["ok".to_string()]));
    assert!(
        err.contains(&format!("not checked: counters: {why}\n")),
        "{err}"
    );
}

#[test]
fn no_views_one_reason() {
    // Loaded, no sysfs views, debugfs not mounted: NVIDIA's C module or an
    // older peermem-rs, which cannot be told apart; both named.
    let not_mounted = "no /sys/module/nvidia_peermem/stats: NVIDIA's C module (it has no \
                       counters), or a peermem-rs older than its sysfs views with debugfs not \
                       mounted (mount -t debugfs none /sys/kernel/debug, as root)";
    let t = with_diag("no-views").into_debugfs();
    t.unmount_debugfs();
    every_view_says(&t, not_mounted, "unknown");
    // Not even debugfs's mount point: the same.
    fs::remove_dir(t.at("/sys/kernel/debug")).unwrap();
    every_view_says(&t, not_mounted, "unknown");

    // Debugfs mounted, nothing of ours in it: NVIDIA's C module.
    t.dir("/sys/kernel/debug/dri");
    every_view_says(
        &t,
        "no /sys/module/nvidia_peermem/stats nor /sys/kernel/debug/nvidia_peermem: \
         NVIDIA's C module, which has no counters",
        "other",
    );

    // Debugfs not readable (not root): said where permissions apply (root
    // reads it anyway).
    let t = with_diag("no-views-denied").into_debugfs();
    let debug = t.at("/sys/kernel/debug");
    fs::set_permissions(&debug, fs::Permissions::from_mode(0o000)).unwrap();
    let denied = fs::read_dir(&debug).is_err();
    if denied {
        every_view_says(
            &t,
            "no /sys/module/nvidia_peermem/stats: NVIDIA's C module (it has no counters), or a \
             peermem-rs older than its sysfs views, whose debugfs files need root \
             (/sys/kernel/debug/nvidia_peermem: permission denied)",
            "unknown",
        );
    } else {
        assert_eq!(t.json()["stats"]["registrations"], 11);
    }
    fs::set_permissions(&debug, fs::Permissions::from_mode(0o755)).unwrap();
    // A file of ours not readable, in debugfs or in sysfs (where it is
    // 0444: only a security policy refuses it).
    let counters = t.at(&format!("{OLD}/stats"));
    fs::set_permissions(&counters, fs::Permissions::from_mode(0o000)).unwrap();
    if denied {
        assert_eq!(
            t.json()["stats_error"],
            "/sys/kernel/debug/nvidia_peermem/stats: permission denied (debugfs needs root; \
             kernel lockdown may also refuse it)"
        );
    }
    let t = with_diag("no-views-denied-sysfs");
    let counters = t.at(&format!("{VIEWS}/counters"));
    fs::set_permissions(&counters, fs::Permissions::from_mode(0o000)).unwrap();
    if denied {
        let v = t.json();
        assert_eq!(
            v["stats_error"],
            "/sys/module/nvidia_peermem/stats/counters: permission denied"
        );
        // The other views are still read.
        assert_eq!(v["module"]["implementation"], "peermem-rs");
        assert_eq!(view_json(&t, "--by-gpu").1["gpus_error"], Value::Null);
    }

    // Not loaded: the same one reason everywhere.
    let t = Tree::new("no-views-unloaded");
    for (view, key) in [
        ("paths", "paths"),
        ("--by-gpu", "gpus"),
        ("--by-process", "processes"),
    ] {
        let (code, v) = view_json(&t, view);
        assert_eq!(code, 2);
        assert_eq!(v[format!("{key}_error")], "nvidia_peermem is not loaded");
    }
    assert_eq!(t.json()["stats_error"], "nvidia_peermem is not loaded");
}

// doctor: one fixture tree per finding.

/// `doctor` under `t`: (exit status, stdout lines, stderr).
fn doctor(t: &Tree, args: &[&str]) -> (i32, Vec<String>, String) {
    let mut all = vec!["doctor"];
    all.extend(args);
    let (code, out, err) = t.run(&all);
    (code, out.lines().map(str::to_string).collect(), err)
}

/// The finding ids of a doctor run that found something.
fn findings(t: &Tree, args: &[&str]) -> Vec<String> {
    let (code, lines, _) = doctor(t, args);
    assert_eq!(code, 3, "{lines:?}");
    lines
        .iter()
        .map(|l| {
            assert!(l.contains(". Fix: "), "{l}");
            l.split(':').next().unwrap().to_string()
        })
        .collect()
}

#[test]
fn doctor_ok() {
    let t = Tree::ours("doctor-ok");
    t.file(
        &format!("{VIEWS}/processes"),
        "tgid=8 comm=nccl live=1 pinned_bytes=65536\n",
    );
    assert_eq!(doctor(&t, &[]), (0, vec!["ok".to_string()], String::new()));
    let (code, out, _) = t.run(&["doctor", "--json"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"ok": true, "findings": [], "not_checked": []})
    );
    // A core without memory_peers (no sysfs): this module registers at
    // load or does not load, so nothing is missing.
    fs::remove_dir_all(t.at("/sys/kernel/mm/memory_peers")).unwrap();
    assert_eq!(doctor(&t, &[]).0, 0);
    // No debugfs at all: the sysfs views need none.
    fs::remove_dir_all(t.at("/sys/kernel/debug")).unwrap();
    assert_eq!(doctor(&t, &[]), (0, vec!["ok".to_string()], String::new()));
    // An older peermem-rs (debugfs only), debugfs not mounted: ok as far as
    // it can tell, and it says so.
    let t = t.into_debugfs();
    t.unmount_debugfs();
    let (code, lines, err) = doctor(&t, &[]);
    assert_eq!((code, lines), (0, vec!["ok".to_string()]));
    assert!(
        err.contains(
            "not checked: counters: no /sys/module/nvidia_peermem/stats: NVIDIA's C module \
             (it has no counters), or a peermem-rs older than its sysfs views with debugfs not \
             mounted (mount -t debugfs none /sys/kernel/debug, as root)\n"
        ),
        "{err}"
    );
    assert!(
        err.contains("not checked: client registration: no /sys/kernel/mm/memory_peers"),
        "{err}"
    );
}

#[test]
fn doctor_peer_memory_core_absent() {
    let t = Tree::new("doctor-core");
    t.file(
        "/dev/kmsg",
        "6,500,100,-;ib_core: loaded\n\
         4,501,200,-;nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -2)\n\
         4,502,201,-;nvidia_peermem: Unknown symbol ib_unregister_peer_memory_client (err -2)\n",
    );
    let (code, lines, err) = doctor(&t, &[]);
    assert_eq!((code, err.as_str()), (3, ""));
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with(
        "peer-memory-core-absent: nvidia_peermem failed to load (Unknown symbol \
         ib_register_peer_memory_client, ib_unregister_peer_memory_client) and the peer-memory \
         core is not loaded now: the loaded ib_core has no peer-memory API"
    ));
    assert!(lines[0].contains("Fix: install MLNX_OFED or DOCA-OFED"));
    // A core with clients now: the failure came before it was loaded.
    peer(&t, "other_client", 0, 0, 0, 0);
    let (_, lines, _) = doctor(&t, &[]);
    assert_eq!(lines.len(), 1);
    assert!(
        lines[0].starts_with("not-loaded: nvidia_peermem is not loaded")
            && lines[0].contains("before the peer-memory core"),
        "{lines:?}"
    );
}

#[test]
fn doctor_symbol_version_mismatch() {
    let t = Tree::new("doctor-crc");
    // A saved dmesg, given by --log (an absolute path is under --root).
    let log = "[   10.1] nvidia_peermem: disagrees about version of symbol ib_register_peer_memory_client\n\
               [   10.2] nvidia_peermem: disagrees about version of symbol nvidia_p2p_get_pages\n\
               [   10.3] nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -22)\n";
    t.file("/var/log/kern.log", log);
    t.dir("/sys/kernel/mm/memory_peers/nvme_peer");
    assert_eq!(
        findings(&t, &["--log", "/var/log/kern.log"]),
        ["symbol-version-mismatch"]
    );
    let (_, lines, _) = doctor(&t, &["--log", "/var/log/kern.log"]);
    assert!(lines[0].contains(
        "disagrees about version of symbol ib_register_peer_memory_client, nvidia_p2p_get_pages"
    ));
    assert!(lines[0].contains("Fix: rebuild it: dkms autoinstall"));
    // Loaded successfully since: only "not loaded" now.
    t.file(
        "/var/log/kern.log",
        format!("{log}[   20.0] nvidia_peermem: version 0.1.0 loaded: nv_mem (persistent)\n"),
    );
    assert_eq!(
        findings(&t, &["--log", "/var/log/kern.log"]),
        ["not-loaded"]
    );
    // Other unknown symbols: the GPU driver, or another build.
    t.file(
        "/dev/kmsg",
        "3,1,1,-;nvidia_peermem: Unknown symbol nvidia_p2p_get_pages (err -2)\n\
         3,2,2,-;nvidia_peermem: Unknown symbol _RNvNtCs1_6kernel5print11call_printk (err -2)\n",
    );
    assert_eq!(findings(&t, &[]), ["gpu-driver-absent", "unknown-symbol"]);
}

/// The enrollment steps every signature finding ends with, for Debian's and
/// Ubuntu's DKMS keys.
fn assert_enrollment(line: &str) {
    for want in [
        "Fix: ",
        "mokutil --import /var/lib/dkms/mok.pub (Debian)",
        "mokutil --import /var/lib/shim-signed/mok/MOK.der (Ubuntu)",
        "reboot, and in MokManager",
        "Enroll MOK, Continue, Yes",
        "then modprobe nvidia_peermem",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
}

#[test]
fn doctor_signature_lockdown() {
    // Secure Boot, lockdown alone: EPERM and the lockdown LSM's line, which
    // names the command, not the module.
    let t = Tree::new("doctor-lockdown");
    t.file(
        "/dev/kmsg",
        "6,500,100,-;ib_core: loaded\n\
         5,501,200,-;Lockdown: modprobe: unsigned module loading is restricted; see man kernel_lockdown.7\n",
    )
    .file(
        "/sys/kernel/security/lockdown",
        "none [integrity] confidentiality\n",
    )
    .file("/sys/module/module/parameters/sig_enforce", "N\n");
    let (code, lines, err) = doctor(&t, &[]);
    assert_eq!((code, err.as_str()), (3, ""));
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(
        lines[0].split(". Fix: ").next().unwrap(),
        "module-signature-lockdown: nvidia_peermem is not loaded and the kernel, locked down, \
         refused a module that is unsigned or signed with a key it does not trust \
         (log: \"Lockdown: modprobe: unsigned module loading is restricted; see man \
         kernel_lockdown.7\"; modprobe says \"Operation not permitted\"); the kernel is locked \
         down (integrity)"
    );
    assert!(lines[0]
        .contains("Fix: if modinfo -F signer nvidia_peermem prints nothing, DKMS did not sign it"));
    assert_enrollment(&lines[0]);
    // Loaded since (the key was enrolled): the refusal is stale.
    t.file(
        "/dev/kmsg",
        "5,501,200,-;Lockdown: modprobe: unsigned module loading is restricted; see man kernel_lockdown.7\n\
         6,600,900,-;nvidia_peermem: version 0.1.0 loaded: nv_mem (persistent)\n",
    );
    assert_eq!(findings(&t, &[]), ["not-loaded"]);
    // Another module's lockdown refusal counts while ours is not loaded, and
    // a lockdown line of another kind does not.
    t.file(
        "/dev/kmsg",
        "5,1,1,-;Lockdown: insmod: debugfs access is restricted; see man kernel_lockdown.7\n",
    );
    assert_eq!(findings(&t, &[]), ["not-loaded"]);
    // JSON: the finding with its id and fix.
    t.file(
        "/dev/kmsg",
        "5,1,1,-;Lockdown: insmod: unsigned module loading is restricted; see man kernel_lockdown.7\n",
    );
    let (code, out, _) = t.run(&["doctor", "--json"]);
    assert_eq!(code, 3);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["findings"][0]["id"], "module-signature-lockdown");
    assert_enrollment(&format!(
        "Fix: {}",
        v["findings"][0]["fix"].as_str().unwrap()
    ));
}

#[test]
fn doctor_signature_enforced() {
    // module.sig_enforce=1: EKEYREJECTED, and the module loader's line says
    // which case. A saved dmesg works as well as /dev/kmsg.
    let t = Tree::new("doctor-sig-enforce");
    t.file("/sys/module/module/parameters/sig_enforce", "Y\n")
        .file(
            "/sys/kernel/security/lockdown",
            "[none] integrity confidentiality\n",
        )
        .file(
            "/var/log/dmesg.txt",
            "[   10.1] Loading of unsigned module is rejected\n\
             [   10.2] Loading of unsigned module is rejected\n",
        );
    assert_eq!(
        findings(&t, &["--log", "/var/log/dmesg.txt"]),
        ["module-unsigned"]
    );
    let (_, lines, _) = doctor(&t, &["--log", "/var/log/dmesg.txt"]);
    assert_eq!(
        lines[0].split(". Fix: ").next().unwrap(),
        "module-unsigned: nvidia_peermem is not loaded and the kernel refused an unsigned module \
         (log: \"Loading of unsigned module is rejected\"; modprobe says \"Key was rejected by \
         service\"); module signatures are enforced (sig_enforce=Y): DKMS did not sign it"
    );
    assert!(lines[0].contains("rebuild it (dpkg-reconfigure nvidia-peermem-rs-dkms"));
    assert_enrollment(&lines[0]);
    // Signed, with a key the kernel does not trust: enrollment only.
    t.file(
        "/var/log/dmesg.txt",
        "[   11.0] Loading of module with unavailable key is rejected\n",
    );
    assert_eq!(
        findings(&t, &["--log", "/var/log/dmesg.txt"]),
        ["module-key-not-enrolled"]
    );
    let (_, lines, _) = doctor(&t, &["--log", "/var/log/dmesg.txt"]);
    assert!(lines[0].starts_with(
        "module-key-not-enrolled: nvidia_peermem is not loaded and the kernel refused a module \
         signed with a key it does not trust (log: \"Loading of module with unavailable key is \
         rejected\"; modprobe says \"Key was rejected by service\"); module signatures are \
         enforced (sig_enforce=Y). Fix: enroll the key DKMS signs with"
    ));
    assert!(!lines[0].contains("rebuild it"), "{}", lines[0]);
    assert_enrollment(&lines[0]);
    // Both, lockdown too (the state read from /sys): each its own line, no
    // "not-loaded" beside them.
    t.file(
        "/dev/kmsg",
        "5,1,1,-;Loading of unsigned module is rejected\n\
         5,2,2,-;Loading of module with unavailable key is rejected\n",
    )
    .file(
        "/sys/kernel/security/lockdown",
        "none [integrity] confidentiality\n",
    );
    assert_eq!(
        findings(&t, &[]),
        ["module-unsigned", "module-key-not-enrolled"]
    );
    assert!(doctor(&t, &[]).1[1].contains(
        "; the kernel is locked down (integrity), module signatures are enforced (sig_enforce=Y)"
    ));
    // Without signature enforcement or lockdown the kernel loads an unsigned
    // module with a taint line only: not a refusal, nothing to enroll.
    let t = Tree::new("doctor-sig-taint");
    t.file(
        "/dev/kmsg",
        "4,1,1,-;nvidia_peermem: module verification failed: signature and/or required key missing - tainting kernel\n",
    );
    assert_eq!(findings(&t, &[]), ["not-loaded"]);
}

#[test]
fn doctor_not_loaded_without_a_log() {
    let t = Tree::new("doctor-nolog");
    let (code, lines, err) = doctor(&t, &[]);
    assert_eq!(code, 3);
    assert_eq!(lines.len(), 1);
    assert!(lines[0]
        .starts_with("not-loaded: nvidia_peermem is not loaded (no /sys/module/nvidia_peermem)"));
    assert!(
        err.contains("not checked: kernel log: ")
            && err.contains("(needs root, or give --log FILE)"),
        "{err}"
    );
    let (code, out, _) = t.run(&["doctor", "--json"]);
    assert_eq!(code, 3);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["findings"][0]["id"], "not-loaded");
    assert!(v["findings"][0]["fix"]
        .as_str()
        .unwrap()
        .starts_with("modprobe nvidia_peermem"));
    assert_eq!(v["not_checked"].as_array().unwrap().len(), 1);
}

#[test]
fn doctor_client_not_registered() {
    // NVIDIA's module, loaded, registered nothing (built without OFED).
    let c = Tree::new("doctor-noclient");
    c.file(MODULE, "580.65.06\n").dir("/sys/kernel/debug/dri");
    let (code, lines, err) = doctor(&c, &[]);
    assert_eq!(code, 3);
    assert_eq!(lines.len(), 1);
    assert!(lines[0].starts_with(
        "client-not-registered: nvidia_peermem is loaded but its peer-memory client is not \
         registered (no /sys/kernel/mm/memory_peers/nv_mem)"
    ));
    assert!(lines[0].contains("GPU Direct RDMA Disabled"));
    assert!(
        err.contains(
            "not checked: counters: no /sys/module/nvidia_peermem/stats nor \
             /sys/kernel/debug/nvidia_peermem: NVIDIA's C module"
        ),
        "{err}"
    );
    // The core lists other clients, not nv_mem: whatever the module.
    let t = Tree::ours("doctor-noclient-ours");
    fs::remove_dir_all(t.at("/sys/kernel/mm/memory_peers/nv_mem")).unwrap();
    assert_eq!(findings(&t, &[]), ["client-not-registered"]);
}

#[test]
fn doctor_waiting_for_core_and_gpu_driver() {
    // Late binding: loaded before the core and the GPU driver.
    for (value, id, word) in [
        (
            "core,gpu-driver\n",
            "waiting-for-core-and-gpu-driver",
            "modprobe nvidia",
        ),
        ("core\n", "waiting-for-core", "modprobe ib_uverbs"),
        ("gpu-driver\n", "waiting-for-gpu-driver", "modprobe nvidia"),
        ("core-refused\n", "core-refused-clients", "nvidia-peermem"),
    ] {
        let t = Tree::ours(&format!("doctor-waiting-{id}"));
        fs::remove_dir_all(t.at("/sys/kernel/mm/memory_peers/nv_mem")).unwrap();
        t.file("/sys/module/nvidia_peermem/stats/waiting_for", value);
        // Not client-not-registered: why it is not registered is known.
        assert_eq!(findings(&t, &[]), [id], "{value}");
        let (_, lines, _) = doctor(&t, &[]);
        assert!(lines[0].contains(word), "{}", lines[0]);
    }
    let t = Tree::ours("doctor-waiting-nothing");
    t.file("/sys/module/nvidia_peermem/stats/waiting_for", "nothing\n");
    let (code, lines, _) = doctor(&t, &[]);
    assert_eq!((code, lines), (0, vec!["ok".to_string()]));
}

/// /proc/kallsyms with the entry points of `core` (the peer-memory core's
/// module) and `gpu` (the GPU driver's), where given.
fn kallsyms(t: &Tree, core: Option<&str>, gpu: Option<&str>) {
    let mut text =
        String::from("0000000000000000 T _text\n0000000000000000 t ib_uverbs_open\t[ib_uverbs]\n");
    for (m, sym) in [
        (core, "ib_register_peer_memory_client"),
        (gpu, "nvidia_p2p_get_pages"),
    ] {
        if let Some(m) = m {
            text.push_str(&format!("0000000000000000 T {sym}\t[{m}]\n"));
        }
    }
    t.file("/proc/kallsyms", text);
}

// The issue 41 sequence as a new user meets it: the module refused for a
// missing core, the core then loaded, the GPU driver unloaded, the module
// tried again. The first failure is history, not a finding.
const NEW_USER_OLD_STYLE: &str = "\
6,700,2000000,-;Linux version 7.3.0-1-amd64
4,801,10000000,-;nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -2)
4,802,10000100,-;nvidia_peermem: Unknown symbol ib_unregister_peer_memory_client (err -2)
6,803,30000000,-;mlx5_ib: loaded
6,804,45000000,-;nvidia-nvlink: Unregistered Nvlink Core, major device number 238
4,805,60000000,-;nvidia_peermem: Unknown symbol nvidia_p2p_get_pages (err -2)
4,806,60000050,-;nvidia_peermem: Unknown symbol nvidia_p2p_put_pages (err -2)
";

#[test]
fn doctor_new_user_sequence_old_style() {
    let t = Tree::new("doctor-new-user-old");
    t.file("/dev/kmsg", NEW_USER_OLD_STYLE);
    // The core is loaded now (no client yet, so no memory_peers).
    kallsyms(&t, Some("ib_core"), None);
    assert_eq!(findings(&t, &[]), ["gpu-driver-absent"]);
    let (_, lines, err) = doctor(&t, &[]);
    assert!(lines[0].contains(
        "(Unknown symbol nvidia_p2p_get_pages, nvidia_p2p_put_pages) and the GPU driver is not loaded now"
    ));
    assert!(!lines[0].contains("ib_register"), "{}", lines[0]);
    assert_eq!(
        err,
        "peermem-stat doctor: history: an earlier load attempt, no longer current: failed at \
         10.0 s: \"nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -2)\", \
         \"nvidia_peermem: Unknown symbol ib_unregister_peer_memory_client (err -2)\"\n"
    );
    let (_, out, _) = t.run(&["doctor", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["findings"].as_array().unwrap().len(), 1);
    assert_eq!(v["history"].as_array().unwrap().len(), 1);
    // The GPU driver loaded since (the emulator's module here): nothing is
    // missing, the module only has to be loaded again.
    kallsyms(&t, Some("ib_core"), Some("nv_p2p_emu"));
    let (_, lines, _) = doctor(&t, &[]);
    assert_eq!(
        lines[0].split(". Fix: ").next().unwrap(),
        "not-loaded: nvidia_peermem is not loaded (no /sys/module/nvidia_peermem); its latest \
         load attempt failed before the GPU driver was loaded (Unknown symbol \
         nvidia_p2p_get_pages, nvidia_p2p_put_pages), which is loaded now (module nv_p2p_emu); \
         now the peer-memory core loaded (module ib_core), the GPU driver loaded (module nv_p2p_emu)"
    );
    // Both gone now: only what the latest attempt said, the GPU driver.
    kallsyms(&t, None, None);
    assert_eq!(findings(&t, &[]), ["gpu-driver-absent"]);
}

#[test]
fn doctor_new_user_sequence_late_binding() {
    // This module: it loaded and waited for the core, bound it and
    // registered; was unloaded (the kernel logs nothing), the GPU driver
    // too; loaded again and waits for the GPU driver, a refused one named.
    let log = "\
[   10.000000] nvidia_peermem: version 0.1.0 loaded, waiting for the peer-memory core (ib_register_peer_memory_client: ib_core, ib_uverbs or an OFED build): its clients register once both are loaded
[   30.000000] nvidia_peermem: registered with the peer-memory core: nv_mem (invalidating), nv_mem_nc (persistent) (bound to module ib_core)
[   60.000000] nvidia_peermem: refused the GPU driver in module nvidia: version '460.91.03' is not one this module knows (R470 or later, MAJOR.MINOR[.PATCH]); waiting for another
[   60.000100] nvidia_peermem: version 0.1.0 loaded, waiting for the GPU driver (nvidia_p2p_get_pages: nvidia): its clients register once both are loaded
";
    let t = Tree::ours("doctor-new-user-late");
    fs::remove_dir_all(t.at("/sys/kernel/mm/memory_peers/nv_mem")).unwrap();
    t.file(
        "/sys/module/nvidia_peermem/stats/waiting_for",
        "gpu-driver\n",
    )
    .file("/dev/kmsg", log);
    assert_eq!(findings(&t, &[]), ["waiting-for-gpu-driver"]);
    let (_, lines, _) = doctor(&t, &[]);
    assert!(
        lines[0].contains(
            "waits for the GPU driver before it registers its peer-memory clients: until then no \
             stack sees GPUDirect RDMA through it; its latest load logged: \"nvidia_peermem: \
             refused the GPU driver in module nvidia: version '460.91.03'"
        ),
        "{}",
        lines[0]
    );
    // Unloaded again, the GPU driver still absent.
    fs::remove_dir_all(t.at("/sys/module/nvidia_peermem")).unwrap();
    fs::remove_dir_all(t.at("/sys/module/nvidia")).unwrap();
    kallsyms(&t, Some("ib_uverbs"), None);
    let (_, lines, err) = doctor(&t, &[]);
    assert_eq!(lines.len(), 1);
    assert!(
        lines[0].starts_with("not-loaded: nvidia_peermem is not loaded")
            && lines[0]
                .contains("; it loaded last (version 0.1.0, at 60.0 s) and was unloaded since;")
            && lines[0].contains(
                "now the peer-memory core loaded (module ib_uverbs), the GPU driver not loaded."
            ),
        "{}",
        lines[0]
    );
    assert!(
        err.contains("history: an earlier load attempt, no longer current: loaded at 10.0 s"),
        "{err}"
    );
}

#[test]
fn doctor_latest_attempt_wins() {
    // A wrapped ring buffer (the first attempt cut off), loads and unloads,
    // then a refusal of the module's parameters: that one is the finding.
    let t = Tree::new("doctor-latest");
    kallsyms(&t, Some("ib_core"), Some("nvidia"));
    let log = "\
[    3.2] nvidia_peermem: Unknown symbol ib_unregister_peer_memory_client (err -2)
[   20.0] nvidia_peermem: version 0.1.0 loaded: nv_mem (persistent)
[   40.0] nvidia_peermem: version 0.1.0 loaded: nv_mem (persistent)
[   41.0] nvidia_peermem: GPU 0000:01:00.0 and peer 0000:02:00.0: path PIX (IOMMU: off)
[   90.0] nvidia_peermem: invalid parameter path_policy=9 (0 to allow every path, 1..5 for PIX..SYS)
";
    t.file("/var/log/kern.log", log);
    assert_eq!(
        findings(&t, &["--log", "/var/log/kern.log"]),
        ["invalid-parameter"]
    );
    let (_, _, err) = doctor(&t, &["--log", "/var/log/kern.log"]);
    assert_eq!(err.matches("history: ").count(), 3, "{err}");
    // A load since: the refusal is history.
    t.file(
        "/var/log/kern.log",
        format!("{log}[  95.0] nvidia_peermem: version 0.1.0 loaded: nv_mem (persistent)\n"),
    );
    assert_eq!(
        findings(&t, &["--log", "/var/log/kern.log"]),
        ["not-loaded"]
    );
}

#[test]
fn doctor_paths_refused() {
    let t = with_diag("doctor-policy");
    let (code, lines, _) = doctor(&t, &[]);
    assert_eq!(code, 3);
    assert_eq!(
        lines,
        [
            "path-policy-refusals: 9 registrations refused by the path policy (path_policy=3: \
          refuse paths worse than PHB): GPU 0000:00:03.0 - HCA 0000:82:00.0 (SYS) 9. Fix: put the \
          HCA behind the GPU's PCIe switch (peermem-stat paths shows each pair's class), or load \
          nvidia_peermem with a larger path_policy (0 allows every path)"
        ]
    );
    // The counter alone (a module without path diagnostics) is enough; so
    // is the GPU driver's topology gate.
    let t = Tree::ours("doctor-policy-stats");
    t.file(
        &format!("{VIEWS}/counters"),
        format!("{STATS}fail_path_policy 2\nfail_topology 1\n"),
    );
    assert_eq!(
        findings(&t, &[]),
        ["path-policy-refusals", "topology-refusals"]
    );
    assert!(doctor(&t, &[]).1[0]
        .starts_with("path-policy-refusals: 2 registrations refused by the path policy. Fix:"));
}

#[test]
fn doctor_pins_after_exit() {
    let t = Tree::ours("doctor-pins");
    t.file(
        &format!("{VIEWS}/counters"),
        format!("{STATS}orphaned_pins 2\nstranded_pins 1\n"),
    );
    let (_, lines, _) = doctor(&t, &[]);
    assert_eq!(findings(&t, &[]), ["pins-after-exit"]);
    assert!(
        lines[0].contains("orphaned_pins=2 stranded_pins=1"),
        "{lines:?}"
    );
    // Only a process that exited with live registrations.
    t.file(&format!("{VIEWS}/counters"), STATS).file(
        &format!("{VIEWS}/processes"),
        "tgid=8 comm=nccl live=1 pinned_bytes=65536\ntgid=4242 comm= live=2 pinned_bytes=131072\n",
    );
    let (_, lines, _) = doctor(&t, &[]);
    assert_eq!(findings(&t, &[]), ["pins-after-exit"]);
    assert!(
        lines[0]
            .contains("exited processes with live registrations: tgid 4242 (2 live, 131072 bytes)")
            && !lines[0].contains("tgid 8 "),
        "{lines:?}"
    );
}

#[test]
fn completions() {
    let t = Tree::new("completions");
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let (code, out, err) = t.run(&["completions", shell]);
        assert_eq!((code, err.as_str()), (0, ""), "{shell}");
        for word in ["doctor", "paths", "by-gpu", "prometheus"] {
            assert!(out.contains(word), "{shell}: {word}");
        }
    }
    // The bash script is valid bash, where there is one.
    let (_, script, _) = t.run(&["completions", "bash"]);
    t.file("/completion.bash", script);
    if let Ok(out) = Command::new("bash")
        .arg("-n")
        .arg(t.at("/completion.bash"))
        .output()
    {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn doctor_drain_states() {
    // Draining: the holders its latest drain logged are named (root reads
    // the log); an earlier drain's are not.
    let log = "\
[   10.000000] nvidia_peermem: version 0.1.0 loaded: nv_mem (persistent)
[   20.000000] nvidia_peermem: drain: new registrations are refused; 0 revoked through the core; 1 processes hold GPU memory
[   20.000100] nvidia_peermem: drain: process 77 (old_app) holds 1 persistent registrations (65536 bytes), which cannot be revoked: the drain completes when it deregisters them or exits
[   30.000000] nvidia_peermem: drain ended (drain set to 0): registrations are accepted again
[   40.000000] nvidia_peermem: drain: new registrations are refused; 2 revoked through the core; 2 processes hold GPU memory
[   40.000100] nvidia_peermem: drain: process 4242 (ib_write_bw) holds 2 persistent registrations (4194304 bytes), which cannot be revoked: the drain completes when it deregisters them or exits
[   40.000200] nvidia_peermem: drain: process 4343 (nccl-test) holds 2 pins of GPU memory (131072 bytes), revoked for the device: the drain completes when it deregisters, frees the memory or exits
";
    let t = Tree::ours("doctor-drain");
    t.file(
        "/sys/module/nvidia_peermem/stats/waiting_for",
        "drain-holders\n",
    )
    .file("/dev/kmsg", log);
    assert_eq!(findings(&t, &[]), ["draining"]);
    let (_, lines, _) = doctor(&t, &[]);
    assert!(
        lines[0].contains("its latest drain named: process 4242 (ib_write_bw) holds 2 persistent")
            && lines[0].contains("; process 4343 (nccl-test) holds 2 pins")
            && !lines[0].contains("old_app"),
        "{}",
        lines[0]
    );
    t.file("/sys/module/nvidia_peermem/stats/waiting_for", "drained\n");
    assert_eq!(findings(&t, &[]), ["drained"]);
}

#[test]
fn doctor_bar1_near_the_limit() {
    let t = with_diag("doctor-bar1");
    t.file(
        "/sys/module/nvidia_peermem/parameters/bar1_limit_pct",
        "80\n",
    )
    .file(
        "/sys/module/nvidia_peermem/stats/gpus",
        "gpu=0000:00:04.0 live=1 pinned_bytes=65536 max_pinned_bytes=65536 gate_shared_bridge=unknown gate_other=unknown bar1_size=268435456 bar1_used=65536 max_bar1_used=65536 bar1_refused=0\n\
         gpu=0000:00:05.0 live=3 pinned_bytes=201326592 max_pinned_bytes=201326592 gate_shared_bridge=unknown gate_other=unknown bar1_size=268435456 bar1_used=201326592 max_bar1_used=201326592 bar1_refused=2\n",
    );
    let (_, lines, _) = doctor(&t, &[]);
    let l = lines
        .iter()
        .find(|l| l.starts_with("bar1-near-limit: "))
        .unwrap_or_else(|| panic!("{lines:?}"));
    assert!(
        l.contains("GPU 0000:00:05.0: 201326592 of 214748320 bytes (2 pins refused)")
            && !l.contains("0000:00:04.0"),
        "{l}"
    );
    // A release without the guard (no bar1_ keys): nothing said.
    t.file(
        "/sys/module/nvidia_peermem/stats/gpus",
        "gpu=0000:00:05.0 live=3 pinned_bytes=201326592 max_pinned_bytes=201326592\n",
    );
    assert!(!findings(&t, &[]).iter().any(|f| f == "bar1-near-limit"));
}

/// This release's layout (one value per file, the processes in root's
/// debugfs) shows what the tables of the earlier one did, in every view.
#[test]
fn one_value_per_file_reads_as_the_tables() {
    let (tables, files) = (with_diag("tables"), with_diag("files").into_files());
    assert!(files
        .at(&format!("{VIEWS}/gpus/0000:00:03.0/live"))
        .is_file());
    assert!(files
        .at(&format!("{VIEWS}/paths/0000:00:03.0-0000:00:02.0/failures"))
        .is_file());
    for args in [
        &[][..],
        &["paths"],
        &["--by-gpu"],
        &["--by-process"],
        &["paths", "--json"],
        &["--by-gpu", "--json"],
        &["--by-process", "--json"],
        &["--prometheus"],
        &["doctor"],
    ] {
        let (a, b) = (tables.run(args), files.run(args));
        assert_eq!((a.0, &a.2), (b.0, &b.2), "{args:?}");
        // The same lines; the counters' order is the files' (sorted).
        let lines = |s: &str| {
            let s = s.replace(&format!("{VIEWS}/processes"), &format!("{OLD}/processes"));
            let mut v: Vec<String> = s.lines().map(str::to_string).collect();
            v.sort();
            v
        };
        assert_eq!(lines(&a.1), lines(&b.1), "{args:?}");
    }
    // Without root's debugfs file: the processes alone are unavailable, and
    // say where they are.
    files.unmount_debugfs();
    let (_, out, _) = files.run(&["--by-process"]);
    assert_eq!(
        out,
        "Processes with live registrations: unavailable: the processes are root's: \
         /sys/kernel/debug/nvidia_peermem/processes (debugfs mounted, as root)\n"
    );
    let (code, out, _) = files.run(&["paths"]);
    assert!(code == 0 && out.contains("0000:00:03.0  PIX"), "{out}");
}
