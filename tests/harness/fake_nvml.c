/* A fake libnvidia-ml.so.1: the NVML entry points nvidia-ml-py calls for what the gateway
 * uses, answered from a state file the tests rewrite while the gateway runs. The real
 * pynvml adapter (gatewayd/adapters/gpu.py) is what runs against it: built with the
 * soname libnvidia-ml.so.1 and found through LD_LIBRARY_PATH, as the driver's would be.
 *
 * State file ($FAKE_NVML_STATE), read again on every call, one item per line:
 *   driver VERSION
 *   device UUID TOTAL_BYTES USED_BYTES NAME...      (index = order of the device lines)
 *   proc DEVICE_INDEX PID USED_BYTES                (a compute process on that device)
 *   error FUNCTION|* CODE                           (that function, or all, returns CODE)
 * A missing state file is a machine with no device. Init fails only on an error line.
 *
 * Build: gcc -shared -fPIC -O2 -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEVICES 16
#define MAX_PROCS 256
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_UNKNOWN 999

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct { char uuid[96]; char name[96]; unsigned long long total, used; } device_t;
typedef struct { unsigned int device, pid; unsigned long long used; } proc_t;

static device_t devices[MAX_DEVICES];
static proc_t procs[MAX_PROCS];
static unsigned int n_devices, n_procs;
static char driver[80];
static int initialized;

/* Reads the state; returns the error code the state gives `function` (0: none). */
static int load(const char *function) {
    const char *path = getenv("FAKE_NVML_STATE");
    char line[512], word[128];
    int error = 0;
    n_devices = n_procs = 0;
    strcpy(driver, "0.0");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) {
        device_t *d = &devices[n_devices];
        proc_t *p = &procs[n_procs];
        int code, used = 0;
        if (sscanf(line, "driver %79s", driver) == 1) continue;
        if (n_devices < MAX_DEVICES &&
            sscanf(line, "device %95s %llu %llu %n", d->uuid, &d->total, &d->used, &used) == 3) {
            snprintf(d->name, sizeof d->name, "%s", line + used);
            d->name[strcspn(d->name, "\n")] = 0;
            n_devices++;
        } else if (n_procs < MAX_PROCS &&
                   sscanf(line, "proc %u %u %llu", &p->device, &p->pid, &p->used) == 3) {
            n_procs++;
        } else if (sscanf(line, "error %127s %d", word, &code) == 2 &&
                   (strcmp(word, "*") == 0 || strcmp(word, function) == 0)) {
            error = code;
        }
    }
    fclose(f);
    return error;
}

static int device_of(void *handle, unsigned int *index) {
    unsigned long i = (unsigned long)handle;
    if (i == 0 || i > n_devices) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)(i - 1);
    return NVML_SUCCESS;
}

static int copy_text(char *out, unsigned int length, const char *text) {
    if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return NVML_SUCCESS;
}

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    int error = load("nvmlInit");
    if (error) return error;
    initialized = 1;
    return NVML_SUCCESS;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlInit(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) { initialized = 0; return NVML_SUCCESS; }

const char *nvmlErrorString(int result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    int error = load("nvmlSystemGetDriverVersion");
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    return error ? error : copy_text(version, length, driver);
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    int error = load("nvmlDeviceGetCount");
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (error) return error;
    *count = n_devices;
    return NVML_SUCCESS;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    int error = load("nvmlDeviceGetHandleByIndex");
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (error) return error;
    if (index >= n_devices) return NVML_ERROR_INVALID_ARGUMENT;
    *device = (void *)(unsigned long)(index + 1);
    return NVML_SUCCESS;
}

int nvmlDeviceGetName(void *handle, char *name, unsigned int length) {
    unsigned int i;
    int error = load("nvmlDeviceGetName");
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (error) return error;
    if ((error = device_of(handle, &i))) return error;
    return copy_text(name, length, devices[i].name);
}

int nvmlDeviceGetUUID(void *handle, char *uuid, unsigned int length) {
    unsigned int i;
    int error = load("nvmlDeviceGetUUID");
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (error) return error;
    if ((error = device_of(handle, &i))) return error;
    return copy_text(uuid, length, devices[i].uuid);
}

int nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *memory) {
    unsigned int i;
    int error = load("nvmlDeviceGetMemoryInfo");
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (error) return error;
    if ((error = device_of(handle, &i))) return error;
    memory->total = devices[i].total;
    memory->used = devices[i].used;
    memory->free = devices[i].total > devices[i].used ? devices[i].total - devices[i].used : 0;
    return NVML_SUCCESS;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *count,
                                            nvmlProcessInfo_t *infos) {
    unsigned int i, k, n = 0;
    int error = load("nvmlDeviceGetComputeRunningProcesses");
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (error) return error;
    if ((error = device_of(handle, &i))) return error;
    for (k = 0; k < n_procs; k++) n += procs[k].device == i;
    if (n == 0) { *count = 0; return NVML_SUCCESS; }
    if (infos == NULL || *count < n) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    n = 0;
    for (k = 0; k < n_procs; k++) {
        if (procs[k].device != i) continue;
        infos[n].pid = procs[k].pid;
        infos[n].usedGpuMemory = procs[k].used;
        infos[n].gpuInstanceId = infos[n].computeInstanceId = 0xFFFFFFFF;
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}
