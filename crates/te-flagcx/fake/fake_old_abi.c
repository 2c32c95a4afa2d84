/*
 * A library that says it implements te_flagcx_shim.h ABI 4 (the ABI before
 * te_flagcx_attempt) and nothing else: te must refuse it by its version, before
 * resolving any other symbol. Built by build.rs for tests only.
 */
#include <stdint.h>

uint32_t te_flagcx_shim_abi(void) { return 4; }
