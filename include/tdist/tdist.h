// The umbrella header: everything tdist offers.
#pragma once

#include "tdist/config.h"
#include "tdist/checkpoint.h"
#include "tdist/ddp.h"
#include "tdist/errors.h"
#include "tdist/checkpoint_module.h"
#include "tdist/fsdp.h"
#include "tdist/fsdp_wrap.h"
#include "tdist/parameters.h"
#include "tdist/powersgd.h"
#include "tdist/pretrained.h"
#include "tdist/process_group.h"
#include "tdist/rendezvous.h"
#include "tdist/sharded_checkpoint.h"
#include "tdist/state_dict.h"
#include "tdist/store.h"
#include "tdist/version.h"
