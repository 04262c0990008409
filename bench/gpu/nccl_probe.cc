// Can NCCL put two ranks on one GPU? Two processes, both on device 0, join
// one communicator and exchange 1 MiB. Prints what NCCL says; exit 0 either
// way (this is a probe of the machine, not a test of kvring).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "kvring/transport/nccl_transport.h"

using namespace kvring;

int main() {
  auto id = NcclTransport::NewUniqueId();
  if (!id.ok()) {
    std::printf("nccl probe: ncclGetUniqueId failed: %s\n", id.status().ToString().c_str());
    return 0;
  }
  int res[2];
  if (pipe(res) != 0) return 1;
  pid_t pid = fork();
  const int rank = pid == 0 ? 1 : 0;
  auto t = NcclTransport::Create(rank, 2, *id, 0);
  std::string msg;
  if (!t.ok()) {
    msg = t.status().ToString();
  } else {
    void* buf = nullptr;
    cudaMalloc(&buf, 1 << 20);
    std::unique_ptr<TransportRequest> r;
    auto req = rank == 0 ? (*t)->Isend(1, 0, absl::MakeConstSpan(static_cast<uint8_t*>(buf), 1 << 20))
                         : (*t)->Irecv(0, 0, absl::MakeSpan(static_cast<uint8_t*>(buf), 1 << 20));
    absl::Status s = req.ok() ? (*t)->Flush() : req.status();
    if (s.ok()) s = (*req)->Wait(absl::Seconds(20)).status();
    msg = s.ok() ? "OK: 1 MiB moved between two ranks on one GPU" : s.ToString();
  }
  if (pid == 0) {
    (void)!write(res[1], msg.data(), msg.size());
    _exit(0);
  }
  close(res[1]);
  char other[512] = {0};
  (void)!read(res[0], other, sizeof(other) - 1);
  waitpid(pid, nullptr, 0);
  std::printf("nccl probe, 2 ranks on device 0: rank 0: %s | rank 1: %s\n", msg.c_str(), other);
  return 0;
}
