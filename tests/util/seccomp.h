// refuse_cross_memory_attach: makes process_vm_readv/writev fail with EPERM,
// as a container's seccomp profile (Docker's default one) does, on the
// calling thread or on every thread of the process; then checks that it
// holds. Throws std::runtime_error when it cannot.
#pragma once

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <stdexcept>

namespace tdist::test {

inline void refuse_cross_memory_attach(bool every_thread) {
  sock_filter code[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_readv, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_writev, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof code / sizeof code[0]), code};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) throw std::runtime_error("PR_SET_NO_NEW_PRIVS failed");
  const unsigned flags = every_thread ? SECCOMP_FILTER_FLAG_TSYNC : 0;
  if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, flags, &prog) != 0) throw std::runtime_error("seccomp failed");
  char a = 1, b = 0;
  iovec l{&b, 1}, r{&a, 1};
  if (process_vm_readv(getpid(), &l, 1, &r, 1, 0) != -1 || errno != EPERM) {
    throw std::runtime_error("process_vm_readv still works under the filter");
  }
}

}  // namespace tdist::test
