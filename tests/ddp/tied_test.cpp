// Tied parameters under DDP: the tied tensor is one bucket entry whose
// gradient is reduced once, so training gives one process's weights at
// worlds 2 and 3, also with find_unused_parameters and static_graph, and
// the tied names stay one tensor. Real processes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tdist/comm_hooks.h"
#include "tdist/ddp.h"
#include "tests/fsdp/tied_models.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::test::run_world;
using tdist::test::TiedLm;

void train_and_compare(ProcessGroup& pg, const tdist::DistributedDataParallelOptions& o) {
  const auto reference = tdist::test::tied_reference(/*block_uses_tied=*/true);
  torch::manual_seed(7);
  TiedLm net(true);
  tdist::DistributedDataParallel<TiedLm> ddp(net, o);
  // What the buckets reduce: each parameter once (the tied tensor too).
  auto reduced = std::make_shared<int64_t>(0);
  auto group = tdist::default_group();
  ddp->register_comm_hook(reduced, [group](const std::shared_ptr<int64_t>& n, tdist::GradBucket& b) {
    for (const auto& g : b.gradients()) *n += g.numel();
    return tdist::allreduce_hook(group, b);
  });
  int64_t unique_numel = 0;
  for (const auto& p : tdist::unique_parameters(*net)) unique_numel += p.numel();
  auto opt = tdist::test::tied_optimizer(tdist::unique_parameters(*net));
  for (int step = 0; step < tdist::test::kTiedSteps; ++step) {
    opt.zero_grad();
    const auto ids = tdist::test::tied_rows(tdist::test::tied_batch(step), pg.rank(), pg.size());
    auto in = ids.narrow(1, 0, tdist::test::kTiedTokens);
    auto target = ids.narrow(1, 1, tdist::test::kTiedTokens);
    torch::nn::functional::cross_entropy(ddp->forward(in).reshape({-1, tdist::test::kTiedVocab}), target.reshape({-1}))
        .backward();
    opt.step();
  }
  WORLD_CHECK(*reduced == tdist::test::kTiedSteps * unique_numel,
              "reduced " << *reduced << " gradient elements, not " << tdist::test::kTiedSteps << " x " << unique_numel);
  size_t compared = 0;
  for (const auto& p : net->named_parameters()) {
    const auto& want = reference.at(p.key());
    const double err = (p.value() - want).norm().item<double>() / want.norm().item<double>();
    WORLD_CHECK(err <= 1e-5, p.key() << " differs by " << err << " (relative)");
    ++compared;
  }
  WORLD_CHECK(compared == reference.size(), compared << " of " << reference.size());
  WORLD_CHECK(net->lm_head->weight.data_ptr() == net->wte->weight.data_ptr() &&
                  net->h[1]->as<tdist::test::TiedBlock>()->emb.data_ptr() == net->wte->weight.data_ptr(),
              "the tied names are no longer one tensor");
}

TEST(TiedDdp, TrainsAsOneProcess) {
  tdist::DistributedDataParallelOptions plain, unused, fixed;
  unused.find_unused_parameters = true;
  fixed.static_graph = true;
  for (const int world : {2, 3}) {
    EXPECT_EQ(run_world(world,
                        [&](ProcessGroup& pg) {
                          train_and_compare(pg, plain);
                          train_and_compare(pg, unused);
                          train_and_compare(pg, fixed);
                        }),
              "")
        << "world " << world;
  }
}

}  // namespace
