/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * bindgen input: the NVIDIA kernel p2p API and the RDMA peer-memory client
 * API, exactly as the installed driver declares them (NVIDIA_SRC).
 */
#include <linux/types.h>
#include <linux/scatterlist.h>
#include "nv-p2p.h"
#include "peer_mem.h"


/*
 * The entry points nvidia_peermem binds at run time (src/exports.rs,
 * src/binding.rs), typed by the headers' own declarations: `typeof` takes the
 * type without referring to the symbol, so the module links against none of
 * them and the module loader checks no CRC for them.
 */
struct peermem_p2p_api {
	typeof(&nvidia_p2p_get_pages) get_pages;
	typeof(&nvidia_p2p_get_pages_persistent) get_pages_persistent;
	typeof(&nvidia_p2p_put_pages) put_pages;
	typeof(&nvidia_p2p_put_pages_persistent) put_pages_persistent;
	typeof(&nvidia_p2p_dma_map_pages) dma_map_pages;
	typeof(&nvidia_p2p_dma_unmap_pages) dma_unmap_pages;
};

struct peermem_core_api {
	typeof(&ib_register_peer_memory_client) register_client;
	typeof(&ib_unregister_peer_memory_client) unregister_client;
};
