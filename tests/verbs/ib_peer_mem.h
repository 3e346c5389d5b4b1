/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The peer-memory interface of a peer-aware RDMA core: peermem-rs's own
 * implementation, built into ib_uverbs of a copy of Debian's
 * drivers/infiniband (scripts/build-verbs). The client-facing ABI
 * (struct peer_memory_client, ib_register_peer_memory_client) is the one of
 * peer_mem.h; this header is the driver-facing side.
 */
#ifndef IB_PEER_MEM_H
#define IB_PEER_MEM_H

#include <linux/device.h>
#include <rdma/ib_umem.h>

enum ib_peer_mem_flags {
	IB_PEER_MEM_ALLOW = 1 << 0,
	IB_PEER_MEM_INVAL_SUPP = 1 << 1,
};

typedef void (*umem_invalidate_func_t)(struct ib_umem *umem, void *priv);

/*
 * ib_umem_get with the peer path: pin_user_pages_fast first; if that fails
 * and IB_PEER_MEM_ALLOW is set, the registered peer clients are asked, their
 * scatterlist DMA-mapped for @dma_device (the device's own when NULL).
 */
struct ib_umem *ib_umem_get_peer(struct ib_device *device, struct device *dma_device,
				 unsigned long addr, size_t size, int access,
				 unsigned long peer_mem_flags);
bool ib_umem_is_peer(struct ib_umem *umem);
/* After the HW object exists: invalidations now reach @func (may sleep). */
void ib_umem_activate_invalidation_notifier(struct ib_umem *umem,
					    umem_invalidate_func_t func, void *priv);
/* Before dereg: no invalidation reaches the driver after this returns. */
void ib_umem_stop_invalidation_notifier(struct ib_umem *umem);

/* umem.c <-> peer_mem.c (both in ib_uverbs) */
struct ib_umem *ib_peer_umem_get(struct ib_umem *old, struct device *dma_device,
				 int old_ret, unsigned long peer_mem_flags);
void ib_peer_umem_release(struct ib_umem *umem);

#endif
