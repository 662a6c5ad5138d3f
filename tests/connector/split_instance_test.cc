// One serving instance split over processes, as vLLM splits its scheduler from its
// workers: the halves share nothing in memory and talk through their agents.
//   - a producer's scheduler asks its worker (another process) for the params of the
//     items the worker stored, in one call (remote_saved_params);
//   - a consumer's scheduler lets its workers read what it loaded (share_loaded), each
//     with a pin of its own that its load gives back.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "connector/control_messages.h"
#include "ecx/common/checksum.h"
#include "ecx/connector/ec_connector.h"
#include "ecx/transfer/agent.h"
#include "support/connector_peer_process.h"
#include "support/poll.h"

namespace ecx::connector {
namespace {

const TensorMeta kItem{DType::kBF16, {16, 256}};
const std::string kSecret = "split-instance-test-secret";

std::string tag() {
  static int counter = 0;
  return std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

nlohmann::json extra_for(const std::string& engine_id, const std::string& secret = kSecret) {
  return {{"engine_id", engine_id},
          {"pool_bytes", "16MiB"},
          {"lease_ms", 600000},
          {"auth_token", secret}};
}

std::unique_ptr<EcConnector> make(Role role, nlohmann::json extra) {
  auto c = create_connector({.connector = "p2p", .role = role, .extra = std::move(extra)});
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? std::move(*c) : nullptr;
}

std::vector<std::byte> pattern(uint64_t seed) {
  std::vector<std::byte> out(kItem.byte_size());
  fill_pattern(out.data(), out.size(), seed);
  return out;
}

bool holds_pattern(const cache::BlockRef& ref, uint64_t seed) {
  auto want = pattern(seed);
  return ref.payload_length() == want.size() &&
         std::memcmp(ref.payload(), want.data(), want.size()) == 0;
}

uint64_t pins_of(EcConnector& c) { return c.stats().consumer_cache->pins; }

// Pins our cache still grants, once the readers' asynchronous RELEASEs arrived (at most
// 5 s, far below the 600 s lease that could otherwise have ended them).
uint64_t pins_settled(EcConnector& c, uint64_t want) {
  uint64_t pins = 0;
  ecx::testing::poll_until(Deadline::after_ms(5000), [&] { return (pins = pins_of(c)) == want; });
  return pins;
}

class SplitInstanceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tag_ = tag();
    auto p = ecx::testing::ConnectorPeer::start(
        {{"connector", "p2p"}, {"role", "producer"}, {"extra", extra_for("e-w0-" + tag_)}});
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    worker_.emplace(std::move(*p));
    auto meta = worker_->metadata();
    ASSERT_TRUE(meta.ok()) << meta.status().to_string();
    worker_metadata_ = *meta;
  }

  MmHash hash_of(const std::string& name) const { return MmHash::sha256_of({tag_, name}); }

  // A consumer scheduler that loaded item "a" (saved by the worker, pattern 5) for request
  // "r"; null (the failure reported) otherwise.
  std::unique_ptr<EcConnector> scheduler_that_loaded_a() {
    auto params = worker_->save(hash_of("a"), 5, kItem);
    EXPECT_TRUE(params.ok()) << params.status().to_string();
    auto scheduler = make(Role::kConsumer, extra_for("pd-sched-" + tag_));
    if (!params.ok() || scheduler == nullptr) return nullptr;
    auto out = scheduler->load({.request_id = "r", .items = {{hash_of("a"), kItem, *params}}},
                               Deadline::after_ms(30000));
    EXPECT_TRUE(out.status.ok()) << out.status.to_string();
    return out.status.ok() ? std::move(scheduler) : nullptr;
  }

  // A zero-copy worker of the consumer's instance, keeping nothing after a step.
  std::unique_ptr<EcConnector> zero_copy_worker(int64_t lease_ms) const {
    auto extra = extra_for("pd-zw-" + tag_);
    extra["zero_copy"] = true;
    extra["keep_loaded"] = false;
    extra["lease_ms"] = lease_ms;
    return make(Role::kConsumer, extra);
  }

  std::string tag_;
  std::optional<ecx::testing::ConnectorPeer> worker_;
  std::string worker_metadata_;
};

TEST_F(SplitInstanceTest, AProducerSchedulerGetsItsWorkersParamsInOneCall) {
  ASSERT_TRUE(worker_->save(hash_of("a"), 1, kItem).ok());
  ASSERT_TRUE(worker_->save(hash_of("b"), 2, kItem).ok());
  auto scheduler = make(Role::kConsumer, extra_for("e-sched-" + tag_));
  ASSERT_NE(scheduler, nullptr);
  auto replies = scheduler->remote_saved_params(worker_metadata_,
                                                {hash_of("a"), hash_of("missing"), hash_of("b")},
                                                Deadline::after_ms(10000));
  ASSERT_TRUE(replies.ok()) << replies.status().to_string();
  ASSERT_EQ(replies->size(), 3u);
  ASSERT_TRUE((*replies)[0].ok()) << (*replies)[0].status().to_string();
  EXPECT_EQ((*replies)[1].status().code(), StatusCode::kNotFound);
  ASSERT_TRUE((*replies)[2].ok());
  // Signed by the worker, naming it, each item with its own pin: a consumer loads them.
  EXPECT_TRUE((*replies)[0]->verify(kSecret).ok());
  EXPECT_EQ((*replies)[0]->engine_id, "e-w0-" + tag_);
  EXPECT_NE((*replies)[0]->pin, (*replies)[2]->pin);
  auto pd = make(Role::kConsumer, extra_for("pd-" + tag_));
  ASSERT_NE(pd, nullptr);
  auto out = pd->load(
      {.request_id = "r",
       .items = {{hash_of("a"), kItem, *(*replies)[0]}, {hash_of("b"), kItem, *(*replies)[2]}}},
      Deadline::after_ms(30000));
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  auto a = pd->loaded("r", hash_of("a"));
  auto b = pd->loaded("r", hash_of("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(holds_pattern(*a, 1));
  EXPECT_TRUE(holds_pattern(*b, 2));
  pd->request_finished("r");
  // Only the two pins the saves' own params hold are left at the worker.
  uint64_t pins = 0;
  ecx::testing::poll_until(Deadline::after_ms(5000), [&] {
    auto s = worker_->stats();
    pins = s.ok() ? (*s)["producer_pool"]["pins"].get<uint64_t>() : UINT64_MAX;
    return pins == 2;
  });
  EXPECT_EQ(pins, 2u);
}

// The `params` op's pins count against a quota of the calling agent's own (the params':
// 16 x max_pins_per_holder), not against the params E issues for its own requests (/v1/encode,
// vLLM's scheduler): one agent at its quota keeps neither E nor another agent from getting params.
// An item asked for many times in one call is pinned once.
TEST_F(SplitInstanceTest, OneCallerAtItsParamsQuotaKeepsNoOneElseFromParams) {
  // A worker whose quotas are small (max_pins_per_holder 64: the params' 1024), so that
  // the test fills one in a few calls.
  auto extra = extra_for("e-w1-" + tag_);
  extra["max_pins_per_holder"] = 64;
  auto w = ecx::testing::ConnectorPeer::start(
      {{"connector", "p2p"}, {"role", "producer"}, {"extra", extra}});
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  auto metadata = w->metadata();
  ASSERT_TRUE(metadata.ok()) << metadata.status().to_string();
  constexpr int kItems = 64;
  std::vector<MmHash> items;
  for (int i = 0; i < kItems; ++i) {
    items.push_back(hash_of("item-" + std::to_string(i)));
    ASSERT_TRUE(w->save(items.back(), i, kItem).ok()) << i;
  }
  auto producer_pins = [&] {
    auto s = w->stats();
    return s.ok() ? (*s)["producer_pool"]["pins"].get<uint64_t>() : UINT64_MAX;
  };
  const uint64_t before = producer_pins();
  auto greedy = make(Role::kConsumer, extra_for("greedy-" + tag_));
  ASSERT_NE(greedy, nullptr);
  // One call naming one item 4096 times: one pin.
  auto repeated = greedy->remote_saved_params(*metadata, std::vector<MmHash>(4096, items[0]),
                                              Deadline::after_ms(30000));
  ASSERT_TRUE(repeated.ok()) << repeated.status().to_string();
  ASSERT_TRUE(repeated->back().ok()) << repeated->back().status().to_string();
  EXPECT_EQ((*repeated)[0]->pin, repeated->back()->pin);
  EXPECT_EQ(producer_pins(), before + 1);
  // Calls until the caller's quota is full (1024 pins: 16 calls of 64 items).
  int refused = 0;
  for (int call = 0; call < 20 && refused == 0; ++call) {
    auto replies = greedy->remote_saved_params(*metadata, items, Deadline::after_ms(30000));
    ASSERT_TRUE(replies.ok()) << replies.status().to_string();
    for (const auto& r : *replies) {
      if (r.ok()) continue;
      EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
      ++refused;
    }
  }
  EXPECT_GT(refused, 0) << "the caller's quota never filled";
  EXPECT_EQ(producer_pins(), before + 1024);
  // E still issues params for its own requests (a new save), and another agent still gets
  // params.
  EXPECT_TRUE(w->save(hash_of("after"), 99, kItem).ok());
  auto other = make(Role::kConsumer, extra_for("e-sched-" + tag_));
  ASSERT_NE(other, nullptr);
  auto replies = other->remote_saved_params(*metadata, {items[1]}, Deadline::after_ms(10000));
  ASSERT_TRUE(replies.ok()) << replies.status().to_string();
  EXPECT_TRUE((*replies)[0].ok()) << (*replies)[0].status().to_string();
}

TEST_F(SplitInstanceTest, AnAgentWithoutTheDeploymentSecretGetsNoParams) {
  ASSERT_TRUE(worker_->save(hash_of("a"), 1, kItem).ok());
  auto stranger = make(Role::kConsumer, extra_for("stranger-" + tag_, "another-secret"));
  ASSERT_NE(stranger, nullptr);
  auto replies =
      stranger->remote_saved_params(worker_metadata_, {hash_of("a")}, Deadline::after_ms(5000));
  EXPECT_FALSE(replies.ok());
}

TEST_F(SplitInstanceTest, AnUnreachableWorkerFailsTheCallByItsDeadline) {
  auto scheduler = make(Role::kConsumer, extra_for("e-sched-" + tag_));
  ASSERT_NE(scheduler, nullptr);
  ASSERT_TRUE(worker_->process().kill(SIGKILL).ok());
  auto started = std::chrono::steady_clock::now();
  auto replies =
      scheduler->remote_saved_params(worker_metadata_, {hash_of("a")}, Deadline::after_ms(3000));
  EXPECT_FALSE(replies.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(30));
}

TEST_F(SplitInstanceTest, ALoadIsSharedWithEachWorkerWhoGiveTheirPinsBack) {
  auto scheduler = scheduler_that_loaded_a();
  ASSERT_NE(scheduler, nullptr);
  uint64_t own = pins_of(*scheduler);  // the request's hold on its load
  auto shared = scheduler->share_loaded("r", hash_of("a"), 2);
  ASSERT_TRUE(shared.ok()) << shared.status().to_string();
  ASSERT_EQ(shared->size(), 2u);
  EXPECT_EQ(pins_of(*scheduler), own + 2);
  EXPECT_NE((*shared)[0].capability, (*shared)[1].capability);
  for (int rank = 0; rank < 2; ++rank) {
    auto extra = extra_for("pd-w" + std::to_string(rank) + "-" + tag_);
    extra["keep_loaded"] = false;
    auto worker = make(Role::kConsumer, extra);
    ASSERT_NE(worker, nullptr);
    std::string step = "step-" + std::to_string(rank);
    auto got = worker->load({.request_id = step, .items = {{hash_of("a"), kItem, (*shared)[rank]}}},
                            Deadline::after_ms(30000));
    ASSERT_TRUE(got.status.ok()) << got.status.to_string();
    auto ref = worker->loaded(step, hash_of("a"));
    ASSERT_TRUE(ref.ok());
    EXPECT_TRUE(holds_pattern(*ref, 5));
    worker->request_finished(step);
    // keep_loaded false: nothing stays in the worker's cache once the step is done.
    EXPECT_EQ(worker->stats().consumer_cache->entries, 0u);
  }
  EXPECT_EQ(pins_settled(*scheduler, own), own);
  scheduler->request_finished("r");
  EXPECT_EQ(pins_of(*scheduler), 0u);
}

// A worker given the pin its own scheduler just took for it (own_pin_taken) views the
// block holding that pin: no lookup, so the scheduler grants one pin for it, not two. The
// view renews that pin (a lease of 1.5 s outlived twice), and its end gives it back. A
// pin taken longer ago than lease_ms / 3 is not trusted to outlast the view's first
// renewal: the worker takes its own by a lookup, as without it.
TEST_F(SplitInstanceTest, AWorkerHoldsTheFreshPinItsSchedulerSharedAndLooksNothingUp) {
  auto params = worker_->save(hash_of("a"), 5, kItem);
  ASSERT_TRUE(params.ok()) << params.status().to_string();
  auto sched_extra = extra_for("pd-sched-" + tag_);
  sched_extra["lease_ms"] = 1500;
  auto scheduler = make(Role::kConsumer, sched_extra);
  ASSERT_NE(scheduler, nullptr);
  auto loaded = scheduler->load({.request_id = "r", .items = {{hash_of("a"), kItem, *params}}},
                                Deadline::after_ms(30000));
  ASSERT_TRUE(loaded.status.ok()) << loaded.status.to_string();
  const uint64_t own = pins_of(*scheduler);
  auto worker = zero_copy_worker(1500);
  ASSERT_NE(worker, nullptr);

  const auto taken = Clock::now();
  auto shared = scheduler->share_loaded("r", hash_of("a"), 1);
  ASSERT_TRUE(shared.ok()) << shared.status().to_string();
  LoadItem item{hash_of("a"), kItem, (*shared)[0], taken};
  auto got = worker->load({.request_id = "step", .items = {item}}, Deadline::after_ms(30000));
  ASSERT_TRUE(got.status.ok()) << got.status.to_string();
  EXPECT_EQ(worker->stats().items_viewed, 1u);
  EXPECT_EQ(pins_of(*scheduler), own + 1);                       // the shared pin alone
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // two leases: renewed
  EXPECT_TRUE(worker->view_intact("step", hash_of("a")).ok());
  auto ref = worker->loaded("step", hash_of("a"));
  ASSERT_TRUE(ref.ok());
  EXPECT_TRUE(holds_pattern(*ref, 5));
  EXPECT_EQ(pins_of(*scheduler), own + 1);
  worker->request_finished("step");
  EXPECT_EQ(pins_settled(*scheduler, own), own);

  // Taken too long ago: the worker's own pin besides the shared one.
  auto stale = scheduler->share_loaded("r", hash_of("a"), 1);
  ASSERT_TRUE(stale.ok()) << stale.status().to_string();
  item = {hash_of("a"), kItem, (*stale)[0], Clock::now() - std::chrono::milliseconds(600)};
  got = worker->load({.request_id = "step-2", .items = {item}}, Deadline::after_ms(30000));
  ASSERT_TRUE(got.status.ok()) << got.status.to_string();
  EXPECT_EQ(pins_of(*scheduler), own + 2);
  worker->request_finished("step-2");
  EXPECT_EQ(pins_settled(*scheduler, own), own);
  scheduler->request_finished("r");
  EXPECT_EQ(pins_of(*scheduler), 0u);
}

// The pin a worker's view took over from its scheduler is renewed soon (250 ms), off the
// load's path: the renewal makes it the worker's (its quota, its death ends it) with the
// long lease a lookup's pin has. A renewal period of 20 s would come long after the poll.
TEST_F(SplitInstanceTest, APinAWorkerTookOverIsRenewedSoon) {
  auto scheduler = scheduler_that_loaded_a();
  ASSERT_NE(scheduler, nullptr);
  const uint64_t own = pins_of(*scheduler);
  auto worker = zero_copy_worker(60000);
  ASSERT_NE(worker, nullptr);
  const auto taken = Clock::now();
  auto shared = scheduler->share_loaded("r", hash_of("a"), 1);
  ASSERT_TRUE(shared.ok()) << shared.status().to_string();
  auto got =
      worker->load({.request_id = "step", .items = {{hash_of("a"), kItem, (*shared)[0], taken}}},
                   Deadline::after_ms(30000));
  ASSERT_TRUE(got.status.ok()) << got.status.to_string();
  EXPECT_EQ(pins_of(*scheduler), own + 1);
  uint64_t renewed = 0;
  ecx::testing::poll_until(Deadline::after_ms(10000),
                           [&] { return (renewed = scheduler->stats().renewals_received) >= 1; });
  EXPECT_EQ(renewed, 1u);
  EXPECT_TRUE(worker->view_intact("step", hash_of("a")).ok());
  worker->request_finished("step");
  EXPECT_EQ(pins_settled(*scheduler, own), own);
  scheduler->request_finished("r");
}

// A zero-copy worker reads its scheduler's block where it lies: the scheduler answers its
// lookup with a pin of the worker's own (proved by the shared capability), and the
// worker's cache holds nothing. Nobody looks its cache up by key.
TEST_F(SplitInstanceTest, AZeroCopyWorkerReadsItsSchedulersBlockWhereItLies) {
  auto scheduler = scheduler_that_loaded_a();
  ASSERT_NE(scheduler, nullptr);
  uint64_t own = pins_of(*scheduler);
  auto shared = scheduler->share_loaded("r", hash_of("a"), 1);
  ASSERT_TRUE(shared.ok()) << shared.status().to_string();
  auto extra = extra_for("pd-zw-" + tag_);
  extra["zero_copy"] = true;
  extra["keep_loaded"] = false;
  auto worker = make(Role::kConsumer, extra);
  ASSERT_NE(worker, nullptr);
  auto got = worker->load({.request_id = "step", .items = {{hash_of("a"), kItem, (*shared)[0]}}},
                          Deadline::after_ms(30000));
  ASSERT_TRUE(got.status.ok()) << got.status.to_string();
  auto ref = worker->loaded("step", hash_of("a"));
  ASSERT_TRUE(ref.ok());
  EXPECT_TRUE(holds_pattern(*ref, 5));
  EXPECT_EQ(worker->stats().items_viewed, 1u);
  EXPECT_EQ(worker->stats().consumer_cache->entries, 0u);
  EXPECT_EQ(pins_of(*scheduler), own + 2);  // the shared pin, and the worker's own
  worker->request_finished("step");
  EXPECT_EQ(pins_settled(*scheduler, own), own);

  // Another agent of the deployment asks the scheduler's cache for the item by key.
  auto probe = transfer::Agent::create(
      {.name = "probe-" + tag_, .compat_hash = "ecx-ec-v1", .auth_secret = kSecret});
  ASSERT_TRUE(probe.ok()) << probe.status().to_string();
  auto meta = transfer::AgentMetadata::parse(scheduler->agent_metadata());
  ASSERT_TRUE(meta.ok()) << meta.status().to_string();
  ASSERT_TRUE((*probe)->connect(*meta, {}).ok());
  LookupRequest by_key{.items = {{hash_of("a"), transfer::Capability{}}}};
  auto answer = (*probe)->call(meta->name, to_json(by_key), Deadline::after_ms(10000));
  ASSERT_TRUE(answer.ok()) << answer.status().to_string();
  auto reply = parse_items_reply(*answer, 1);
  ASSERT_TRUE(reply.ok()) << reply.status().to_string();
  EXPECT_EQ(reply->items[0].status.code(), StatusCode::kPermissionDenied)
      << reply->items[0].status.to_string();
  EXPECT_EQ(pins_of(*scheduler), own);
  scheduler->request_finished("r");
}

TEST_F(SplitInstanceTest, OnlyALoadedItemIsSharedWithABoundedNumberOfReaders) {
  auto scheduler = make(Role::kConsumer, extra_for("pd-sched-" + tag_));
  ASSERT_NE(scheduler, nullptr);
  EXPECT_EQ(scheduler->share_loaded("nobody", hash_of("a"), 1).status().code(),
            StatusCode::kFailedPrecondition);
  auto params = worker_->save(hash_of("a"), 5, kItem);
  ASSERT_TRUE(params.ok());
  auto out = scheduler->load({.request_id = "r", .items = {{hash_of("a"), kItem, *params}}},
                             Deadline::after_ms(30000));
  ASSERT_TRUE(out.status.ok());
  EXPECT_EQ(scheduler->share_loaded("r", hash_of("other"), 1).status().code(),
            StatusCode::kFailedPrecondition);
  // Readers are tensor-parallel ranks: none, or a count no deployment has, is refused
  // before any pin is taken.
  uint64_t own = pins_of(*scheduler);
  EXPECT_EQ(scheduler->share_loaded("r", hash_of("a"), 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler->share_loaded("r", hash_of("a"), 1u << 20).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(pins_of(*scheduler), own);
  scheduler->request_finished("r");
}

// share_loaded is bounded per request as well as per call: a request's live reader pins
// count against a quota of its own (4096), which readers giving their pins back free
// again. They outlive request_finished (a step already scheduled may share this load for
// another request), ending by their readers' RELEASE or their lease.
TEST_F(SplitInstanceTest, SharedReaderPinsAreCappedPerRequest) {
  auto scheduler = scheduler_that_loaded_a();
  ASSERT_NE(scheduler, nullptr);
  const uint64_t own = pins_of(*scheduler);
  std::vector<EcTransferParams> last;
  for (int call = 0; call < 16; ++call) {
    auto shared = scheduler->share_loaded("r", hash_of("a"), 256);
    ASSERT_TRUE(shared.ok()) << "call " << call << ": " << shared.status().to_string();
    last = std::move(*shared);
  }
  EXPECT_EQ(pins_of(*scheduler), own + 4096);
  auto over = scheduler->share_loaded("r", hash_of("a"), 1);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().to_string();
  EXPECT_NE(over.status().message().find("share:r"), std::string::npos);
  EXPECT_EQ(pins_of(*scheduler), own + 4096);
  // A reader that read and gave its pin back frees its place.
  auto extra = extra_for("pd-w0-" + tag_);
  extra["keep_loaded"] = false;
  auto worker = make(Role::kConsumer, extra);
  ASSERT_NE(worker, nullptr);
  auto got = worker->load({.request_id = "step", .items = {{hash_of("a"), kItem, last[0]}}},
                          Deadline::after_ms(30000));
  ASSERT_TRUE(got.status.ok()) << got.status.to_string();
  worker->request_finished("step");
  EXPECT_EQ(pins_settled(*scheduler, own + 4095), own + 4095);
  EXPECT_TRUE(scheduler->share_loaded("r", hash_of("a"), 1).ok());
  scheduler->request_finished("r");
  EXPECT_EQ(pins_of(*scheduler), 4096u) << "the readers' pins stay until read or leased";
}

TEST(ParamsMessageTest, ARequestAndItsReplyRoundTrip) {
  MmHash h = MmHash::sha256_of({"params-message"});
  auto req = parse_control_request(to_json(ParamsRequest{.items = {h}, .wait_ms = 70}));
  ASSERT_TRUE(req.ok()) << req.status().to_string();
  auto* params = std::get_if<ParamsRequest>(&*req);
  ASSERT_NE(params, nullptr);
  EXPECT_EQ(params->wait_ms, 70);
  ASSERT_EQ(params->items.size(), 1u);
  EXPECT_TRUE(params->items[0] == h);
  EcTransferParams p;
  p.connector = "p2p";
  p.mm_hash = h;
  p.meta = kItem;
  ItemsReply reply;
  reply.items.push_back({.mm_hash = h, .status = Status::Ok(), .where = {}, .params = p});
  auto back = parse_items_reply(to_json(reply), 1);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  ASSERT_TRUE(back->items[0].params.has_value());
  EXPECT_TRUE(back->items[0].params->mm_hash == h);
  // Params of the wrong shape in a reply fail the reply, naming the item.
  auto bad = parse_items_reply(
      R"({"items":[{"mm_hash":")" + h.str() + R"(","status":"ok","params":{"mm_hash":3}}]})", 1);
  EXPECT_FALSE(bad.ok());
}

}  // namespace
}  // namespace ecx::connector
