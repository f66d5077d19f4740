// tdist-store-server: a standalone TCPStore server, for jobs whose ranks
// should not host it. Serves until SIGINT/SIGTERM.
//
//   tdist-store-server [--host ADDR] [--port PORT]
// Listens on loopback unless --host says otherwise ("*": every interface).
// The token comes from TDIST_STORE_TOKEN or TDIST_STORE_TOKEN_FILE; without
// one it warns that anyone reaching the port can use the store. Prints
// "listening on PORT" once ready.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "store/auth.h"
#include "tdist/errors.h"
#include "tdist/store.h"
#include "util/cli.h"

int main(int argc, char** argv) {
  tdist::TCPStoreServerOptions options;
  CLI::App app{"A standalone TCPStore server; serves until SIGINT/SIGTERM. The token comes from TDIST_STORE_TOKEN.",
               "tdist-store-server"};
  app.add_option("--host", options.host, "address to listen on ('*': every interface)")->type_name("ADDR")->capture_default_str();
  app.add_option("--port", options.port, "port to listen on (0: any free one)")->type_name("PORT")
      ->capture_default_str();
  tdist::cli::parse_or_exit(app, argc, argv);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // the server thread inherits the mask
  try {
    options.token = tdist::detail::resolve_token(std::nullopt);  // the library's rule, resolved once
    tdist::TCPStoreServer server(options);
    if (options.token->empty()) {
      std::fprintf(stderr,
                   "tdist-store-server: warning: no TDIST_STORE_TOKEN or TDIST_STORE_TOKEN_FILE; any process that "
                   "reaches %s:%u can read and write this store\n",
                   options.host.c_str(), server.port());
    }
    std::printf("listening on %u\n", server.port());
    std::fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
  } catch (const tdist::UsageError& e) {  // a bad token setting: the command line's environment
    tdist::cli::usage_error("tdist-store-server", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-store-server: %s\n", e.what());
    return 1;
  }
  return 0;
}
