/* Preloaded (LD_PRELOAD) by crossrt into one short run of a llama.cpp tool, to read which kernels
 * that tool runs: llama_print_system_info() (backends, CPU features) as the tool's own libraries
 * answer it, for the record's runtime block (backends/llama_tools.py, probe).
 *
 * At the vendored commit llama-server prints it only at trace verbosity and
 * llama-speculative-simple not at all. Both call llama_backend_init() once, after parsing their
 * arguments and before loading a model; this library wraps it, prints "system_info: ..." on
 * stdout and ends the process there, so the run needs no model, port or device memory. A build
 * that does not export these symbols (static) is not wrapped and prints no such line.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

typedef void (*backend_init_fn)(void);
typedef const char *(*system_info_fn)(void);

void llama_backend_init(void) {
    backend_init_fn init = (backend_init_fn) dlsym(RTLD_NEXT, "llama_backend_init");
    system_info_fn system_info = (system_info_fn) dlsym(RTLD_NEXT, "llama_print_system_info");
    if (init == NULL || system_info == NULL) {
        _exit(3);
    }
    init();
    printf("system_info: %s\n", system_info());
    fflush(stdout);
    _exit(0);
}
