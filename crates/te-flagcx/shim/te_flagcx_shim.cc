/*
 * te_flagcx_shim.h over FlagCX's point-to-point engine (flagcx_p2p.h, FlagCX >= 0.13).
 *
 * Built by crates/te-flagcx/build.rs only when FLAGCX_HOME is set:
 *   c++ -std=c++17 -shared -fPIC -I$FLAGCX_HOME/include te_flagcx_shim.cc
 *       -L$FLAGCX_HOME/lib -lflagcx -Wl,-rpath,$FLAGCX_HOME/lib
 * (build.rs adds -DTE_FLAGCX_HAVE_XFER_RESULT when flagcx_p2p.h declares
 * flagcxP2pEngineXferResult, see below).
 *
 * What FlagCX gives and how it is used here:
 * - flagcxP2pEngineCreate / StartRpcServer / GetMetadata: an engine, its accept daemon
 *   and its "ip:port?gpu?notif" metadata, whose "ip:port" part is the endpoint.
 * - flagcxP2pEngineConnect: a new connection; its handshake copies the peer's
 *   registered-region table into the connection (a snapshot). The cached
 *   flagcxP2pEngineGetConn is not used, because its connections can never be renewed.
 *   It takes no timeout and cannot be interrupted, so te_flagcx_connect runs it on a
 *   helper thread and waits at most its timeout (or until te_flagcx_cancel_connects,
 *   or its attempt's te_flagcx_attempt_cancel); a helper whose caller gave up stays in
 *   flagcxP2pEngineConnect until FlagCX returns, then destroys the connection it got,
 *   and te_flagcx_engine_destroy waits for every helper, because each uses the engine.
 *   So a cancel releases te's caller at once, while FlagCX's connect (and its helper
 *   thread) runs on until FlagCX gives up on the peer.
 * - flagcxP2pEngineMakeDesc: resolves a remote address against that snapshot; a miss
 *   is TE_FLAGCX_E_STALE, so the caller reconnects.
 * - flagcxP2pEngineReadVector / WriteVector: post, non-blocking.
 * - Completion. flagcxP2pEngineXferStatus returns true once every slice is done, and
 *   a failed slice counts as done: flagcx/core/flagcx_p2p.cc only logs "transfer
 *   completed with N failed slices" (pool transfers, from FlagcxTransferTask's
 *   failedCount), returns true when the adaptor's test() fails (single transfers) or
 *   the IPC event query fails, and ReadVector/WriteVector turn a slice that could not
 *   be submitted into one failed sentinel slice while returning 0. Its public API has
 *   no call that says whether a finished transfer failed. So this shim never maps
 *   XferStatus's true to TE_FLAGCX_OK: it needs flagcxP2pEngineXferResult (the API
 *   change docs/flagcx.md describes), and without it te_flagcx_engine_create refuses
 *   to start, saying why.
 * - No blocking wait: FlagCX's own workers poll their completion queues. te_flagcx_wait
 *   yields and returns, so te's completion thread polls while transfers are in flight
 *   and sleeps on a condition variable otherwise.
 * - Rights. flagcxP2pRpcRegister / RegisterHost take no access flags: FlagCX registers
 *   every region for remote READ and WRITE and sends its whole (process-wide) region
 *   table to every peer in the handshake. The shim cannot restrict what a peer does
 *   with a region, so it refuses to register memory with fewer rights than that
 *   (local-only, read-only, write-only) unless the engine was created with
 *   unrestricted=1, by which the operator accepts that every registered region is
 *   readable and writable by every peer.
 * - flagcxP2pEngineMrDestroy deregisters at once, whatever is in flight; te's backend
 *   calls te_flagcx_deregister only after its transfers on the memory finished.
 * - A descriptor's size is a uint32_t in FlagCX (FlagcxP2pRdmaDesc::size, MakeDesc),
 *   so te_flagcx_max_desc_len is below 4 GiB and the caller splits larger copies.
 */
#include "te_flagcx_shim.h"
#include "te_flagcx_status.h"

#include "flagcx_p2p.h"

#include <sched.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <system_error>
#include <thread>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

namespace {

thread_local char lastError[512];

int fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(lastError, sizeof lastError, fmt, ap);
  va_end(ap);
  return code;
}

/* FlagCX slices at 1 GiB by default; one descriptor never exceeds it, so neither the
   uint32_t descriptor size nor a slice length can truncate. */
constexpr uint64_t kDefaultMaxDesc = 1ull << 30;
constexpr uint64_t kHardMaxDesc = 0xFFFFFFFFull;

/* Descriptor vectors reused by each posting thread, so a WRITE post allocates nothing
   once they have grown. ReadVector takes its vectors by value, so FlagCX copies them
   on every READ post whatever the shim does (docs/flagcx.md). */
struct Scratch {
  std::vector<FlagcxP2pMr> mrs;
  std::vector<void *> addrs;
  std::vector<size_t> sizes;
  std::vector<FlagcxP2pRdmaDesc> remote;
};
thread_local Scratch scratch;

} // namespace

struct te_flagcx_engine {
  FlagcxP2pEngine *engine = nullptr;
  uint64_t maxDesc = kDefaultMaxDesc;
  std::string memory = "host,cuda";
  /* unrestricted=1: register memory FlagCX exposes more than te asked (see above). */
  bool unrestricted = false;
  std::mutex lock; /* guards endpoint */
  std::string endpoint;
  bool serving = false;
  std::atomic<uint64_t> events{0};
  /* Connects in progress (see te_flagcx_connect). */
  std::mutex connectLock;
  std::condition_variable connectChanged;
  unsigned helpers = 0;   /* helper threads still inside flagcxP2pEngineConnect */
  bool cancelled = false; /* te_flagcx_cancel_connects was called */
};

/* A connection attempt's cancel (te_flagcx_attempt_*): `cancelled` is read and written
   under its engine's connectLock, whose condition variable its connects wait on. */
struct te_flagcx_attempt {
  te_flagcx_engine *engine = nullptr;
  bool cancelled = false;
};

/* One connect's helper thread and its caller, under the engine's connectLock. */
struct PendingConnect {
  bool done = false;
  bool abandoned = false; /* the caller gave up: the helper destroys the connection */
  FlagcxP2pConn *conn = nullptr;
};

struct te_flagcx_conn {
  te_flagcx_engine *engine = nullptr;
  FlagcxP2pConn *conn = nullptr;
  std::string peer;
};

static int parseOptions(te_flagcx_engine *e, const char *options) {
  if (options == nullptr)
    return TE_FLAGCX_OK;
  std::string all(options);
  size_t start = 0;
  while (start <= all.size()) {
    size_t end = all.find(',', start);
    if (end == std::string::npos)
      end = all.size();
    std::string item = all.substr(start, end - start);
    start = end + 1;
    while (!item.empty() && item.front() == ' ')
      item.erase(0, 1);
    if (item.empty())
      continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos)
      return fail(TE_FLAGCX_E_INVALID, "shim option `%s` is not key=value",
                  item.c_str());
    std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "max_desc") {
      char *endp = nullptr;
      errno = 0;
      unsigned long long v = std::strtoull(value.c_str(), &endp, 10);
      if (errno != 0 || endp == nullptr || *endp != 0 || v == 0 ||
          v > kHardMaxDesc || value[0] == '-')
        return fail(TE_FLAGCX_E_INVALID,
                    "shim option max_desc=%s must be 1..=%llu", value.c_str(),
                    (unsigned long long)kHardMaxDesc);
      e->maxDesc = v;
    } else if (key == "unrestricted") {
      if (value != "0" && value != "1")
        return fail(TE_FLAGCX_E_INVALID,
                    "shim option unrestricted=%s must be 0 or 1", value.c_str());
      e->unrestricted = value == "1";
    } else if (key == "memory") {
      std::string kinds;
      for (char ch : value)
        kinds.push_back(ch == '+' ? ',' : ch);
      e->memory = kinds;
    } else {
      return fail(TE_FLAGCX_E_INVALID,
                  "unknown shim option `%s` (known: max_desc, memory, "
                  "unrestricted)",
                  key.c_str());
    }
  }
  return TE_FLAGCX_OK;
}

/* "host" or "RUNTIME:N" -> whether it is host memory. */
static bool isHost(const char *memory) {
  return std::strcmp(memory, "host") == 0;
}

static bool runtimeAllowed(const te_flagcx_engine *e, const char *memory) {
  std::string runtime(memory);
  size_t colon = runtime.find(':');
  if (colon != std::string::npos)
    runtime.resize(colon);
  std::string list = "," + e->memory + ",";
  return list.find("," + runtime + ",") != std::string::npos;
}

extern "C" {

uint32_t te_flagcx_shim_abi(void) { return TE_FLAGCX_SHIM_ABI; }

const char *te_flagcx_shim_version(void) {
  return "te-flagcx shim 5 over FlagCX p2p (flagcx_p2p.h)";
}

const char *te_flagcx_last_error(void) { return lastError; }

int te_flagcx_engine_create(const char *options, te_flagcx_engine **out) {
  if (out == nullptr)
    return fail(TE_FLAGCX_E_INVALID, "engine_create: null out pointer");
  te_flagcx_engine *e = new (std::nothrow) te_flagcx_engine();
  if (e == nullptr)
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  int rc = parseOptions(e, options);
  if (rc != TE_FLAGCX_OK) {
    delete e;
    return rc;
  }
#ifndef TE_FLAGCX_HAVE_XFER_RESULT
  delete e;
  return fail(TE_FLAGCX_E_UNSUPPORTED,
              "this FlagCX cannot report failed transfers: "
              "flagcxP2pEngineXferStatus says a transfer with failed slices is "
              "finished, and flagcx_p2p.h declares no flagcxP2pEngineXferResult, so "
              "te would report data as delivered that never arrived; build the shim "
              "against a FlagCX that has it (docs/flagcx.md, \"What te needs from "
              "FlagCX\")");
#else
  e->engine = flagcxP2pEngineCreate();
  if (e->engine == nullptr) {
    delete e;
    return fail(TE_FLAGCX_E_INTERNAL,
                "flagcxP2pEngineCreate failed (no usable RDMA device or device "
                "runtime? run with FLAGCX_DEBUG=INFO for FlagCX's reason)");
  }
  *out = e;
  return TE_FLAGCX_OK;
#endif
}

void te_flagcx_engine_destroy(te_flagcx_engine *e) {
  if (e == nullptr)
    return;
  te_flagcx_cancel_connects(e);
  {
    /* Helpers still in flagcxP2pEngineConnect use the engine: FlagCX cannot
       interrupt them, so this waits until FlagCX gives up on their peers. */
    std::unique_lock<std::mutex> guard(e->connectLock);
    e->connectChanged.wait(guard, [e] { return e->helpers == 0; });
  }
  flagcxP2pEngineDestroy(e->engine);
  delete e;
}

int te_flagcx_start_server(te_flagcx_engine *e) {
  if (e == nullptr)
    return fail(TE_FLAGCX_E_INVALID, "start_server: null engine");
  std::lock_guard<std::mutex> guard(e->lock);
  if (e->serving)
    return TE_FLAGCX_OK;
  if (flagcxP2pEngineStartRpcServer(e->engine) != 0)
    return fail(TE_FLAGCX_E_INTERNAL, "flagcxP2pEngineStartRpcServer failed");
  char *metadata = nullptr;
  if (flagcxP2pEngineGetMetadata(e->engine, &metadata) != 0 ||
      metadata == nullptr)
    return fail(TE_FLAGCX_E_INTERNAL, "flagcxP2pEngineGetMetadata failed");
  /* "ip:port?gpu?notif" (or "[v6]:port?..."): the session part is before '?'. */
  std::string text(metadata);
  delete[] metadata;
  e->endpoint = text.substr(0, text.find('?'));
  if (e->endpoint.empty())
    return fail(TE_FLAGCX_E_INTERNAL, "FlagCX metadata `%s` has no address",
                text.c_str());
  e->serving = true;
  return TE_FLAGCX_OK;
}

const char *te_flagcx_endpoint(te_flagcx_engine *e) {
  if (e == nullptr) {
    fail(TE_FLAGCX_E_INVALID, "endpoint: null engine");
    return nullptr;
  }
  std::lock_guard<std::mutex> guard(e->lock);
  if (!e->serving) {
    fail(TE_FLAGCX_E_INVALID, "the engine has no endpoint before start_server");
    return nullptr;
  }
  /* Set once before serving became true and never changed afterwards. */
  return e->endpoint.c_str();
}

uint64_t te_flagcx_max_desc_len(te_flagcx_engine *e) {
  return e == nullptr ? 0 : e->maxDesc;
}

const char *te_flagcx_memory_kinds(te_flagcx_engine *e) {
  return e == nullptr ? "" : e->memory.c_str();
}

int te_flagcx_register(te_flagcx_engine *e, uint64_t addr, uint64_t len,
                       const char *memory, uint32_t access, uint64_t *mr_out) {
  if (e == nullptr || mr_out == nullptr || addr == 0 || len == 0)
    return fail(TE_FLAGCX_E_INVALID, "register: null engine or empty range");
  const uint32_t all = TE_FLAGCX_ACCESS_REMOTE_READ | TE_FLAGCX_ACCESS_REMOTE_WRITE;
  if ((access & ~all) != 0)
    return fail(TE_FLAGCX_E_INVALID, "register: unknown access flags 0x%x",
                (unsigned)access);
  /* FlagCX gives every peer READ and WRITE on every registered region. */
  if (access != all && !e->unrestricted)
    return fail(TE_FLAGCX_E_UNSUPPORTED,
                "FlagCX cannot restrict remote access: it would let every peer READ "
                "and WRITE this %s region of 0x%llx+%llu, which was asked for %s; "
                "register it remotely readable and writable, or accept that with "
                "shim_options unrestricted=1 (docs/flagcx.md)",
                memory ? memory : "(null)", (unsigned long long)addr,
                (unsigned long long)len,
                access == 0 ? "local use only"
                : access == TE_FLAGCX_ACCESS_REMOTE_READ ? "remote READ only"
                                                          : "remote WRITE only");
  if (memory == nullptr || !runtimeAllowed(e, memory))
    return fail(TE_FLAGCX_E_UNSUPPORTED,
                "memory `%s` is not among this shim's kinds (%s)",
                memory ? memory : "(null)", e->memory.c_str());
  uint64_t mr = 0;
  int rc = isHost(memory)
               ? flagcxP2pRpcRegisterHost(e->engine, addr, len, &mr)
               : flagcxP2pRpcRegister(e->engine, addr, len, &mr);
  if (rc != 0)
    return fail(TE_FLAGCX_E_INTERNAL,
                "FlagCX refused to register %s memory 0x%llx+%llu (rc %d)",
                memory, (unsigned long long)addr, (unsigned long long)len, rc);
  *mr_out = mr;
  return TE_FLAGCX_OK;
}

int te_flagcx_deregister(te_flagcx_engine *e, uint64_t mr) {
  if (e == nullptr)
    return fail(TE_FLAGCX_E_INVALID, "deregister: null engine");
  /* Deregisters at once; the caller has waited for its transfers on the memory. */
  flagcxP2pEngineMrDestroy(e->engine, static_cast<FlagcxP2pMr>(mr));
  return TE_FLAGCX_OK;
}

void te_flagcx_cancel_connects(te_flagcx_engine *e) {
  if (e == nullptr)
    return;
  std::lock_guard<std::mutex> guard(e->connectLock);
  e->cancelled = true;
  e->connectChanged.notify_all();
}

int te_flagcx_attempt_create(te_flagcx_engine *e, te_flagcx_attempt **out) {
  if (e == nullptr || out == nullptr)
    return fail(TE_FLAGCX_E_INVALID, "attempt_create: null argument");
  te_flagcx_attempt *a = new (std::nothrow) te_flagcx_attempt();
  if (a == nullptr)
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  a->engine = e;
  *out = a;
  return TE_FLAGCX_OK;
}

void te_flagcx_attempt_cancel(te_flagcx_attempt *a) {
  if (a == nullptr)
    return;
  std::lock_guard<std::mutex> guard(a->engine->connectLock);
  a->cancelled = true;
  a->engine->connectChanged.notify_all();
}

void te_flagcx_attempt_destroy(te_flagcx_attempt *a) { delete a; }

int te_flagcx_connect(te_flagcx_engine *e, const char *endpoint,
                      uint32_t timeout_ms, te_flagcx_attempt *attempt,
                      te_flagcx_conn **out) {
  if (e == nullptr || endpoint == nullptr || attempt == nullptr || out == nullptr)
    return fail(TE_FLAGCX_E_INVALID, "connect: null argument");
  if (attempt->engine != e)
    return fail(TE_FLAGCX_E_INVALID, "connect: the attempt is another engine's");
  std::string key(endpoint);
  size_t colon = key.rfind(':');
  if (colon == std::string::npos || colon + 1 >= key.size())
    return fail(TE_FLAGCX_E_INVALID, "endpoint `%s` is not host:port", endpoint);
  std::string host = key.substr(0, colon);
  char *endp = nullptr;
  long port = std::strtol(key.c_str() + colon + 1, &endp, 10);
  if (endp == nullptr || *endp != 0 || port <= 0 || port > 65535)
    return fail(TE_FLAGCX_E_INVALID, "endpoint `%s` has no valid port", endpoint);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  std::shared_ptr<PendingConnect> pending;
  try {
    pending = std::make_shared<PendingConnect>();
  } catch (const std::bad_alloc &) {
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  }
  {
    std::lock_guard<std::mutex> guard(e->connectLock);
    if (e->cancelled)
      return fail(TE_FLAGCX_E_UNREACHABLE,
                  "connecting to %s was cancelled: the engine is closing", endpoint);
    if (attempt->cancelled)
      return fail(TE_FLAGCX_E_UNREACHABLE,
                  "connecting to %s was cancelled: its attempt was given up",
                  endpoint);
    e->helpers++;
  }
  try {
    std::thread([e, pending, host, port] {
      FlagcxP2pConn *c =
          flagcxP2pEngineConnect(e->engine, host.c_str(), -1, (int)port, false);
      bool abandoned;
      {
        std::lock_guard<std::mutex> guard(e->connectLock);
        pending->done = true;
        pending->conn = c;
        abandoned = pending->abandoned;
        e->connectChanged.notify_all();
      }
      if (abandoned && c != nullptr)
        flagcxP2pEngineConnDestroy(c);
      std::lock_guard<std::mutex> guard(e->connectLock);
      e->helpers--;
      e->connectChanged.notify_all();
    }).detach();
  } catch (const std::system_error &) {
    std::lock_guard<std::mutex> guard(e->connectLock);
    e->helpers--;
    return fail(TE_FLAGCX_E_INTERNAL, "cannot start a thread to connect to %s",
                endpoint);
  }
  FlagcxP2pConn *conn = nullptr;
  {
    std::unique_lock<std::mutex> guard(e->connectLock);
    auto until =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    e->connectChanged.wait_until(guard, until, [&] {
      return pending->done || e->cancelled || attempt->cancelled;
    });
    if (!pending->done) {
      pending->abandoned = true;
      if (e->cancelled)
        return fail(TE_FLAGCX_E_UNREACHABLE,
                    "connecting to %s was cancelled: the engine is closing",
                    endpoint);
      if (attempt->cancelled)
        return fail(TE_FLAGCX_E_UNREACHABLE,
                    "connecting to %s was cancelled: its attempt was given up "
                    "(FlagCX's own connect goes on until it gives up)",
                    endpoint);
      return fail(TE_FLAGCX_E_UNREACHABLE,
                  "flagcxP2pEngineConnect to %s did not finish within %u ms (is "
                  "the peer's server running and its RDMA device reachable?)",
                  endpoint, timeout_ms);
    }
    conn = pending->conn;
  }
  if (conn == nullptr)
    return fail(TE_FLAGCX_E_UNREACHABLE,
                "flagcxP2pEngineConnect to %s failed (is the peer's server "
                "running and its RDMA device reachable?)",
                endpoint);
  te_flagcx_conn *c = new (std::nothrow) te_flagcx_conn();
  if (c == nullptr) {
    flagcxP2pEngineConnDestroy(conn);
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  }
  c->engine = e;
  c->conn = conn;
  c->peer = key;
  *out = c;
  return TE_FLAGCX_OK;
}

void te_flagcx_disconnect(te_flagcx_conn *c) {
  if (c == nullptr)
    return;
  flagcxP2pEngineConnDestroy(c->conn);
  delete c;
}

int te_flagcx_post(te_flagcx_conn *c, int op, const te_flagcx_desc *descs,
                   uint32_t count, uint64_t *xfer_out) {
  if (c == nullptr || descs == nullptr || count == 0 || xfer_out == nullptr)
    return fail(TE_FLAGCX_E_INVALID, "post: null argument or no descriptors");
  if (op != TE_FLAGCX_OP_READ && op != TE_FLAGCX_OP_WRITE)
    return fail(TE_FLAGCX_E_INVALID, "post: unknown operation %d", op);
  const uint64_t limit = c->engine->maxDesc;
  try {
    Scratch &v = scratch;
    v.mrs.resize(count);
    v.addrs.resize(count);
    v.sizes.resize(count);
    v.remote.resize(count);
    for (uint32_t i = 0; i < count; i++) {
      const te_flagcx_desc &d = descs[i];
      if (d.len == 0 || d.len > limit)
        return fail(TE_FLAGCX_E_INVALID,
                    "descriptor %u has %llu bytes; the per-descriptor limit is "
                    "%llu (split larger copies)",
                    i, (unsigned long long)d.len, (unsigned long long)limit);
      if (flagcxP2pEngineMakeDesc(c->conn, d.remote_addr,
                                  static_cast<uint32_t>(d.len),
                                  &v.remote[i]) != 0)
        return fail(TE_FLAGCX_E_STALE,
                    "remote range 0x%llx+%llu is not in the region table taken "
                    "when connecting to %s (registered since? connect again)",
                    (unsigned long long)d.remote_addr,
                    (unsigned long long)d.len, c->peer.c_str());
      v.mrs[i] = static_cast<FlagcxP2pMr>(d.local_mr);
      v.addrs[i] = reinterpret_cast<void *>(static_cast<uintptr_t>(d.local_addr));
      v.sizes[i] = static_cast<size_t>(d.len);
    }
    uint64_t id = 0;
    int rc = op == TE_FLAGCX_OP_WRITE
                 ? flagcxP2pEngineWriteVector(c->conn, v.mrs, v.addrs, v.sizes,
                                              v.remote, static_cast<int>(count),
                                              &id)
                 : flagcxP2pEngineReadVector(c->conn, v.mrs, v.addrs, v.sizes,
                                             v.remote, static_cast<int>(count),
                                             &id);
    if (rc != 0)
      return fail(TE_FLAGCX_E_TRANSFER,
                  "FlagCX refused to post %u %s descriptor(s) to %s (rc %d; a "
                  "local buffer not registered, or on another NIC?)",
                  count, op == TE_FLAGCX_OP_WRITE ? "WRITE" : "READ",
                  c->peer.c_str(), rc);
    *xfer_out = id;
    return TE_FLAGCX_OK;
  } catch (const std::bad_alloc &) {
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  }
}

int te_flagcx_query(te_flagcx_conn *c, uint64_t xfer) {
  if (c == nullptr)
    return fail(TE_FLAGCX_E_INVALID, "query: null connection");
#ifdef TE_FLAGCX_HAVE_XFER_RESULT
  uint64_t failed = 0;
  int rc = flagcxP2pEngineXferResult(c->conn, xfer, &failed);
  if (rc < 0)
    return fail(TE_FLAGCX_E_INVALID,
                "FlagCX does not know transfer %llu (never posted, or queried "
                "after it finished)",
                (unsigned long long)xfer);
  int status = te_flagcx_status(rc == 0, failed);
  if (status == TE_FLAGCX_PENDING)
    return status;
  c->engine->events.fetch_add(1, std::memory_order_relaxed);
  if (status != TE_FLAGCX_OK)
    return fail(status,
                "FlagCX finished the transfer to %s with %llu failed slice(s): "
                "some of its bytes did not arrive (run with FLAGCX_DEBUG=WARN for "
                "the work completion status)",
                c->peer.c_str(), (unsigned long long)failed);
  return status;
#else
  (void)xfer;
  /* Unreachable: engine_create refuses to start without a failure-reporting query. */
  return fail(TE_FLAGCX_E_UNSUPPORTED,
              "this FlagCX cannot report failed transfers (docs/flagcx.md)");
#endif
}

uint64_t te_flagcx_events(te_flagcx_engine *e) {
  return e == nullptr ? 0 : e->events.load(std::memory_order_relaxed);
}

void te_flagcx_wait(te_flagcx_engine *e, uint64_t seen, uint32_t timeout_us) {
  /* FlagCX has no blocking wait for a transfer: yield, and let the caller query. */
  (void)e;
  (void)seen;
  (void)timeout_us;
  sched_yield();
}

void te_flagcx_wake(te_flagcx_engine *e) {
  if (e != nullptr)
    e->events.fetch_add(1, std::memory_order_relaxed);
}

} // extern "C"
