// Asynchronous file I/O between files and CPU tensors: a pool of C++ threads doing
// pread/pwrite, with O_DIRECT where the file system allows it. The typed Python API, its
// pure-Python twin and the semantics are in fsdpx/ops/aio.py.
//
// [Note: how a request is split]
// A request (one tensor, one file range) is cut into chunks that the worker threads serve in
// parallel; the request completes when its last chunk does (and, for writes with fsync, after
// fdatasync). With O_DIRECT the kernel needs the file offset, the length and the memory
// address aligned to the logical block size (kAlign covers 512 B and 4 KiB devices):
//   * the unaligned head (up to the first aligned file offset) and tail (the last partial
//     block) go through a second, buffered descriptor of the same file;
//   * aligned chunks whose memory is unaligned go through a per-thread aligned bounce buffer;
//   * if the file system refuses O_DIRECT (open or the I/O says EINVAL, e.g. tmpfs), the
//     buffered descriptor serves everything. Linux keeps the two descriptors coherent (direct
//     I/O flushes and invalidates the page-cache range it touches).
// Errors never throw from a worker: the first one is stored with its errno and returned by
// wait(), so a failing open surfaces the same way as a failing read.
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace fsdpx::aio {
namespace {

constexpr int64_t kAlign = 4096;
// pread/pwrite move at most 0x7ffff000 bytes per call on Linux; stay below that.
constexpr int64_t kMaxSyscallBytes = int64_t{1} << 30;

std::string errno_text(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

struct Request {
  std::string path;
  bool is_write = false;
  bool fsync = false;
  at::Tensor tensor;  // holds the memory alive until the request completes
  char* base = nullptr;
  int64_t offset = 0;
  int64_t nbytes = 0;
  int fd_buffered = -1;
  int fd_direct = -1;
  std::atomic<int64_t> chunks_left{0};
  std::atomic<bool> failed{false};
  // Written once, by the thread that sets `failed`; read after `done` (under the pool mutex).
  int err_no = 0;
  std::string err_msg;
  bool done = false;
};

struct Chunk {
  std::shared_ptr<Request> req;
  int64_t pos;  // byte offset inside the tensor (and relative to req->offset in the file)
  int64_t len;
  bool direct;
};

class AioPool : public torch::CustomClassHolder {
 public:
  AioPool(int64_t threads, int64_t queue_depth, bool o_direct, int64_t chunk_bytes)
      : queue_depth_(queue_depth), o_direct_(o_direct),
        chunk_bytes_((chunk_bytes + kAlign - 1) / kAlign * kAlign) {
    TORCH_CHECK(threads > 0, "AioPool: threads must be positive, got ", threads);
    TORCH_CHECK(queue_depth > 0, "AioPool: queue_depth must be positive, got ", queue_depth);
    TORCH_CHECK(chunk_bytes > 0, "AioPool: chunk_bytes must be positive, got ", chunk_bytes);
    for (int64_t i = 0; i < threads; ++i) {
      workers_.emplace_back([this] { worker_loop(); });
    }
  }

  ~AioPool() override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Finish what was submitted: the tensors and descriptors are still referenced.
      idle_cv_.wait(lock, [this] { return in_flight_ == 0; });
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int64_t read(const std::string& path, const at::Tensor& tensor, int64_t offset) {
    return submit(path, tensor, offset, /*is_write=*/false, /*fsync=*/false);
  }

  int64_t write(const std::string& path, const at::Tensor& tensor, int64_t offset, bool fsync) {
    return submit(path, tensor, offset, /*is_write=*/true, fsync);
  }

  // (bytes, errno, message): errno 0 and an empty message on success; errno 0 with a message
  // for errors that have no errno (end of file). Consumes the request id.
  std::tuple<int64_t, int64_t, std::string> wait(int64_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = requests_.find(id);
    TORCH_CHECK(it != requests_.end(), "AioPool.wait: unknown or already waited request id ", id);
    std::shared_ptr<Request> req = it->second;
    idle_cv_.wait(lock, [&] { return req->done; });
    requests_.erase(id);
    if (req->failed.load()) return {0, req->err_no, req->err_msg};
    return {req->nbytes, 0, std::string()};
  }

  bool poll(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = requests_.find(id);
    TORCH_CHECK(it != requests_.end(), "AioPool.poll: unknown or already waited request id ", id);
    return it->second->done;
  }

  // Blocks until every submitted request has completed (results stay available to wait()).
  void wait_all() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [this] { return in_flight_ == 0; });
  }

  // (bytes through O_DIRECT, of which via the bounce buffer, bytes through buffered I/O):
  // lets tests and benchmarks see which path served the data.
  std::tuple<int64_t, int64_t, int64_t> stats() {
    return {direct_bytes_.load(), bounce_bytes_.load(), buffered_bytes_.load()};
  }

 private:
  int64_t submit(const std::string& path, const at::Tensor& tensor, int64_t offset,
                 bool is_write, bool fsync) {
    TORCH_CHECK(tensor.device().is_cpu(), "AioPool: expected a CPU tensor, got ", tensor.device());
    TORCH_CHECK(tensor.is_contiguous(), "AioPool: expected a contiguous tensor");
    TORCH_CHECK(offset >= 0, "AioPool: offset must be >= 0, got ", offset);
    auto req = std::make_shared<Request>();
    req->path = path;
    req->is_write = is_write;
    req->fsync = fsync;
    req->tensor = tensor;
    req->base = static_cast<char*>(tensor.data_ptr());
    req->offset = offset;
    req->nbytes = tensor.numel() * static_cast<int64_t>(tensor.element_size());
    std::vector<Chunk> chunks;
    open_files(*req);
    if (!req->failed.load()) chunks = split(req);

    std::unique_lock<std::mutex> lock(mu_);
    // Back-pressure: at most queue_depth requests in flight; the caller blocks here.
    idle_cv_.wait(lock, [this] { return in_flight_ < queue_depth_; });
    const int64_t id = next_id_++;
    requests_[id] = req;
    ++in_flight_;
    if (chunks.empty()) {
      lock.unlock();
      finish(req);
      return id;
    }
    req->chunks_left.store(static_cast<int64_t>(chunks.size()));
    for (auto& c : chunks) queue_.push_back(std::move(c));
    lock.unlock();
    work_cv_.notify_all();
    return id;
  }

  void open_files(Request& req) {
    const int flags = req.is_write ? (O_WRONLY | O_CREAT) : O_RDONLY;
    req.fd_buffered = ::open(req.path.c_str(), flags | O_CLOEXEC, 0644);
    if (req.fd_buffered < 0) {
      fail(req, errno, std::string("cannot open '") + req.path + "' for " +
                           (req.is_write ? "writing" : "reading"));
      return;
    }
    if (o_direct_ && req.nbytes >= kAlign) {
      // EINVAL here means the file system has no O_DIRECT: the buffered descriptor serves all.
      req.fd_direct = ::open(req.path.c_str(), flags | O_CLOEXEC | O_DIRECT, 0644);
    }
  }

  std::vector<Chunk> split(const std::shared_ptr<Request>& req) {
    std::vector<Chunk> out;
    int64_t pos = 0;
    const int64_t n = req->nbytes;
    auto push = [&](int64_t end, bool direct) {
      while (pos < end) {
        const int64_t len = std::min(chunk_bytes_, end - pos);
        out.push_back({req, pos, len, direct});
        pos += len;
      }
    };
    if (req->fd_direct >= 0) {
      const int64_t head = std::min(n, (kAlign - req->offset % kAlign) % kAlign);
      push(head, false);
      push(head + (n - head) / kAlign * kAlign, true);
    }
    push(n, false);
    return out;
  }

  void worker_loop() {
    // The bounce buffer lives as long as this thread: no allocation per chunk.
    std::unique_ptr<char, decltype(&std::free)> bounce(nullptr, &std::free);
    while (true) {
      Chunk c;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
        c = std::move(queue_.front());
        queue_.pop_front();
      }
      Request& req = *c.req;
      if (!req.failed.load()) {
        if (c.direct && !bounce) {
          bounce.reset(static_cast<char*>(std::aligned_alloc(kAlign, chunk_bytes_)));
        }
        run_chunk(req, c, bounce.get());
      }
      if (req.chunks_left.fetch_sub(1) == 1) finish(c.req);
    }
  }

  void run_chunk(Request& req, const Chunk& c, char* bounce) {
    char* mem = req.base + c.pos;
    const int64_t file_off = req.offset + c.pos;
    int64_t done = 0;
    if (c.direct) {
      const bool aligned = reinterpret_cast<uintptr_t>(mem) % kAlign == 0;
      char* buf = aligned ? mem : bounce;
      if (!aligned && req.is_write) std::memcpy(buf, mem, c.len);
      done = transfer(req, req.fd_direct, buf, c.len, file_off, /*direct=*/true);
      if (done < 0) return;
      if (!aligned && !req.is_write) std::memcpy(mem, buf, done);
      direct_bytes_ += done;
      if (!aligned) bounce_bytes_ += done;
      // Short direct read: the file ends inside this chunk. The buffered descriptor reads
      // the rest (an unaligned offset now) and reports the end of file precisely.
    }
    if (done < c.len) {
      const int64_t more = transfer(req, req.fd_buffered, mem + done, c.len - done,
                                    file_off + done, /*direct=*/false);
      if (more >= 0) buffered_bytes_ += more;
    }
  }

  // Moves up to len bytes; returns the count moved, or -1 after recording an error. A direct
  // transfer stops early at end of file or when the file system rejects O_DIRECT (EINVAL), and
  // the caller finishes through the buffered descriptor.
  int64_t transfer(Request& req, int fd, char* buf, int64_t len, int64_t off, bool direct) {
    int64_t done = 0;
    while (done < len) {
      const size_t want = static_cast<size_t>(std::min(len - done, kMaxSyscallBytes));
      const ssize_t r = req.is_write ? ::pwrite(fd, buf + done, want, off + done)
                                     : ::pread(fd, buf + done, want, off + done);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && direct && errno == EINVAL) return done;
      if (r < 0) {
        fail(req, errno, std::string(req.is_write ? "pwrite" : "pread") + " of " +
                             std::to_string(want) + " bytes at offset " +
                             std::to_string(off + done) + " in '" + req.path + "' failed");
        return -1;
      }
      if (r == 0) {
        if (direct) return done;
        struct stat st {};
        const int64_t size = ::fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
        fail(req, 0, "read of " + std::to_string(req.nbytes) + " bytes at offset " +
                         std::to_string(req.offset) + " from '" + req.path +
                         "' runs past the end of the file (size " + std::to_string(size) +
                         " bytes); read a smaller tensor or a lower offset");
        return -1;
      }
      done += r;
      if (direct && r % kAlign != 0) return done;  // end of file inside this block
    }
    return done;
  }

  void fail(Request& req, int err, const std::string& what) {
    bool expected = false;
    if (req.failed.compare_exchange_strong(expected, true)) {
      req.err_no = err;
      req.err_msg = "fsdpx.aio: " + what + (err != 0 ? ": " + errno_text(err) : "");
    }
  }

  void finish(const std::shared_ptr<Request>& req) {
    if (req->is_write && req->fsync && !req->failed.load() && req->fd_buffered >= 0 &&
        ::fdatasync(req->fd_buffered) != 0) {
      fail(*req, errno, "fdatasync of '" + req->path + "' failed");
    }
    if (req->fd_direct >= 0) ::close(req->fd_direct);
    if (req->fd_buffered >= 0) ::close(req->fd_buffered);
    req->fd_direct = req->fd_buffered = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      req->tensor = at::Tensor();
      req->done = true;
      --in_flight_;
    }
    idle_cv_.notify_all();
  }

  const int64_t queue_depth_;
  const bool o_direct_;
  const int64_t chunk_bytes_;
  std::mutex mu_;
  std::condition_variable work_cv_;  // workers: a chunk is queued, or stop
  std::condition_variable idle_cv_;  // waiters: a request completed
  std::deque<Chunk> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  int64_t next_id_ = 0;
  int64_t in_flight_ = 0;
  bool stop_ = false;
  std::atomic<int64_t> direct_bytes_{0};
  std::atomic<int64_t> bounce_bytes_{0};
  std::atomic<int64_t> buffered_bytes_{0};
  std::vector<std::thread> workers_;  // last: started after every member above exists
};

}  // namespace

// A fragment, not TORCH_LIBRARY: the fsdpx namespace is defined once, in schemas.cpp, and a
// custom class is registered with its C++ type, which belongs here next to its code rather
// than in the schema file (that would make schemas.cpp include the whole pool).
TORCH_LIBRARY_FRAGMENT(fsdpx, m) {
  m.class_<AioPool>("AioPool")
      .def(torch::init<int64_t, int64_t, bool, int64_t>())
      .def("read", &AioPool::read)
      .def("write", &AioPool::write)
      .def("wait", &AioPool::wait)
      .def("poll", &AioPool::poll)
      .def("wait_all", &AioPool::wait_all)
      .def("stats", &AioPool::stats);
}

}  // namespace fsdpx::aio
