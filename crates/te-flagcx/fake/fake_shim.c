/*
 * A FAKE implementation of te_flagcx_shim.h, for tests. It is not FlagCX.
 *
 * It keeps FlagCX's P2P engine's shape where te's backend depends on it:
 * - a connection carries a snapshot of the peer's registered regions, taken at
 *   connect time; a remote range outside the snapshot is refused as stale;
 * - a descriptor has a size limit (option max_desc), so the backend must split;
 * - completion is queried, and a transfer id is released once it reported done;
 * - a registration carries its remote rights: the target refuses a remote WRITE into
 *   memory not registered remotely writable and a READ from memory not registered
 *   remotely readable (TE_FLAGCX_E_ACCESS), whatever the initiator's snapshot says;
 * - a failed slice is "done": a transfer with failed slices finishes like any other,
 *   with a failed-slice count, as FlagCX's transfer task does, and the status comes
 *   from te_flagcx_status.h, the mapping the real shim uses.
 *
 * Bytes really move between processes: each engine listens on a loopback TCP port,
 * a connection is a TCP stream served by one thread on each side, and the target
 * checks every remote range against its own registrations before touching memory.
 * A transfer pins the regions it moves bytes in and holds no lock across the socket;
 * deregistering a region waits for its pins only.
 *
 * Options (engine_create, comma-separated key=value):
 *   host=127.0.0.1   address to listen on (IPv4)
 *   max_desc=N       per-descriptor size limit in bytes (default 1 GiB)
 *   delay_ms=N       a transfer moves its bytes N ms after it was posted, then
 *                    reports done
 *   fail_every=N     every Nth post of this engine finishes with a failed slice: its
 *                    last descriptor's bytes never move, the others do
 *   stale_every=N    every Nth post of this engine fails as a stale registration
 *   fail_connect=1   every connect of this engine fails as unreachable
 *   connect_delay_ms=N  every connect of this engine takes N ms more (a slow
 *                    handshake)
 *   attempt_delay_ms=N  every te_flagcx_attempt_create of this engine takes N ms
 *                    (a shim whose attempts are slow to make)
 *   transfer_timeout_ms=N  a transfer whose peer takes or sends none of its bytes
 *                    for N ms fails as unreachable and breaks its connection, as
 *                    a queue pair's retries run out (default 5000)
 *
 * te_flagcx_connect honours its timeout, te_flagcx_cancel_connects and the cancel of
 * its attempt (te_flagcx_attempt_cancel) at every step (before it begins, the TCP
 * connect, the slow handshake of connect_delay_ms, the peer's answer).
 *
 * te_flagcx_events / te_flagcx_wait block for real: each finished transfer bumps the
 * engine's event counter and wakes waiters.
 *
 * te_flagcx_fake_counter(name) reads process-wide counters for tests: "posts",
 * "descs", "connects", "misuse" (queries of unknown or released transfer ids), and
 * "attempts" (attempts created and not yet destroyed).
 *
 * This file holds the ABI's version and error functions and those counters; the
 * engine, the wire, the target side and the initiator side have a file each, listed
 * in fake_shim_internal.h.
 */
#include "fake_shim_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

FAKE_HIDDEN __thread char last_error[512];

FAKE_HIDDEN uint64_t counter_posts, counter_descs, counter_connects, counter_misuse,
    counter_attempts;

int fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return code;
}

/* ---------------------------------------------------------------- the ABI */

uint32_t te_flagcx_shim_abi(void) { return TE_FLAGCX_SHIM_ABI; }

const char *te_flagcx_shim_version(void) {
  return "te-flagcx FAKE shim 5 (loopback TCP; not FlagCX)";
}

const char *te_flagcx_last_error(void) { return last_error; }

/* Fake-only: process-wide counters for tests. */
uint64_t te_flagcx_fake_counter(const char *name) {
  if (!name)
    return 0;
  if (strcmp(name, "posts") == 0)
    return __atomic_load_n(&counter_posts, __ATOMIC_RELAXED);
  if (strcmp(name, "descs") == 0)
    return __atomic_load_n(&counter_descs, __ATOMIC_RELAXED);
  if (strcmp(name, "connects") == 0)
    return __atomic_load_n(&counter_connects, __ATOMIC_RELAXED);
  if (strcmp(name, "misuse") == 0)
    return __atomic_load_n(&counter_misuse, __ATOMIC_RELAXED);
  if (strcmp(name, "attempts") == 0)
    return __atomic_load_n(&counter_attempts, __ATOMIC_RELAXED);
  return 0;
}
