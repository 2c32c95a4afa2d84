/*
 * A CPU-only stand-in for the CUDA driver (libcuda.so.1), for tests only.
 *
 * Mooncake's PyPI wheel links libcuda.so.1 and libcudart.so.12; on a machine with no
 * NVIDIA driver it cannot even be imported. This library satisfies the dynamic linker
 * and answers every call the way a driver on a machine without a GPU does: cuInit
 * fails with CUDA_ERROR_NO_DEVICE, cuDeviceGetCount reports 0 devices, and everything
 * that needs an initialized driver fails with CUDA_ERROR_NOT_INITIALIZED. No entry
 * point ever pretends that memory is device memory, so code above it takes its
 * host-memory paths.
 *
 * The exported names are the undefined cu* symbols of Mooncake's engine.so
 * (`nm -D --undefined-only engine.so`) plus what libcudart.so.12 resolves when it
 * loads the driver: cuGetProcAddress(_v2), through which it asks for everything else,
 * and cuDriverGetVersion. cuGetProcAddress hands out only the functions below and
 * answers CUDA_ERROR_NOT_FOUND for any other name.
 *
 * Built by the `fake_libcuda` fixture of tests/test_mooncake_differential.py:
 *   cc -shared -fPIC -o DIR/libcuda.so.1 fake_libcuda.c
 */

#include <stddef.h>
#include <string.h>

typedef int CUresult;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_NOT_FOUND = 500,
};

/* The CUDA version this stand-in claims to be (12.9), as cuDriverGetVersion encodes it. */
#define FAKE_DRIVER_VERSION 12090

/* Not initialized: what a driver says to every call after cuInit failed. */
#define NOT_INITIALIZED(name, ...) \
    CUresult name(__VA_ARGS__) { return CUDA_ERROR_NOT_INITIALIZED; }

CUresult cuInit(unsigned int flags) {
    (void)flags;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = FAKE_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = 0;
    return CUDA_SUCCESS;
}

static const char *error_name(CUresult e) {
    switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    default: return NULL;
    }
}

CUresult cuGetErrorName(CUresult e, const char **str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    *str = error_name(e);
    return *str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult e, const char **str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    *str = e == CUDA_ERROR_NO_DEVICE ? "no CUDA-capable device is detected (fake libcuda)"
                                     : error_name(e);
    return *str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Everything else engine.so links; none can succeed without a device. The parameter
 * lists are the driver API's, abridged to untyped pointers where only the count matters
 * for the calling convention (all arguments are passed in registers or by the caller). */
NOT_INITIALIZED(cuDeviceGet, int *dev, int ordinal)
NOT_INITIALIZED(cuDeviceGetAttribute, int *value, int attr, int dev)
NOT_INITIALIZED(cuDevicePrimaryCtxRetain, void **ctx, int dev)
NOT_INITIALIZED(cuDevicePrimaryCtxRelease_v2, int dev)
NOT_INITIALIZED(cuCtxGetDevice, int *dev)
NOT_INITIALIZED(cuCtxSetCurrent, void *ctx)
NOT_INITIALIZED(cuPointerGetAttribute, void *data, int attr, unsigned long long ptr)
NOT_INITIALIZED(cuPointerSetAttribute, const void *value, int attr, unsigned long long ptr)
NOT_INITIALIZED(cuMemGetAddressRange_v2, unsigned long long *base, size_t *size,
                unsigned long long ptr)
NOT_INITIALIZED(cuMemGetAllocationGranularity, size_t *g, const void *prop, int option)
NOT_INITIALIZED(cuMemCreate, unsigned long long *handle, size_t size, const void *prop,
                unsigned long long flags)
NOT_INITIALIZED(cuMemRelease, unsigned long long handle)
NOT_INITIALIZED(cuMemAddressReserve, unsigned long long *ptr, size_t size, size_t align,
                unsigned long long addr, unsigned long long flags)
NOT_INITIALIZED(cuMemAddressFree, unsigned long long ptr, size_t size)
NOT_INITIALIZED(cuMemMap, unsigned long long ptr, size_t size, size_t offset,
                unsigned long long handle, unsigned long long flags)
NOT_INITIALIZED(cuMemUnmap, unsigned long long ptr, size_t size)
NOT_INITIALIZED(cuMemSetAccess, unsigned long long ptr, size_t size, const void *desc,
                size_t count)
NOT_INITIALIZED(cuMemExportToShareableHandle, void *handle, unsigned long long h, int type,
                unsigned long long flags)
NOT_INITIALIZED(cuMemImportFromShareableHandle, unsigned long long *h, void *handle, int type)
NOT_INITIALIZED(cuMemGetHandleForAddressRange, void *handle, unsigned long long ptr,
                size_t size, int type, unsigned long long flags)

/* The functions cuGetProcAddress hands out, by driver API name. */
static const struct {
    const char *name;
    void *fn;
} TABLE[] = {
    {"cuInit", (void *)cuInit},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuGetErrorName", (void *)cuGetErrorName},
    {"cuGetErrorString", (void *)cuGetErrorString},
    {"cuDeviceGet", (void *)cuDeviceGet},
    {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxGetDevice", (void *)cuCtxGetDevice},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
    {"cuPointerGetAttribute", (void *)cuPointerGetAttribute},
    {"cuPointerSetAttribute", (void *)cuPointerSetAttribute},
    {"cuMemGetAddressRange", (void *)cuMemGetAddressRange_v2},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status) {
    (void)version;
    (void)flags;
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof TABLE / sizeof TABLE[0]; i++) {
        if (strcmp(symbol, TABLE[i].name) == 0) {
            *pfn = TABLE[i].fn;
            if (status) *status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
            return CUDA_SUCCESS;
        }
    }
    *pfn = NULL;
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version,
                          unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
