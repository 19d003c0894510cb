// A small persistent std::thread pool: run(n, threads, fn) calls fn(0..n-1) on up to `threads`
// threads (the caller is one of them), tasks handed out one at a time from an atomic counter.
// One job at a time; a second caller waits for the first. The first exception is rethrown.
// A forked child gets a fresh pool (instance()).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fastbert {

class ThreadPool {
 public:
  static ThreadPool& instance();
  static int hardware_threads();

  void run(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn);
  ~ThreadPool();

 private:
  void worker_loop(int index);
  void work(const std::function<void(int64_t)>& fn);

  std::mutex job_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int active_limit_ = 0;   // workers with index < active_limit_ join the current job
  int running_ = 0;        // workers still inside the current job
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace fastbert
