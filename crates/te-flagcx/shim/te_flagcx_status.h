/*
 * te_flagcx_status.h: how both shims turn what the library knows about a finished
 * transfer into a te_flagcx_query status. Shared by te_flagcx_shim.cc and the fake, so
 * the fake's tests exercise the mapping the real shim uses.
 *
 * FlagCX counts a slice that failed (a work completion with an error, a slice it could
 * not submit) as done: its transfer task reports "all done" with a failed count above
 * zero. "Finished" is therefore not "succeeded"; only finished with no failed slice is.
 */
#ifndef TE_FLAGCX_STATUS_H
#define TE_FLAGCX_STATUS_H

#include <stdint.h>

#include "te_flagcx_shim.h"

/* The status of a transfer that has `finished` (non-zero once every slice is done,
   failed or not) with `failed_slices` of its slices failed. */
static inline int te_flagcx_status(int finished, uint64_t failed_slices) {
  if (!finished)
    return TE_FLAGCX_PENDING;
  return failed_slices == 0 ? TE_FLAGCX_OK : TE_FLAGCX_E_TRANSFER;
}

#endif /* TE_FLAGCX_STATUS_H */
