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
};

#define NVEMU_IOC_ALLOC	_IOWR('N', 1, struct nvemu_alloc)
#define NVEMU_IOC_FREE	_IOW('N', 2, __u64)	/* cudaFree(va): free now, keep the VMA */
#define NVEMU_IOC_INFO	_IOR('N', 3, struct nvemu_info)

/* --- peer_mem_core ----------------------------------------------------- */

#define PMC_REG_INVAL_SUPP	(1 << 0)	/* an MR (IB_PEER_MEM_INVAL_SUPP) */
#define PMC_REG_NON_PCI_DEV	(1 << 1)	/* hand a non-PCI dma_device */
#define PMC_REG_READ_ONLY	(1 << 2)

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

#define PMC_IOC_REG	_IOWR('P', 1, struct pmc_reg)
#define PMC_IOC_DEREG	_IOW('P', 2, __u64)
#define PMC_IOC_QUERY	_IOWR('P', 3, struct pmc_query)
#define PMC_IOC_DMA	_IOW('P', 4, struct pmc_dma)
#define PMC_IOC_INFO	_IOR('P', 5, struct pmc_info)

#endif
