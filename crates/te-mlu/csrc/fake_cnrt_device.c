/*
 * The FAKE libcnrt's devices: the library version, the device count, the current
 * device, the per-device schedule flag, peer access and PCI bus ids, and the names
 * and messages of its error codes.
 */
#include "fake_cnrt_internal.h"

#include <stdio.h>

EXPORT cnrtRet_t cnrtGetLibVersion(int *major, int *minor, int *patch) {
  INJECT("cnrtGetLibVersion");
  if (!major || !minor || !patch) return cnrtErrorArgsInvalid;
  *major = g_version[0];
  *minor = g_version[1];
  *patch = g_version[2];
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtGetDeviceCount(unsigned int *count) {
  INJECT("cnrtGetDeviceCount");
  if (!count) return cnrtErrorArgsInvalid;
  *count = (unsigned int)g_devices;
  return g_devices > 0 ? cnrtSuccess : cnrtErrorNoDevice;
}

EXPORT cnrtRet_t cnrtSetDevice(int ordinal) {
  INJECT("cnrtSetDevice");
  if (ordinal < 0 || ordinal >= g_devices) return cnrtErrorDeviceInvalid;
  t_device = ordinal;
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtGetDevice(int *ordinal) {
  INJECT("cnrtGetDevice");
  if (!ordinal) return cnrtErrorArgsInvalid;
  *ordinal = t_device;
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtSetDeviceFlag(uint32_t flags) {
  INJECT("cnrtSetDeviceFlag");
  if (flags > cnrtDeviceScheduleAuto) return cnrtErrorArgsInvalid;
  pthread_mutex_lock(&g_lock);
  cnrtRet_t r = cnrtSuccess;
  if (g_active[t_device])
    r = cnrtErrorSetOnActiveProcess;
  else
    g_flag[t_device] = flags;
  pthread_mutex_unlock(&g_lock);
  return r;
}

EXPORT cnrtRet_t cnrtGetDeviceFlag(uint32_t *flags) {
  INJECT("cnrtGetDeviceFlag");
  if (!flags) return cnrtErrorArgsInvalid;
  pthread_mutex_lock(&g_lock);
  *flags = g_flag[t_device];
  pthread_mutex_unlock(&g_lock);
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtGetPeerAccessibility(unsigned int *can, int ordinal, int peer) {
  INJECT("cnrtGetPeerAccessibility");
  if (!can) return cnrtErrorArgsInvalid;
  if (ordinal < 0 || ordinal >= g_devices || peer < 0 || peer >= g_devices)
    return cnrtErrorDeviceInvalid;
  *can = 1;
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtDeviceGetPCIBusId(char *bus, int len, int device) {
  INJECT("cnrtDeviceGetPCIBusId");
  if (!bus || len <= 0) return cnrtErrorArgsInvalid;
  if (device < 0 || device >= g_devices) return cnrtErrorDeviceInvalid;
  snprintf(bus, (size_t)len, "0000:%02x:00.0", 0x1a + device);
  return cnrtSuccess;
}

EXPORT const char *cnrtGetErrorName(cnrtRet_t e) {
  switch (e) {
    case cnrtSuccess: return "cnrtSuccess";
    case cnrtErrorNotReady: return "cnrtErrorNotReady";
    case cnrtErrorNoDevice: return "cnrtErrorNoDevice";
    case cnrtErrorDeviceInvalid: return "cnrtErrorDeviceInvalid";
    case cnrtErrorArgsInvalid: return "cnrtErrorArgsInvalid";
    case cnrtErrorSysNoMem: return "cnrtErrorSysNoMem";
    case cnrtErrorInvalidResourceHandle: return "cnrtErrorInvalidResourceHandle";
    case cnrtErrorNotSupport: return "cnrtErrorNotSupport";
    case cnrtErrorOpsNotPermitted: return "cnrtErrorOpsNotPermitted";
    case cnrtErrorQueue: return "cnrtErrorQueue";
    case cnrtErrorNoMem: return "cnrtErrorNoMem";
    case cnrtErrorMemcpyDirectionInvalid: return "cnrtErrorMemcpyDirectionInvalid";
    case cnrtErrorBusy: return "cnrtErrorBusy";
    case cnrtErrorCndrvFuncCall: return "cnrtErrorCndrvFuncCall";
    case cnrtErrorSetOnActiveProcess: return "cnrtErrorSetOnActiveProcess";
    case cnrtErrorDevice: return "cnrtErrorDevice";
    default: return "cnrtErrorUnknown";
  }
}

EXPORT const char *cnrtGetErrorStr(cnrtRet_t e) {
  switch (e) {
    case cnrtSuccess: return "no error (fake libcnrt)";
    case cnrtErrorNotReady: return "the device or resource is busy now (fake libcnrt)";
    case cnrtErrorNoDevice: return "no MLU device found (fake libcnrt)";
    case cnrtErrorDeviceInvalid: return "invalid device ordinal (fake libcnrt)";
    case cnrtErrorArgsInvalid: return "invalid argument (fake libcnrt)";
    case cnrtErrorSysNoMem: return "insufficient host memory (fake libcnrt)";
    case cnrtErrorInvalidResourceHandle: return "invalid resource handle (fake libcnrt)";
    case cnrtErrorNoMem: return "insufficient MLU device memory (fake libcnrt)";
    case cnrtErrorBusy: return "the queue is busy (fake libcnrt)";
    case cnrtErrorSetOnActiveProcess:
      return "the device flag cannot change once the device is in use (fake libcnrt)";
    case cnrtErrorDevice: return "current resource is not from the current device (fake libcnrt)";
    case cnrtErrorOpsNotPermitted:
      return "this allocation's IPC handle was acquired already (fake libcnrt)";
    default: return "unknown error (fake libcnrt)";
  }
}
