/* SPDX-License-Identifier: MIT */
#ifndef AOQ_FULL_VERSION_H
#define AOQ_FULL_VERSION_H

/* The release and the build: "RELEASE+BUILD", or "RELEASE" when the build
 * is not known (the source was not a git checkout); proto/version.c. */
const char *aoq_full_version(void);

#endif
