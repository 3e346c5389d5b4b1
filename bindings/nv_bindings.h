/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * bindgen input: the NVIDIA kernel p2p API and the RDMA peer-memory client
 * API, exactly as the installed driver declares them (NVIDIA_SRC).
 */
#include <linux/types.h>
#include <linux/scatterlist.h>
#include "nv-p2p.h"
#include "peer_mem.h"

