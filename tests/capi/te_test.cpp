// The C++ wrapper's test (run by tests/capi/run.sh): two engines of one process over
// TCP, a write and a read with every byte checked, a notification, and errors as
// te::Error exceptions.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "te.hpp"

using namespace std::chrono_literals;

#define EXPECT(cond)                                                     \
    do {                                                                 \
        if (!(cond)) {                                                   \
            std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, #cond); \
            std::exit(1);                                                \
        }                                                                \
    } while (0)

int main() {
    const std::string tcp = "[engine]\nbackend = \"tcp\"\n";
    try {
        te::Engine bad("[engine]\nbackend = \"nope\"\n");
        EXPECT(!"an unknown backend made an engine");
    } catch (const te::Error &e) {
        EXPECT(e.status() == TE_ERR_CONFIG_INVALID);
        EXPECT(std::strstr(e.what(), "tcp") != nullptr);
    }

    // The memory outlives the engines that registered it (declared first, freed last).
    const size_t len = 1 << 20;
    std::vector<uint8_t> dst(len), src(len), back(len);
    te::Engine target(tcp), initiator(tcp);
    for (size_t i = 0; i < len; i++) src[i] = static_cast<uint8_t>(i * 7 + (i >> 10));
    target.register_memory("dst", dst.data(), len, TE_ACCESS_REMOTE_READ | TE_ACCESS_REMOTE_WRITE);
    uint64_t lsrc = initiator.register_memory("src", src.data(), len);
    uint64_t lback = initiator.register_memory("back", back.data(), len);

    te::Peer peer = initiator.connect(target.address(), 5000ms);
    uint64_t size = 0;
    uint64_t rdst = peer.region("dst", &size);
    EXPECT(size == len);
    initiator.transfer(peer, {te::write(lsrc, 0, rdst, 0, len / 2), te::write(lsrc, len / 2, rdst, len / 2, len / 2)})
        .wait();
    EXPECT(dst == src);
    te::Batch read = initiator.transfer(peer, {te::read(lback, 0, rdst, 0, len)}, 10000ms, "done");
    EXPECT(read.wait_for(10000ms));
    EXPECT(read.done());
    EXPECT(back == src);

    auto note = target.recv_notification(5000ms);
    EXPECT(note && std::string(note->message.begin(), note->message.end()) == "done");
    EXPECT(note->address == initiator.address());
    EXPECT(!target.recv_notification(0ms));

    try {
        initiator.transfer(peer, {te::write(lsrc, 0, rdst, 1, len)});
        EXPECT(!"a request outside the region was accepted");
    } catch (const te::Error &e) {
        EXPECT(e.status() == TE_ERR_OUT_OF_BOUNDS);
    }
    try {
        peer.region("nope");
        EXPECT(!"an unknown region was found");
    } catch (const te::Error &e) {
        EXPECT(e.status() == TE_ERR_NOT_REGISTERED);
    }
    te::Engine moved = std::move(initiator);
    EXPECT(initiator.get() == nullptr && moved.get() != nullptr);
    std::printf("C++ tests: ok\n");
    return 0;
}
