// One conformance suite, run against every Store implementation. Each
// "world" is one shared store; connect() returns a new handle on it (a new
// TCP client, a new FileStore object on the same file, a new PrefixStore over
// the same store), as separate ranks would hold.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "tdist/store.h"
#include "tests/util/process.h"

using namespace std::chrono_literals;
using tdist::Bytes;
using tdist::Milliseconds;
using tdist::Store;
using tdist::to_bytes;

namespace {

class World {
 public:
  virtual ~World() = default;
  virtual std::shared_ptr<Store> connect(Milliseconds timeout) = 0;
};

class HashWorld : public World {
 public:
  std::shared_ptr<Store> connect(Milliseconds timeout) override {
    // Handles of one HashStore share its timeout; keep one per call.
    if (!store_) store_ = std::make_shared<tdist::HashStore>(timeout);
    store_->set_timeout(timeout);
    return store_;
  }

 private:
  std::shared_ptr<tdist::HashStore> store_;
};

class FileWorld : public World {
 public:
  std::shared_ptr<Store> connect(Milliseconds timeout) override {
    return std::make_shared<tdist::FileStore>(dir_.path() + "/store", timeout);
  }

 private:
  tdist::test::TempDir dir_;
};

class TcpWorld : public World {
 public:
  TcpWorld() : server_(tdist::TCPStoreServerOptions{"127.0.0.1", 0, std::string(), {}}) {}
  std::shared_ptr<Store> connect(Milliseconds timeout) override {
    tdist::TCPStoreOptions o;
    o.port = server_.port();
    o.timeout = timeout;
    o.token = std::string();
    return std::make_shared<tdist::TCPStore>("127.0.0.1", o);
  }

 private:
  tdist::TCPStoreServer server_;
};

// PrefixStores over another world; a second prefix shares the base store, to
// check that namespaces do not leak into each other.
class PrefixWorld : public World {
 public:
  explicit PrefixWorld(std::unique_ptr<World> base) : base_(std::move(base)) {}
  std::shared_ptr<Store> connect(Milliseconds timeout) override {
    return std::make_shared<tdist::PrefixStore>("job", base_->connect(timeout));
  }
  std::shared_ptr<Store> connect_other_prefix(Milliseconds timeout) {
    return std::make_shared<tdist::PrefixStore>("other", base_->connect(timeout));
  }

 private:
  std::unique_ptr<World> base_;
};

std::unique_ptr<World> make_world(const std::string& kind) {
  if (kind == "hash") return std::make_unique<HashWorld>();
  if (kind == "file") return std::make_unique<FileWorld>();
  if (kind == "tcp") return std::make_unique<TcpWorld>();
  if (kind == "prefix_hash") return std::make_unique<PrefixWorld>(std::make_unique<HashWorld>());
  if (kind == "prefix_tcp") return std::make_unique<PrefixWorld>(std::make_unique<TcpWorld>());
  if (kind == "prefix_file") return std::make_unique<PrefixWorld>(std::make_unique<FileWorld>());
  throw std::logic_error("unknown store kind " + kind);
}

class StoreConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    world_ = make_world(GetParam());
    store_ = world_->connect(10s);
  }
  std::shared_ptr<Store> another(Milliseconds timeout = 10s) { return world_->connect(timeout); }

  std::unique_ptr<World> world_;
  std::shared_ptr<Store> store_;
};

template <typename Fn>
std::chrono::milliseconds time_of(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
}

TEST_P(StoreConformance, SetThenGetReturnsTheValue) {
  store_->set("a", "hello");
  EXPECT_EQ(store_->get_string("a"), "hello");
  store_->set("a", "again");
  EXPECT_EQ(store_->get_string("a"), "again");
  EXPECT_EQ(another()->get_string("a"), "again");
}

TEST_P(StoreConformance, ValuesAreArbitraryBytes) {
  Bytes binary = {0, 1, 2, 0, 255, 10, 13, 0};
  store_->set("bin", binary);
  EXPECT_EQ(store_->get("bin"), binary);
  store_->set("empty", Bytes{});
  EXPECT_TRUE(store_->check({"empty"}));
  EXPECT_EQ(store_->get("empty"), Bytes{});
  Bytes big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 131 + 7);
  store_->set("big", big);
  EXPECT_EQ(another()->get("big"), big);
}

TEST_P(StoreConformance, GetOfMissingKeyTimesOutNamingTheKey) {
  std::string message;
  auto took = time_of([&] {
    try {
      store_->get("never-set", 200ms);
    } catch (const tdist::TimeoutError& e) {
      message = e.what();
    }
  });
  EXPECT_NE(message.find("never-set'"), std::string::npos) << message;
  EXPECT_NE(message.find("200 ms"), std::string::npos) << message;
  EXPECT_GE(took.count(), 190);
  EXPECT_LT(took.count(), 3000);
  // The store still works after a timeout.
  store_->set("after", "ok");
  EXPECT_EQ(store_->get_string("after"), "ok");
}

TEST_P(StoreConformance, DefaultTimeoutAppliesAndCanBeChanged) {
  auto s = another(150ms);
  EXPECT_EQ(s->timeout(), 150ms);
  auto took = time_of([&] { EXPECT_THROW(s->get("missing"), tdist::TimeoutError); });
  EXPECT_GE(took.count(), 140);
  EXPECT_LT(took.count(), 3000);
  s->set_timeout(300ms);
  took = time_of([&] { EXPECT_THROW(s->wait({"missing"}), tdist::TimeoutError); });
  EXPECT_GE(took.count(), 290);
}

TEST_P(StoreConformance, GetBlocksUntilAnotherHandleSetsTheKey) {
  auto writer = another();
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    writer->set("late", "arrived");
  });
  auto took = time_of([&] { EXPECT_EQ(store_->get_string("late"), "arrived"); });
  t.join();
  EXPECT_GE(took.count(), 80);
}

TEST_P(StoreConformance, AddCountsFromZeroAndReturnsTheNewValue) {
  EXPECT_EQ(store_->add("n", 1), 1);
  EXPECT_EQ(store_->add("n", 41), 42);
  EXPECT_EQ(store_->add("n", -50), -8);
  EXPECT_EQ(store_->add("n", 0), -8);
  EXPECT_EQ(store_->get_string("n"), "-8");
  store_->set("m", "100");
  EXPECT_EQ(another()->add("m", 5), 105);
}

TEST_P(StoreConformance, AddOnANonIntegerIsAnErrorAndChangesNothing) {
  store_->set("text", "not a number");
  EXPECT_THROW(store_->add("text", 1), tdist::StoreError);
  EXPECT_EQ(store_->get_string("text"), "not a number");
  store_->set("max", std::to_string(INT64_MAX));
  EXPECT_THROW(store_->add("max", 1), tdist::StoreError);
  EXPECT_EQ(store_->get_string("max"), std::to_string(INT64_MAX));
}

TEST_P(StoreConformance, AddWakesWaiters) {
  auto writer = another();
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    writer->add("counter", 3);
  });
  EXPECT_EQ(store_->get_string("counter"), "3");
  t.join();
}

TEST_P(StoreConformance, ConcurrentAddsFromManyHandlesAreExact) {
  constexpr int kThreads = 4, kAdds = 200;
  std::vector<std::shared_ptr<Store>> handles;
  for (int i = 0; i < kThreads; ++i) handles.push_back(another());
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (int j = 0; j < kAdds; ++j) handles[i]->add("shared", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(store_->get_string("shared"), std::to_string(kThreads * kAdds));
}

TEST_P(StoreConformance, CompareSetOnAMissingKey) {
  // A missing key matches only the empty expected value.
  EXPECT_EQ(store_->compare_set("k", to_bytes("x"), to_bytes("new")), Bytes{});
  EXPECT_FALSE(store_->check({"k"}));
  EXPECT_EQ(store_->compare_set("k", Bytes{}, to_bytes("first")), to_bytes("first"));
  EXPECT_EQ(store_->get_string("k"), "first");
}

TEST_P(StoreConformance, CompareSetSwapsOnlyOnAMatch) {
  store_->set("k", "v1");
  EXPECT_EQ(store_->compare_set("k", to_bytes("wrong"), to_bytes("v2")), to_bytes("v1"));
  EXPECT_EQ(store_->get_string("k"), "v1");
  EXPECT_EQ(store_->compare_set("k", to_bytes("v1"), to_bytes("v2")), to_bytes("v2"));
  EXPECT_EQ(another()->get_string("k"), "v2");
}

TEST_P(StoreConformance, CompareSetIsAtomicAcrossHandles) {
  // Each thread increments a counter "N/writer/step" with compare_set
  // retries; the writer tag makes each desired value unique, so a reply
  // equal to it proves this writer's swap happened.
  constexpr int kThreads = 4, kIncrements = 50;
  store_->set("cas", "0/init/0");
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      auto h = another();
      for (int j = 0; j < kIncrements; ++j) {
        for (;;) {
          Bytes old = h->get("cas");
          const int n = std::stoi(tdist::to_string(old));
          Bytes next = to_bytes(std::to_string(n + 1) + "/" + std::to_string(i) + "/" + std::to_string(j));
          if (h->compare_set("cas", old, next) == next) break;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  const std::string final_value = store_->get_string("cas");
  EXPECT_EQ(final_value.substr(0, final_value.find('/')), std::to_string(kThreads * kIncrements));
}

TEST_P(StoreConformance, WaitReturnsWhenEveryKeyExists) {
  store_->set("w1", "x");
  store_->wait({"w1"}, 100ms);  // already there: immediate
  auto writer = another();
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    writer->set("w2", "x");
    std::this_thread::sleep_for(50ms);
    writer->set("w3", "x");
  });
  auto took = time_of([&] { store_->wait({"w1", "w2", "w3"}, 5s); });
  t.join();
  EXPECT_GE(took.count(), 80);
  EXPECT_TRUE(store_->check({"w1", "w2", "w3"}));
}

TEST_P(StoreConformance, WaitTimeoutNamesOnlyTheMissingKeys) {
  store_->set("present", "x");
  try {
    store_->wait({"present", "absent1", "absent2"}, 150ms);
    FAIL() << "wait did not time out";
  } catch (const tdist::TimeoutError& e) {
    std::string m = e.what();
    // A PrefixStore's keys appear with their prefix: "'job/absent1'".
    EXPECT_NE(m.find("absent1'"), std::string::npos) << m;
    EXPECT_NE(m.find("absent2'"), std::string::npos) << m;
    EXPECT_EQ(m.find("present'"), std::string::npos) << m;
  }
}

TEST_P(StoreConformance, CheckNeverBlocks) {
  EXPECT_FALSE(store_->check({"c"}));
  store_->set("c", "1");
  EXPECT_TRUE(store_->check({"c"}));
  EXPECT_FALSE(store_->check({"c", "d"}));
  EXPECT_TRUE(store_->check({}));
}

TEST_P(StoreConformance, DeleteKeyRemovesAndReports) {
  store_->set("d", "1");
  EXPECT_TRUE(store_->delete_key("d"));
  EXPECT_FALSE(store_->delete_key("d"));
  EXPECT_FALSE(store_->check({"d"}));
  EXPECT_THROW(store_->get("d", 100ms), tdist::TimeoutError);
  EXPECT_EQ(store_->add("d", 2), 2);  // a deleted counter restarts at zero
}

TEST_P(StoreConformance, NumKeysCountsLiveKeys) {
  const int64_t base = store_->num_keys();
  store_->set("n1", "a");
  store_->set("n2", "b");
  store_->add("n3", 1);
  EXPECT_EQ(store_->num_keys(), base + 3);
  store_->delete_key("n2");
  EXPECT_EQ(another()->num_keys(), base + 2);
}

TEST_P(StoreConformance, MultiSetAndMultiGetKeepOrder) {
  store_->multi_set({"m1", "m2", "m3"}, {to_bytes("one"), to_bytes("two"), to_bytes("three")});
  auto values = another()->multi_get({"m3", "m1", "m2", "m1"});
  ASSERT_EQ(values.size(), 4u);
  EXPECT_EQ(values[0], to_bytes("three"));
  EXPECT_EQ(values[1], to_bytes("one"));
  EXPECT_EQ(values[2], to_bytes("two"));
  EXPECT_EQ(values[3], to_bytes("one"));
  EXPECT_TRUE(store_->multi_get({}).empty());
}

TEST_P(StoreConformance, MultiGetBlocksUntilAllKeysExist) {
  store_->set("g1", "x");
  auto writer = another();
  std::thread t([&] {
    std::this_thread::sleep_for(80ms);
    writer->set("g2", "y");
  });
  auto values = store_->multi_get({"g1", "g2"}, 5s);
  t.join();
  EXPECT_EQ(values[1], to_bytes("y"));
  EXPECT_THROW(store_->multi_get({"g1", "g-missing"}, 100ms), tdist::TimeoutError);
}

TEST_P(StoreConformance, MisuseIsAUsageError) {
  EXPECT_THROW(store_->set("", "x"), tdist::UsageError);
  EXPECT_THROW(store_->get("", 1s), tdist::UsageError);
  EXPECT_THROW(store_->add("", 1), tdist::UsageError);
  EXPECT_THROW(store_->wait({"a", ""}), tdist::UsageError);
  EXPECT_THROW(store_->get("a", 0ms), tdist::UsageError);
  EXPECT_THROW(store_->get("a", -5ms), tdist::UsageError);
  EXPECT_THROW(store_->set_timeout(0ms), tdist::UsageError);
  EXPECT_THROW(store_->multi_set({"a", "b"}, {to_bytes("1")}), tdist::UsageError);
  EXPECT_FALSE(store_->check({"a"}));  // nothing was written by the failed calls
}

TEST_P(StoreConformance, ManyKeysRoundTrip) {
  std::vector<std::string> keys;
  std::vector<Bytes> values;
  for (int i = 0; i < 500; ++i) {
    keys.push_back("many/" + std::to_string(i));
    values.push_back(to_bytes("value-" + std::to_string(i * i)));
  }
  store_->multi_set(keys, values);
  EXPECT_EQ(another()->multi_get(keys), values);
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreConformance,
                         ::testing::Values("hash", "file", "tcp", "prefix_hash", "prefix_tcp", "prefix_file"),
                         [](const auto& info) { return info.param; });

TEST(PrefixStore, NamespacesDoNotLeak) {
  auto base = std::make_shared<tdist::HashStore>();
  tdist::PrefixStore a("a", base), b("b", base);
  a.set("key", "from a");
  b.set("key", "from b");
  EXPECT_EQ(a.get_string("key"), "from a");
  EXPECT_EQ(b.get_string("key"), "from b");
  EXPECT_EQ(base->get_string("a/key"), "from a");
  EXPECT_FALSE(b.check({"only-a"}));
  a.set("only-a", "1");
  EXPECT_FALSE(b.check({"only-a"}));
  tdist::PrefixStore nested("inner", std::make_shared<tdist::PrefixStore>("outer", base));
  nested.set("k", "v");
  EXPECT_EQ(base->get_string("outer/inner/k"), "v");
}

TEST(PrefixStore, RejectsNullStoreAndEmptyPrefix) {
  EXPECT_THROW(tdist::PrefixStore("p", nullptr), tdist::UsageError);
  EXPECT_THROW(tdist::PrefixStore("", std::make_shared<tdist::HashStore>()), tdist::UsageError);
}

}  // namespace
