/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * User interface of the peermem-rs test harness (mirrored by
 * tests/e2e/src/uapi.rs; every field is a u64 so both sides agree).
 *
 *   /dev/nv_p2p_emu      "cudaMalloc/cudaFree" on emulated GPUs
 *   /dev/peer_mem_core   "ibv_reg_mr/ibv_dereg_mr" and device DMA
 */
#ifndef PEERMEM_HARNESS_UAPI_H
#define PEERMEM_HARNESS_UAPI_H

#include <linux/ioctl.h>
#include <linux/types.h>

/* --- nv_p2p_emu -------------------------------------------------------- */

struct nvemu_alloc {
	__u64 gpu;	/* in: GPU index */
	__u64 size;	/* in: bytes (rounded up to 64 KiB) */
	__u64 offset;	/* out: mmap offset of the allocation */
};

struct nvemu_info {
	__u64 gpus;		/* number of emulated GPUs */
	__u64 bar_size[4];	/* usable BAR1 bytes per GPU */
	__u64 bar_free[4];	/* free BAR1 bytes per GPU */
	__u64 pins;		/* successful nvidia_p2p_get_pages */
	__u64 persistent_pins;	/* successful nvidia_p2p_get_pages_persistent */
	__u64 unpins;		/* page tables freed by put_pages[_persistent] */
	__u64 callbacks;	/* free callbacks called */
	__u64 live_tables;	/* page tables alive */
	__u64 live_mappings;	/* DMA mappings alive */
	__u64 dma_maps;		/* successful nvidia_p2p_dma_map_pages */
	__u64 live_allocs;	/* allocations whose BAR space is still held */
	__u64 provider_bytes;	/* kernel memory held by live page tables and mappings */
	__u64 provider_ns;	/* time spent inside the exported p2p calls */
	__u64 foreign_puts;	/* nvidia_p2p_put_pages from a process other than the pinner: 0, pin kept */
	__u64 failed_unpins;	/* injected put_pages[_persistent] failures returned */
	__u64 stale_puts;	/* HARNESS FAILURES: put_pages_persistent, dma_map or dma_unmap on a dead table */
	__u64 deferred_callbacks; /* free callbacks from the nv_queue kernel thread after the owner exited */
	__u64 reused_tables;	/* pins handed the address of a just-freed page table */
	__u64 topo_refusals;	/* dma_map_pages refused by the topology gate (-ENOTSUPP) */
	__u64 rm_reentries;	/* RM entered by the RM lock's holder (from a free callback): -EIO */
	__u64 provider_map_ns;	/* part of provider_ns inside dma_map_pages/dma_unmap_pages */
};

/*
 * mmap offsets below NVEMU_MMAP_ALLOC_END allocate on mmap: offset
 * NVEMU_MMAP_ALLOC(gpu) gives a new allocation of the mapping's size on that
 * GPU, owned by the mapping (munmap or exit frees it), so that an unmodified
 * program gets GPU memory from `mmap` of /dev/nv_p2p_emu (perftest
 * --mmap=/dev/nv_p2p_emu, offset 0: GPU 0). The allocations made so are in
 * debugfs mmap_allocs; gpu<i>_mem reads and writes a GPU's memory; cudafree
 * frees one by GPU and BAR offset.
 */
#define NVEMU_MMAP_ALLOC(gpu)	((__u64)(gpu) << 32)
#define NVEMU_MMAP_ALLOC_END	(1ULL << 40)

#define NVEMU_IOC_ALLOC	_IOWR('N', 1, struct nvemu_alloc)
#define NVEMU_IOC_FREE	_IOW('N', 2, __u64)	/* cudaFree(va): free now, keep the VMA */
#define NVEMU_IOC_INFO	_IOR('N', 3, struct nvemu_info)

/*
 * Knobs in /sys/kernel/debug/nv_p2p_emu/:
 *   inject                "<name> <count> <errno>": fail the next <count> calls of get_pages,
 *                         get_pages_persistent, dma_map_pages, put_pages, put_pages_persistent
 *                         or dma_unmap_pages with <errno> (< 0), changing nothing
 *   free_delay_ms         sleep before each free callback (RM lock held)
 *   callback_hold_ms      sleep after each free callback returns, before RM drops its lock
 *   callbacks_running     (read-only) free callbacks whose RM-locked section has not ended
 *   race_free_on_pin      the next N non-persistent pins get a racing cudaFree
 *   dma_map_style         NVEMU_DMA_MAP_* below
 *   deferred_teardown_ms  0: off; else an exiting owner's allocations are torn down (callbacks
 *                         included) that long later on the "nv_queue" kernel thread
 *   reuse_tables          1: a new pin gets the address of the most recently freed page table
 *   p2p_unsupported_chipset  1: the chipset is flagged as unsafe for peer-to-peer
 *                         (NV_FLAG_PCI_P2P_UNSUPPORTED_CHIPSET): dma_map_pages fails with
 *                         -ENOTSUPP (524) for a peer with no upstream bridge in common with the GPU
 *   topo_check_override   NVreg_GrdmaPciTopoCheckOverride: 0 check, 1 allow, 2 deny every peer
 */
#define NVEMU_DMA_MAP_PAGES	0	/* one dma_map_resource per 64 KiB page, ascending (RM; default) */
#define NVEMU_DMA_MAP_SHUFFLED	1	/* one per page, pages mapped in a seeded random order */
#define NVEMU_DMA_MAP_RUNS	2	/* one per physically contiguous run (contiguous DMA addresses) */

/* --- peer_mem_core ----------------------------------------------------- */

#define PMC_REG_INVAL_SUPP	(1 << 0)	/* an MR (IB_PEER_MEM_INVAL_SUPP) */
#define PMC_REG_NON_PCI_DEV	(1 << 1)	/* hand a non-PCI dma_device */
#define PMC_REG_READ_ONLY	(1 << 2)
#define PMC_REG_REMAP		(1 << 3)	/* dma_unmap and dma_map again before use */

struct pmc_reg {
	__u64 addr;	/* in */
	__u64 len;	/* in */
	__u64 flags;	/* in: PMC_REG_* */
	__u64 handle;	/* out */
};

#define PMC_SRC_HOST	1	/* pinned by pin_user_pages_fast */
#define PMC_SRC_PEER	2	/* claimed by a peer-memory client */

#define PMC_STATE_MAPPED	1
#define PMC_STATE_INVALIDATED	2
#define PMC_STATE_UNMAPPED	3

struct pmc_query {
	__u64 handle;		/* in */
	__u64 source;		/* PMC_SRC_* */
	__u64 state;		/* PMC_STATE_* */
	__u64 revoked;		/* the device can no longer reach it */
	__u64 nmap;		/* SG entries */
	__u64 page_size;	/* client's get_page_size */
	__u64 first_dma;	/* first SGE after fix-up */
	__u64 first_len;
	__u64 last_len;		/* last SGE length after fix-up */
	__u64 total_len;	/* sum of SGE lengths after fix-up */
	char client[64];	/* client name */
};

#define PMC_DMA_TO_MR	1	/* host buffer -> device -> MR */
#define PMC_DMA_FROM_MR	2	/* MR -> device -> host buffer */

struct pmc_dma {
	__u64 handle;
	__u64 offset;	/* byte offset from the MR's start address */
	__u64 len;
	__u64 dir;	/* PMC_DMA_* */
	__u64 buf;	/* user buffer */
};

struct pmc_info {
	__u64 hca_present;
	__u64 live_umems;
	__u64 clients;
	__u64 invalidations;	/* invalidate hook calls */
	__u64 dma_bytes;
};

/*
 * The DMA scatterlist the core holds for a mapped peer MR, after the core's
 * first/last SGE fix-up: what the HCA driver hands to ib_umem_find_best_pgsz
 * (make bench computes mlx5's translation entries from it).
 */
struct pmc_sge {
	__u64 dma;
	__u64 len;
};

struct pmc_sgl {
	__u64 handle;	/* in */
	__u64 entries;	/* in: user pointer to struct pmc_sge[capacity] */
	__u64 capacity;	/* in */
	__u64 nents;	/* out: SG entries (only min(nents, capacity) copied) */
	__u64 addr;	/* out: the MR's start address (the application's VA) */
	__u64 len;	/* out */
};

#define PMC_IOC_REG	_IOWR('P', 1, struct pmc_reg)
#define PMC_IOC_DEREG	_IOW('P', 2, __u64)
#define PMC_IOC_QUERY	_IOWR('P', 3, struct pmc_query)
#define PMC_IOC_DMA	_IOW('P', 4, struct pmc_dma)
#define PMC_IOC_INFO	_IOR('P', 5, struct pmc_info)
#define PMC_IOC_SGL	_IOWR('P', 6, struct pmc_sgl)

#endif
