// The former name of tdist/safetensors.h (safetensors files), kept so that
// programs that include it still build. "checkpoint" alone is ambiguous in
// tdist: files (tdist/safetensors.h, tdist/sharded_checkpoint.h), the
// periodic saver (tdist/checkpointer.h) and activation recompute
// (tdist/activation_checkpoint.h). Include the one you mean.
#pragma once

#include "tdist/safetensors.h"
