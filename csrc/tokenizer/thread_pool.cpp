// Thread pool (thread_pool.h).
#include "thread_pool.h"

#include <unistd.h>

#include <algorithm>

namespace fastbert {

ThreadPool& ThreadPool::instance() {
  // A forked child (e.g. a DataLoader worker) has none of the parent's threads: it gets a new
  // pool and the old one is leaked, never touched. Pools are never destroyed, so no worker
  // outlives static teardown.
  static std::mutex mutex;
  static ThreadPool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (pool == nullptr || owner != getpid()) {
    pool = new ThreadPool();
    owner = getpid();
  }
  return *pool;
}

int ThreadPool::hardware_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::work(const std::function<void(int64_t)>& fn) {
  for (;;) {
    const int64_t task = next_.fetch_add(1, std::memory_order_relaxed);
    if (task >= n_tasks_) return;
    try {
      fn(task);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_tasks_, std::memory_order_relaxed);  // stop handing out work
    }
  }
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t)>* fn;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || (generation_ != seen && index < active_limit_); });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
    }
    work(*fn);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--running_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::run(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn) {
  if (n_tasks <= 0) return;
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n_tasks)));
  if (threads == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  std::lock_guard<std::mutex> job(job_mutex_);
  const int helpers = threads - 1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (static_cast<int>(workers_.size()) < helpers) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { worker_loop(index); });
    }
    fn_ = &fn;
    n_tasks_ = n_tasks;
    next_.store(0);
    error_ = nullptr;
    active_limit_ = helpers;
    running_ = helpers;
    ++generation_;
  }
  wake_.notify_all();
  work(fn);
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return running_ == 0; });
    active_limit_ = 0;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace fastbert
