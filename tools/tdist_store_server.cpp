// tdist-store-server: a standalone TCPStore server, for jobs whose ranks
// should not host it. Serves until SIGINT/SIGTERM.
//
//   tdist-store-server [--host ADDR] [--port PORT]
// The token comes from TDIST_STORE_TOKEN. Prints "listening on PORT" once ready.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "tdist/store.h"

int main(int argc, char** argv) {
  tdist::TCPStoreServerOptions options;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if ((a == "--host" || a == "--port") && i + 1 < argc) {
      if (a == "--host") options.host = argv[++i];
      else options.port = static_cast<uint16_t>(std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: tdist-store-server [--host ADDR] [--port PORT]\n");
      return 2;
    }
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // the server thread inherits the mask
  try {
    tdist::TCPStoreServer server(options);
    std::printf("listening on %u\n", server.port());
    std::fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-store-server: %s\n", e.what());
    return 1;
  }
  return 0;
}
