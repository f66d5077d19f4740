# Writes hostile_setstate_archive.pt, the fixture of
# ShardedCheckpoint.ALegacyArchiveHookRecordIsRefusedAndRunsNothing: a
# TorchScript archive (what torch::serialize::OutputArchive writes) whose
# module's __setstate__ prints "TDIST-HOSTILE-SETSTATE ran". LibTorch's
# archive loader (InputArchive::load_from, torch::jit::load) runs it: the
# code a checkpoint must never get to run. Made with Debian's torch 1.13:
#   /usr/bin/python3 tests/checkpoint/data/make_hostile_archive.py tests/checkpoint/data/hostile_setstate_archive.pt
import io
import sys
from typing import Tuple

import torch


class Hostile(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = 1

    @torch.jit.export
    def __getstate__(self):
        return (self.x, self.training)

    @torch.jit.export
    def __setstate__(self, state: Tuple[int, bool]):
        print("TDIST-HOSTILE-SETSTATE ran")
        self.x = state[0]
        self.training = state[1]

    def forward(self, x):
        return x


buf = io.BytesIO()
torch.jit.save(torch.jit.script(Hostile()), buf)
with open(sys.argv[1], "wb") as f:
    f.write(buf.getvalue())
