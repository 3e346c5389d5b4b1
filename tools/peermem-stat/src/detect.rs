// SPDX-License-Identifier: GPL-2.0 OR MIT

//! Which files user-space stacks look for to decide GPUDirect RDMA over IB
//! verbs is available. Data only: edit the tables, not the code.

/// One detection rule: `stack` enables GPUDirect RDMA when `path` exists.
/// A stack is enabled when any of its rules matches; rules are tried in order.
#[derive(Debug)]
pub struct Rule {
    pub stack: &'static str,
    pub path: &'static str,
    pub meaning: &'static str,
}

/// Sources: NVIDIA/nccl src/transport/net_ib (gdr.cc), openucx/ucx
/// src/uct/ib/base/ib_md.c, open-mpi/ompi opal/mca/btl/openib/btl_openib_mca.c,
/// NVIDIA/nvshmem src/modules/transport/common/transport_ib_common.cpp,
/// NVIDIA/gds-nvidia-fs src/nvfs-stat.c. Every one only tests that the file
/// exists; none reads it.
pub const RULES: &[Rule] = &[
    Rule {
        stack: "NCCL",
        path: "/sys/kernel/mm/memory_peers/nv_mem/version",
        meaning: "net_ib gdr.cc ncclIbGdrSupport: GPUDirect RDMA over IB verbs",
    },
    Rule {
        stack: "NCCL",
        path: "/sys/kernel/mm/memory_peers/nv_mem_nc/version",
        meaning: "net_ib gdr.cc ncclIbGdrSupport: GPUDirect RDMA over IB verbs",
    },
    Rule {
        stack: "NCCL",
        path: "/sys/module/nvidia_peermem/version",
        meaning: "ncclIbGdrSupport, and ncclIbPeerMemSupport (the only path the GDAKI transport accepts)",
    },
    Rule {
        stack: "UCX",
        path: "/sys/kernel/mm/memory_peers/nv_mem/version",
        meaning: "ib_md.c uct_ib_check_gpudirect_driver: CUDA memory registrable on IB (every release)",
    },
    Rule {
        stack: "UCX",
        path: "/sys/module/nvidia_peermem/version",
        meaning: "ib_md.c uct_ib_check_gpudirect_driver: CUDA memory registrable on IB (UCX 1.18+)",
    },
    Rule {
        stack: "UCX",
        path: "/sys/module/nv_peer_mem/version",
        meaning: "ib_md.c uct_ib_check_gpudirect_driver: Mellanox's old nv_peer_mem (UCX 1.18+)",
    },
    Rule {
        stack: "Open MPI",
        path: "/sys/kernel/mm/memory_peers/nv_mem/version",
        meaning: "btl_openib_mca.c: btl_openib_have_driver_gdr (the openib BTL; Open MPI 5 uses UCX)",
    },
    Rule {
        stack: "NVSHMEM",
        path: "/sys/kernel/mm/memory_peers/nv_mem/version",
        meaning: "transport_ib_common nvshmemt_ib_common_nv_peer_mem_available (used when dma-buf is not)",
    },
    Rule {
        stack: "NVSHMEM",
        path: "/sys/kernel/mm/memory_peers/nvidia-peermem/version",
        meaning: "transport_ib_common nvshmemt_ib_common_nv_peer_mem_available",
    },
    Rule {
        stack: "NVSHMEM",
        path: "/sys/module/nvidia_peermem/version",
        meaning: "transport_ib_common nvshmemt_ib_common_nv_peer_mem_available (newer releases)",
    },
    Rule {
        stack: "nvidia-fs",
        path: "/sys/kernel/mm/memory_peers/nv_mem/version",
        meaning: "nvfs-stat.c: \"Mellanox PeerDirect Supported\" in /proc/driver/nvidia-fs/stats",
    },
];

/// The dma-buf alternative (no peer-memory client needed). Informational.
#[derive(Debug)]
pub struct DmaBufRule {
    /// The NVIDIA GPU driver's module directory (its `version` file is read).
    pub module: &'static str,
    /// Oldest driver branch with dma-buf export of GPU memory.
    pub min_driver_major: u64,
    /// Oldest kernel (major, minor) with dma-buf MRs in the RDMA core.
    pub min_kernel: (u64, u64),
    pub note: &'static str,
}

pub const DMABUF: DmaBufRule = DmaBufRule {
    module: "/sys/module/nvidia",
    min_driver_major: 515,
    min_kernel: (5, 12),
    note: "dma-buf needs the NVIDIA open kernel modules >= 515 and Linux >= 5.12",
};

/// The stacks of [`RULES`], in table order, each once.
pub fn stacks() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = Vec::new();
    for r in RULES {
        if !v.contains(&r.stack) {
            v.push(r.stack);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_sane() {
        assert_eq!(
            stacks(),
            ["NCCL", "UCX", "Open MPI", "NVSHMEM", "nvidia-fs"]
        );
        for r in RULES {
            assert!(r.path.starts_with("/sys/"), "{}", r.path);
            assert!(!r.meaning.is_empty());
        }
    }
}
