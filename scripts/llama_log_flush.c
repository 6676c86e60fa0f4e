/* Preloaded into llama.cpp's tools (LD_PRELOAD) by crossrt: flushes llama.cpp's asynchronous
 * logger before the process exits.
 *
 * common/log.cpp leaks its logger singleton on purpose (llama.cpp issue 22142), so the worker
 * thread that writes log lines is never joined: lines still queued at exit are lost. For
 * llama-speculative-simple that is the final statistics block in most runs on a busy machine
 * (21 of 30 runs here). common_log_pause() drains the queue and joins the worker; this
 * library's destructor calls it as the process exits. The symbols are looked up at run time,
 * so a build without them (static, or renamed) is left as it was.
 */
#define _GNU_SOURCE
#include <dlfcn.h>

typedef void *(*log_main_fn)(void);
typedef void (*log_pause_fn)(void *);

__attribute__((destructor)) static void crossrt_flush_llama_log(void) {
    log_main_fn log_main = (log_main_fn) dlsym(RTLD_DEFAULT, "_Z15common_log_mainv");
    log_pause_fn log_pause = (log_pause_fn) dlsym(RTLD_DEFAULT, "_Z16common_log_pauseP10common_log");
    if (log_main && log_pause) {
        log_pause(log_main());
    }
}
