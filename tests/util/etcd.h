// An etcd cluster for tests: N members of Debian's etcd (etcd-server) on
// loopback, each with free client and peer ports and its data in a
// directory of the test's; killed with the object. Nothing here may hang:
// start() waits for the cluster to take a write, with a deadline.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "run/etcd_client.h"
#include "store/socket.h"
#include "tests/util/process.h"

namespace tdist::test {

// Debian's etcd, or "" when it is not installed.
inline std::string etcd_program() {
  for (const char* p : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

class EtcdCluster {
 public:
  // Members' data and logs go under dir.
  EtcdCluster(const std::string& dir, int members) : dir_(dir) {
    for (int i = 0; i < members; ++i) {
      Member m;
      m.name = "m" + std::to_string(i);
      m.client = detail::find_free_port();
      m.peer = detail::find_free_port();
      members_.push_back(m);
    }
  }
  ~EtcdCluster() {
    for (int i = 0; i < static_cast<int>(members_.size()); ++i) kill_member(i);
  }
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  // Starts every member; true once the cluster takes a write (within 30 s).
  bool start() {
    std::string initial;
    for (const Member& m : members_) {
      initial += (initial.empty() ? "" : ",") + m.name + "=http://127.0.0.1:" + std::to_string(m.peer);
    }
    for (Member& m : members_) {
      const std::string c = "http://127.0.0.1:" + std::to_string(m.client);
      const std::string p = "http://127.0.0.1:" + std::to_string(m.peer);
      const std::string cmd = "exec " + etcd_program() + " --name " + m.name + " --data-dir " + dir_ + "/" + m.name +
                              " --listen-client-urls " + c + " --advertise-client-urls " + c +
                              " --listen-peer-urls " + p + " --initial-advertise-peer-urls " + p +
                              " --initial-cluster " + initial +
                              " --initial-cluster-state new --initial-cluster-token tdist-test > " + dir_ + "/" +
                              m.name + ".log 2>&1";
      m.pid = fork_child([cmd] {
        execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
        return 127;
      });
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < until) {
      try {
        tdist_run::EtcdTimeouts t;
        t.request = t.op = std::chrono::seconds(2);
        tdist_run::EtcdClient c({{"127.0.0.1", members_[0].client}}, t);
        c.put("ready", "y");
        return true;
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return false;
  }

  // "127.0.0.1:P0,127.0.0.1:P1,..."
  std::string endpoints() const {
    std::string s;
    for (const Member& m : members_) s += (s.empty() ? "" : ",") + std::string("127.0.0.1:") + std::to_string(m.client);
    return s;
  }
  int client_port(int i) const { return members_[i].client; }

  void kill_member(int i) {
    Member& m = members_[i];
    if (m.pid <= 0) return;
    kill(m.pid, SIGKILL);
    wait_child(m.pid, std::chrono::seconds(10));
    m.pid = -1;
  }
  std::string log(int i) const { return read_all(dir_ + "/" + members_[i].name + ".log"); }

 private:
  struct Member {
    std::string name;
    int client = 0, peer = 0;
    pid_t pid = -1;
  };
  std::string dir_;
  std::vector<Member> members_;
};

}  // namespace tdist::test
