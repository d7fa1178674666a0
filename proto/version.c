/* SPDX-License-Identifier: MIT */
/*
 * The version every aoq program and libaoq reports: the release (the meson
 * project's version), then '+' and the build (git describe) when the
 * source was a git checkout: "0.1.0+v0.1.0-12-g55cc8f8-dirty", "0.1.0".
 */
#include <string.h>

#include "aoq-build.h"
#include "aoq-config.h"
#include "aoq-version.h"

const char *aoq_full_version(void)
{
	/* outside a git checkout vcs_tag writes its fallback, the release */
	return *AOQ_BUILD && strcmp(AOQ_BUILD, AOQ_VERSION) != 0 ? AOQ_VERSION "+" AOQ_BUILD : AOQ_VERSION;
}
