/* SPDX-License-Identifier: MIT */
/*
 * State transfer through the arena's transfer area (transfer.c): LoadState
 * and ReadState in pieces, the initial values at registration, TensorSteps.
 */
#ifndef AOQ_CLIENT_TRANSFER_H
#define AOQ_CLIENT_TRANSFER_H

#include "client.h"

/* Tensor i's initial values into the daemon's master.  Caller holds
 * ctl_lock. */
int aoqc_load_initial(struct aoq_client *c, uint32_t i);
/* A resumed session: tensor i's parameter from the daemon's master.
 * Caller holds ctl_lock. */
int aoqc_load_resumed(struct aoq_client *c, uint32_t i);

#endif
