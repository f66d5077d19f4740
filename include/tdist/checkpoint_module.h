// The former name of tdist/activation_checkpoint.h (checkpoint_module:
// activation checkpointing, recomputing a module's forward in backward),
// kept so that programs that include it still build.
#pragma once

#include "tdist/activation_checkpoint.h"
