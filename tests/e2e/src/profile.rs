// SPDX-License-Identifier: GPL-2.0 OR MIT

//! `peermem-e2e profile <module> <impl> <key> [registrations]`: where a peer-memory client's own time
//! goes, from an ftrace `function_graph` trace of the core's ioctls (which
//! `make bench` records around `peermem-e2e loop`).
//!
//! The core calls each client callback through a frame of its own
//! (`pmc_client_<op>`), so a callback is visible whether or not the client's
//! functions are traceable (Rust functions are not). For each callback the
//! summary gives its calls, its time, the provider's share (the `nvidia_p2p_*`
//! calls, which no client can remove) and, for the rest, every kernel
//! function it reaches through the module's own code (functions of `<module>`
//! per /proc/kallsyms are looked through): calls and time per registration.
//! What is left is the module's code itself. Tracing adds a fixed cost to every traced call, so
//! the call counts are exact and the times are inflated by them: compare
//! implementations in one trace setting, never with untraced figures.
//! Prints `PROFILE {json}` lines.

use std::collections::{BTreeMap, HashSet};

/// The emulated core calls every client callback through a function of its
/// own named after the operation (`pmc_client_dma_map`, ...).
const CALL_PREFIX: &str = "pmc_client_";

/// One open call on a CPU's stack.
struct Frame {
    name: String,
    /// Index of the callback this frame belongs to, if inside one.
    callback: Option<usize>,
    /// This frame is the callback itself, a function of the module called
    /// from inside a callback, a provider call, or a kernel function called
    /// from the module's code (the unit of the breakdown).
    role: Role,
}

#[derive(Clone, Copy, PartialEq)]
enum Role {
    Outside,
    Callback,
    Module,
    Provider,
    Callee,
    /// Below a provider call or a callee: already counted above.
    Nested,
}

#[derive(Default)]
struct Callback {
    calls: u64,
    total_us: f64,
    provider_us: f64,
    /// Kernel functions the module's code called: (calls, µs).
    callees: BTreeMap<String, (u64, f64)>,
    module_calls: u64,
    /// `dma_map_resource` calls at any depth (the client's or the
    /// provider's): one IOMMU mapping each when the device is translated.
    dma_maps: u64,
}

/// Best-effort readable name of a Rust v0/legacy symbol: its last two path
/// components; C names unchanged.
fn readable(sym: &str) -> String {
    let name = sym.split_whitespace().next().unwrap_or(sym);
    let name = name.trim_end_matches("()");
    if !name.starts_with("_R") && !name.starts_with("_ZN") {
        return name.to_string();
    }
    let b = name.as_bytes();
    let mut idents = Vec::new();
    let mut i = 2;
    while i < b.len() {
        if b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_digit()) {
            let mut j = i;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            let n: usize = name[i..j].parse().unwrap_or(0);
            // v0 may put `_` before an identifier starting with a digit or _.
            let start = if j < b.len() && b[j] == b'_' {
                j + 1
            } else {
                j
            };
            if n > 0 && start + n <= b.len() && name.as_bytes()[start].is_ascii_alphabetic() {
                idents.push(&name[start..start + n]);
                i = start + n;
                continue;
            }
            i = j;
        } else {
            i += 1;
        }
    }
    match idents.len() {
        0 => name.to_string(),
        1 => idents[0].to_string(),
        n => format!("{}::{}", idents[n - 2], idents[n - 1]),
    }
}

/// Function names of `module`, from /proc/kallsyms.
fn module_symbols(module: &str) -> HashSet<String> {
    let tag = format!("[{module}]");
    std::fs::read_to_string("/proc/kallsyms")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.ends_with(&tag))
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect()
}

/// Parses one trace line: (cpu, duration µs, depth, text).
fn parse(line: &str) -> Option<(usize, Option<f64>, usize, &str)> {
    let (cpu, rest) = line.split_once(')')?;
    let cpu: usize = cpu.trim().parse().ok()?;
    let (dur, body) = rest.split_once('|')?;
    let dur = dur
        .trim()
        .trim_start_matches(['+', '!', '#', '*', '@', '$'])
        .trim()
        .strip_suffix("us")
        .and_then(|d| d.trim().parse::<f64>().ok());
    let body = body.strip_prefix(' ').unwrap_or(body);
    let depth = (body.len() - body.trim_start().len()) / 2;
    Some((cpu, dur, depth, body.trim()))
}

/// Books a finished frame of `us` microseconds.
fn finish(f: &Frame, us: f64, order: &[String], cbs: &mut BTreeMap<String, Callback>) {
    let Some(c) = f.callback.and_then(|i| order.get(i)) else {
        return;
    };
    let c = cbs.entry(c.clone()).or_default();
    if f.role != Role::Outside && readable(&f.name) == "dma_map_resource" {
        c.dma_maps += 1;
    }
    match f.role {
        Role::Callback => {
            c.calls += 1;
            c.total_us += us;
        }
        Role::Provider => c.provider_us += us,
        Role::Callee => {
            let e = c.callees.entry(readable(&f.name)).or_default();
            e.0 += 1;
            e.1 += us;
        }
        Role::Module => c.module_calls += 1,
        _ => (),
    }
}

/// Reads the trace and prints the summary for implementation `imp`.
pub fn run(args: &[String]) -> i32 {
    let (Some(module), Some(imp), Some(key)) = (args.first(), args.get(1), args.get(2)) else {
        eprintln!("usage: profile <module> <impl> <key> [registrations] [trace]");
        return 2;
    };
    let regs: f64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let path = args
        .get(4)
        .map_or("/sys/kernel/debug/tracing/trace", |s| s.as_str());
    let syms = module_symbols(module);
    if syms.is_empty() {
        println!("BENCH-FAIL profile: no symbols of {module} in /proc/kallsyms");
        return 1;
    }
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            println!("BENCH-FAIL profile: {path}: {e}");
            return 1;
        }
    };
    // A full ring drops the oldest events: the counts would be wrong.
    let lost: u64 = (0..64)
        .filter_map(|c| {
            std::fs::read_to_string(format!("/sys/kernel/debug/tracing/per_cpu/cpu{c}/stats")).ok()
        })
        .flat_map(|s| {
            s.lines()
                .filter_map(|l| l.strip_prefix("overrun:"))
                .filter_map(|v| v.trim().parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum();
    if lost > 0 {
        println!("BENCH-FAIL profile: the trace ring overran ({lost} events lost); give it more buffer_size_kb or fewer registrations");
        return 1;
    }
    let out = summarize(&text, &syms, imp, regs);
    let out: Vec<_> = out
        .into_iter()
        .map(|mut v| {
            v["key"] = serde_json::json!(key);
            v
        })
        .collect();
    if out.is_empty() {
        println!("BENCH-FAIL profile: no callback of {module} in the trace");
        return 1;
    }
    for v in out {
        println!("PROFILE {v}");
    }
    0
}

/// One summary per callback of the module whose functions are `syms`, per
/// registration (`regs` of them in the trace).
fn summarize(text: &str, syms: &HashSet<String>, imp: &str, regs: f64) -> Vec<serde_json::Value> {
    let mut stacks: BTreeMap<usize, Vec<Frame>> = BTreeMap::new();
    let mut cbs: BTreeMap<String, Callback> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut lines = 0u64;
    for line in text.lines() {
        let Some((cpu, dur, _depth, body)) = parse(line) else {
            continue;
        };
        lines += 1;
        let stack = stacks.entry(cpu).or_default();
        let is_exit = body.starts_with('}');
        let (name, opens) = if is_exit {
            (None, false)
        } else if let Some(n) = body.strip_suffix(" {") {
            (Some(n), true)
        } else if let Some(n) = body.strip_suffix(';') {
            (Some(n), false)
        } else {
            continue;
        };
        let role_of = |name: &str, parent: Option<&Frame>| -> (Role, Option<usize>) {
            let sym = name
                .split_whitespace()
                .next()
                .unwrap_or(name)
                .trim_end_matches("()");
            let mine = syms.contains(sym);
            let root = sym.starts_with(CALL_PREFIX);
            match parent {
                None => (if root { Role::Callback } else { Role::Outside }, None),
                Some(p) => match p.role {
                    Role::Outside if root => (Role::Callback, None),
                    Role::Outside => (Role::Outside, None),
                    Role::Callback | Role::Module if mine => (Role::Module, p.callback),
                    Role::Callback | Role::Module if sym.starts_with("nvidia_p2p_") => {
                        (Role::Provider, p.callback)
                    }
                    Role::Callback | Role::Module => (Role::Callee, p.callback),
                    _ => (Role::Nested, p.callback),
                },
            }
        };
        match name {
            Some(n) => {
                let (role, mut cb) = role_of(n, stack.last());
                if role == Role::Callback {
                    let r = readable(n).trim_start_matches(CALL_PREFIX).to_string();
                    let i = order.iter().position(|o| *o == r).unwrap_or_else(|| {
                        order.push(r);
                        order.len() - 1
                    });
                    cb = Some(i);
                }
                let f = Frame {
                    name: n.to_string(),
                    callback: cb,
                    role,
                };
                if opens {
                    stack.push(f);
                } else {
                    finish(&f, dur.unwrap_or(0.0), &order, &mut cbs);
                }
            }
            None => {
                if let Some(f) = stack.pop() {
                    finish(&f, dur.unwrap_or(0.0), &order, &mut cbs);
                }
            }
        }
    }
    let _ = lines;
    let mut out = Vec::new();
    for name in &order {
        let Some(c) = cbs.get(name) else { continue };
        let callees_us: f64 = c.callees.values().map(|v| v.1).sum();
        let mut callees: Vec<_> = c.callees.iter().collect();
        callees.sort_by(|a, b| {
            b.1 .1
                .partial_cmp(&a.1 .1)
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        let list: Vec<serde_json::Value> = callees
            .iter()
            .map(|(n, (k, us))| serde_json::json!([n, *k as f64 / regs, us / regs]))
            .collect();
        out.push(serde_json::json!({
            "impl": imp,
            "callback": name,
            "calls_per_reg": c.calls as f64 / regs,
            "us_per_reg": c.total_us / regs,
            "provider_us_per_reg": c.provider_us / regs,
            "own_code_us_per_reg": (c.total_us - c.provider_us - callees_us) / regs,
            "kernel_calls_per_reg": c.callees.values().map(|v| v.0).sum::<u64>() as f64 / regs,
            "module_calls_per_reg": c.module_calls as f64 / regs,
            "dma_maps_per_reg": c.dma_maps as f64 / regs,
            "callees": list,
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = "\
# tracer: function_graph
#
 0)               |  pmc_ioctl() {
 0)   1.000 us    |    mutex_lock();
 0)               |    pmc_client_dma_map() {
 0)               |      my_dma_map() {
 0)   2.000 us    |        __kmalloc_noprof();
 0)               |        my_helper() {
 0)               |          dma_map_resource() {
 0)   0.500 us    |            iommu_map();
 0)   3.000 us    |          } /* dma_map_resource */
 0)               |          nvidia_p2p_dma_map_pages() {
 0)   0.500 us    |            dma_map_resource();
 0)   9.000 us    |            kmalloc();
 0) + 10.000 us   |          } /* nvidia_p2p_dma_map_pages */
 0) + 14.000 us   |        } /* my_helper */
 1)   7.000 us    |  other();
 0) + 20.000 us   |      } /* my_dma_map */
 0) + 21.000 us   |    } /* pmc_client_dma_map */
 0)               |    pmc_client_release() {
 0)   1.000 us    |      kfree();
 0)   1.500 us    |    } /* pmc_client_release */
 0)   1.000 us    |    kfree();
 0) + 30.000 us   |  } /* pmc_ioctl */
";

    #[test]
    fn callbacks_callees_and_provider_time() {
        let syms: HashSet<String> = ["my_dma_map", "my_helper"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let out = summarize(TRACE, &syms, "ours", 2.0);
        assert_eq!(out.len(), 2);
        let m = &out[0];
        assert_eq!(m["callback"], "dma_map");
        assert_eq!(m["calls_per_reg"], 0.5);
        assert_eq!(m["us_per_reg"], 10.5);
        assert_eq!(m["provider_us_per_reg"], 5.0);
        // 21 - 10 (provider) - 2 (kmalloc) - 3 (dma_map_resource) = 6 µs of own code.
        assert_eq!(m["own_code_us_per_reg"], 3.0);
        assert_eq!(m["kernel_calls_per_reg"], 1.0);
        assert_eq!(m["module_calls_per_reg"], 1.0);
        // Ours and the provider's.
        assert_eq!(m["dma_maps_per_reg"], 1.0);
        assert_eq!(
            m["callees"][0],
            serde_json::json!(["dma_map_resource", 0.5, 1.5])
        );
        // The core's own kfree after the callback is not the client's.
        assert_eq!(out[1]["callback"], "release");
        assert_eq!(out[1]["own_code_us_per_reg"], 0.25);
        assert_eq!(out[1]["kernel_calls_per_reg"], 0.5);
    }

    #[test]
    fn rust_names_are_shortened() {
        assert_eq!(
            readable("_RNvNtCsabc_14nvidia_peermem6client7dma_map"),
            "client::dma_map"
        );
        assert_eq!(readable("sg_alloc_table()"), "sg_alloc_table");
    }
}
