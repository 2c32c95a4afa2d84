// te.hpp — a header-only C++17 wrapper over te.h: RAII handles, and te::Error
// exceptions carrying the status and te_last_error()'s message. Everything te.h
// documents holds here; the raw handle of each object is `get()`.
#ifndef TE_HPP
#define TE_HPP

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "te.h"

namespace te {

/// A failed te call: its negative status and message.
class Error : public std::runtime_error {
  public:
    Error(int status, const std::string &message)
        : std::runtime_error(std::string(te_status_name(status)) + ": " + message),
          status_(status) {}
    /// The te_status (TE_ERR_…).
    int status() const noexcept { return status_; }

  private:
    int status_;
};

/// Throws te::Error for a negative status; returns TE_OK or TE_PENDING.
inline int check(int status) {
    if (status < 0) throw Error(status, te_last_error());
    return status;
}

/// One owned handle, freed by `Free` (move-only).
template <typename T, void (*Free)(T *)>
class Handle {
  public:
    explicit Handle(T *raw = nullptr) noexcept : raw_(raw) {}
    Handle(Handle &&o) noexcept : raw_(std::exchange(o.raw_, nullptr)) {}
    Handle &operator=(Handle &&o) noexcept {
        if (this != &o) {
            Free(raw_);
            raw_ = std::exchange(o.raw_, nullptr);
        }
        return *this;
    }
    Handle(const Handle &) = delete;
    Handle &operator=(const Handle &) = delete;
    ~Handle() { Free(raw_); }
    /// The te.h handle, still owned by this object.
    T *get() const noexcept { return raw_; }

  private:
    T *raw_;
};

/// A WRITE of `len` bytes from local[local_offset] to remote[remote_offset].
inline te_request write(uint64_t local, uint64_t local_offset, uint64_t remote,
                        uint64_t remote_offset, uint64_t len) {
    return te_request{TE_OP_WRITE, 0, local, local_offset, remote, remote_offset, len};
}

/// A READ of `len` bytes from remote[remote_offset] into local[local_offset].
inline te_request read(uint64_t local, uint64_t local_offset, uint64_t remote,
                       uint64_t remote_offset, uint64_t len) {
    return te_request{TE_OP_READ, 0, local, local_offset, remote, remote_offset, len};
}

/// A submitted batch.
class Batch : public Handle<te_batch, te_batch_free> {
  public:
    using Handle::Handle;
    /// Blocks until the batch resolves; throws its error.
    void wait() const { check(te_batch_wait(get(), -1)); }
    /// Blocks at most `timeout`: true when done, false while in flight; throws its error.
    bool wait_for(std::chrono::milliseconds timeout) const {
        return check(te_batch_wait(get(), timeout.count())) == TE_OK;
    }
    /// Without blocking: true when done, false while in flight; throws its error.
    bool done() const { return check(te_batch_status(get())) == TE_OK; }
    /// Asks to stop the batch (it then resolves, cancelled or done).
    void cancel() const { check(te_batch_cancel(get())); }
};

/// A connected peer.
class Peer : public Handle<te_peer, te_peer_free> {
  public:
    using Handle::Handle;
    /// The id of the peer's region `name`; throws TE_ERR_NOT_REGISTERED without one.
    uint64_t region(const std::string &name, uint64_t *len = nullptr) const {
        uint64_t id = 0;
        check(te_peer_region(get(), name.c_str(), &id, len));
        return id;
    }
};

/// A received notification.
struct Notification {
    std::string sender;   ///< the sending engine's name
    std::string address;  ///< its control-plane address
    std::vector<uint8_t> message;
};

/// An engine.
class Engine : public Handle<te_engine, te_engine_free> {
  public:
    /// From TOML text (plugins.toml's format).
    explicit Engine(const std::string &config_toml) : Handle(make(config_toml.c_str())) {}
    /// From the defaults (the stub backend).
    Engine() : Handle(make(nullptr)) {}

    /// The control-plane address peers connect to.
    std::string address() const {
        char buf[64];
        check(te_engine_address(get(), buf, sizeof buf));
        return buf;
    }
    /// Registers caller-owned memory (see te_engine_register); returns the region id.
    uint64_t register_memory(const std::string &name, void *addr, size_t len,
                             uint32_t access = 0, const char *memory = "host") {
        uint64_t id = 0;
        check(te_engine_register(get(), name.c_str(), addr, len, memory, access, &id));
        return id;
    }
    /// Deregisters a region; after it returns te touches the memory no more.
    void deregister(uint64_t region) { check(te_engine_deregister(get(), region)); }
    /// Connects to a peer (a zero timeout: the engine's default).
    Peer connect(const std::string &address,
                 std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
        te_peer *peer = nullptr;
        check(te_engine_connect(get(), address.c_str(), static_cast<uint64_t>(timeout.count()),
                                &peer));
        return Peer(peer);
    }
    /// Submits a batch, with an optional notification (a zero timeout: the default).
    Batch transfer(const Peer &peer, const std::vector<te_request> &requests,
                   std::chrono::milliseconds timeout = std::chrono::milliseconds(0),
                   const std::optional<std::string> &notify = std::nullopt) {
        te_batch *batch = nullptr;
        check(te_engine_transfer(get(), peer.get(), requests.data(), requests.size(),
                                 static_cast<uint64_t>(timeout.count()),
                                 notify ? notify->data() : nullptr, notify ? notify->size() : 0,
                                 &batch));
        return Batch(batch);
    }
    /// The next notification, waiting at most `timeout`; nothing if none came.
    std::optional<Notification> recv_notification(std::chrono::milliseconds timeout) {
        te_notification *raw = nullptr;
        if (check(te_engine_recv_notification(get(), timeout.count(), &raw)) == TE_PENDING)
            return std::nullopt;
        Handle<te_notification, te_notification_free> n(raw);
        size_t len = 0;
        const uint8_t *data = te_notification_data(n.get(), &len);
        const char *address = nullptr;
        const char *sender = te_notification_sender(n.get(), &address);
        return Notification{sender, address, std::vector<uint8_t>(data, data + len)};
    }

  private:
    static te_engine *make(const char *config) {
        te_engine *engine = nullptr;
        check(te_engine_new(config, &engine));
        return engine;
    }
};

}  // namespace te

#endif  // TE_HPP
