/* The pod sandbox's process: holds the pod's namespaces until it is told to stop, and
 * reaps the orphans the pod's processes leave (it is their PID 1). Built static, alone
 * in an image, because no registry with registry.k8s.io/pause is reachable. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {}
}

int main(void) {
    struct sigaction term = {.sa_handler = stop}, child = {.sa_handler = reap};
    sigaction(SIGINT, &term, NULL);
    sigaction(SIGTERM, &term, NULL);
    sigaction(SIGCHLD, &child, NULL);
    for (;;) pause();
}
