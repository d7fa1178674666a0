/* SPDX-License-Identifier: MIT */
/* Registration (register.c): Register frames build the optimizer state
 * and the arena; SetHyperparams changes a group's. */
#ifndef AOQD_REGISTER_H
#define AOQD_REGISTER_H

#include <stdint.h>
#include <uv.h>

#include "aoq.pb-c.h"
#include "error.h"

struct aoqd_session;

/* Tensors (and groups) one Register frame may carry: its work fits in a
 * few ms of the loop.  libaoq sends 256 per frame. */
#define AOQD_MAX_TENSORS_PER_FRAME 4096u

/* Called on the last Register frame once the tables are read: 1 when it
 * gave the session a leased state (lease.c, replica.c), 0 when
 * the state is to be made, -errno with err filled. */
typedef int (*aoqd_adopt_fn)(struct aoqd_session *s, struct aoqd_error *err);
/* One Register frame.  What it allocates is charged to the uid's account
 * (s->st.account) first; on_doorbell: what runs when the client rings (its
 * data is the session). */
int aoqd_register(struct aoqd_session *s, const Aoq__Register *m, uv_poll_cb on_doorbell, aoqd_adopt_fn adopt,
                  struct aoqd_error *err);
/* The last frame's work once its tables are in (aoqd_register calls it; the
 * session calls it again when adopt answered that it waits).  A
 * registration of many tensors maps its state and builds its arena on a
 * thread of its own: AOQD_BUILDING, and the wake after s->build_done finishes it with
 * aoqd_register_built (the loop leaves s->st and s->arena alone while
 * s->building). */
#define AOQD_BUILDING 4
int aoqd_register_finish(struct aoqd_session *s, uv_poll_cb on_doorbell, aoqd_adopt_fn adopt, struct aoqd_error *err);
int aoqd_register_built(struct aoqd_session *s, uv_poll_cb on_doorbell, struct aoqd_error *err);
/* Replica groups (docs/design.md, "Replica groups"; replica.c decides
 * which): the first member's tables become the new hub's state, which is
 * made with the group's arena (a lane per local rank) — with `resumed`,
 * replica.c has put a leased group's state in hub->st already and only the
 * arena is made; a later member's
 * options and layout must be the group's (its tables are then freed); a
 * member gets its view of the arena and the Registered reply.  0 (or
 * AOQD_REPLIED), or -errno with err filled. */
int aoqd_register_hub(struct aoqd_session *hub, struct aoqd_session *s, bool resumed, struct aoqd_error *err);
int aoqd_register_same(struct aoqd_session *s, const struct aoqd_session *hub, struct aoqd_error *err);
int aoqd_register_member(struct aoqd_session *s, struct aoqd_session *hub, uv_poll_cb on_doorbell,
                         struct aoqd_error *err);
int aoqd_on_set_hyperparams(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);

#endif
