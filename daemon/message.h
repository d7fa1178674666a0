/* SPDX-License-Identifier: MIT */
/* Messages (message.c): the message table and dispatch().  Loop thread. */
#ifndef AOQD_MESSAGE_H
#define AOQD_MESSAGE_H

struct aoqd_session;

/* Decodes and handles every whole frame in s's buffer, at most a turn's
 * worth (the rest waits for the next wake), unless a deferred reply
 * (StepEnd, a transfer, a registration waiting for a lease) holds the
 * connection: replies go out in request order. */
void aoqd_session_frames(struct aoqd_session *s);

#endif
