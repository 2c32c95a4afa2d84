/* The acceptance check of the C ABI: only the names whose spelling is fixed for ABI
 * tooling. Creates an engine, reads its address, and gets an error naming the
 * available backends for `backend = "nope"`. */
#include <stdio.h>
#include <string.h>

#include "te.h"

int main(void) {
    if (te_abi_version() != TE_ABI_VERSION) {
        fprintf(stderr, "library ABI %u, header ABI %u\n", te_abi_version(), TE_ABI_VERSION);
        return 1;
    }
    te_engine *engine = NULL;
    if (te_engine_new(NULL, &engine) != 0) {
        fprintf(stderr, "te_engine_new(NULL): %s\n", te_last_error());
        return 1;
    }
    char address[64];
    if (te_engine_address(engine, address, sizeof address) != 0 || strchr(address, ':') == NULL) {
        fprintf(stderr, "te_engine_address: %s\n", te_last_error());
        return 1;
    }
    te_engine_free(engine);

    te_engine *bad = NULL;
    int rc = te_engine_new("[engine]\nbackend = \"nope\"\n", &bad);
    if (rc >= 0 || bad != NULL || strstr(te_last_error(), "stub") == NULL ||
        strstr(te_last_error(), "tcp") == NULL) {
        fprintf(stderr, "backend \"nope\": status %d, message `%s`\n", rc, te_last_error());
        return 1;
    }
    printf("fixed names: engine at %s; backend \"nope\": %s\n", address, te_last_error());
    return 0;
}
