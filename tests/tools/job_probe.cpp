// A rank program for the security tests (tdist_run_security_test) and the
// cluster launch tests (tdist_run_cluster_test): joins the job through
// env://, then reports what the job exposes:
//   ready                      after the group formed
//   rank R of W                its place in the group
//   listen ADDR:PORT           every TCP socket this rank listens on
//   socket ADDR:PORT           the local end of every other TCP socket
//   tokenless client: ...      (ranks > 0) whether the master's store served
//                              a client without the job's token
//   token-file written         with --token-out F: TDIST_STORE_TOKEN saved to F
//   sum ok                     an all_reduce after --hold seconds came out right
//
//   job_probe [--backend gloo] [--hold SECONDS] [--timeout-ms MS] [--token-out FILE]
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "tdist/tdist.h"
#include "tests/util/listening.h"

int main(int argc, char** argv) {
  std::string backend = "gloo", token_out;
  double hold = 0;
  long timeout_ms = 60000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--backend") backend = value;
    else if (flag == "--hold") hold = std::atof(value.c_str());
    else if (flag == "--timeout-ms") timeout_ms = std::atol(value.c_str());
    else if (flag == "--token-out") token_out = value;
    else {
      std::fprintf(stderr, "job_probe: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  try {
    tdist::InitOptions io;
    io.backend = backend;
    io.timeout = std::chrono::milliseconds(timeout_ms);
    auto pg = tdist::init_process_group(io);
    pg->barrier()->wait();
    std::printf("ready\n");
    std::printf("rank %d of %d\n", pg->rank(), pg->size());
    for (const auto& s : tdist::test::tcp_sockets()) {
      std::printf("%s %s\n", s.listening ? "listen" : "socket", s.text().c_str());
    }
    if (pg->rank() > 0 && std::getenv("MASTER_ADDR") && std::getenv("MASTER_PORT")) {  // (srun's tasks may have neither)
      tdist::TCPStoreOptions o;
      o.port = static_cast<uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
      o.timeout = std::chrono::seconds(5);
      o.token = std::string();  // no token at all
      try {
        tdist::TCPStore intruder(std::getenv("MASTER_ADDR"), o);
        std::printf("tokenless client: accepted\n");
      } catch (const tdist::StoreError& e) {
        std::printf("tokenless client: refused: %s\n", e.what());
      }
    }
    if (!token_out.empty() && pg->rank() == 0) {
      const char* t = std::getenv("TDIST_STORE_TOKEN");
      const int fd = open(token_out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd < 0 || !t || write(fd, t, std::strlen(t)) < 0) return 3;
      close(fd);
      std::printf("token-file written\n");
    }
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::duration<double>(hold));
    auto x = torch::ones({1000});
    pg->all_reduce(x)->wait();
    if (!x.eq(pg->size()).all().item<bool>()) {
      std::printf("sum wrong\n");
      return 4;
    }
    std::printf("sum ok\n");
    pg->barrier()->wait();
    tdist::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "job_probe: %s\n", e.what());
    return 1;
  }
  return 0;
}
