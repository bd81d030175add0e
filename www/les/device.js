// A modelled flash device for benchmarks, as the native `--store` profiles (src/store/throttle.rs):
// each read costs `latency + length / bandwidth`, at most `queueDepth` reads are in service, and
// transfers share one channel of total throughput `bandwidth`. The engine's worker and its I/O
// worker share one device through a SharedArrayBuffer (cross-origin isolated pages only), so the
// same profile runs in the browser and natively. The real read happens first (its own time is
// not hidden); the caller then sleeps until the modelled completion time.

const LOCK = 0, IN_SERVICE = 1, SLEEP = 2;

export class Device {
  // profile: {name, bandwidth (bytes/s), latency (s), queue_depth}; `state`: another Device's
  // `state` (the I/O worker's copy), else a new one.
  constructor(profile, state = null) {
    if (typeof SharedArrayBuffer !== 'function') throw new Error('a modelled device needs a cross-origin isolated page (SharedArrayBuffer)');
    this.profile = profile;
    this.state = state ?? new SharedArrayBuffer(32);
    this.i32 = new Int32Array(this.state, 0, 4);
    this.f64 = new Float64Array(this.state, 16, 1); // when the transfer channel is next free (ms)
  }

  now() {
    return performance.timeOrigin + performance.now();
  }

  _lock() {
    while (Atomics.compareExchange(this.i32, LOCK, 0, 1) !== 0) Atomics.wait(this.i32, LOCK, 1, 1);
  }

  _unlock() {
    Atomics.store(this.i32, LOCK, 0);
    Atomics.notify(this.i32, LOCK, 1);
  }

  _sleepUntil(t) {
    for (let d = t - this.now(); d > 0; d = t - this.now()) Atomics.wait(this.i32, SLEEP, 0, d);
  }

  // Admit a read of `length` bytes; returns its modelled completion time (ms).
  _admit(length) {
    const start = this.now();
    for (;;) {
      this._lock();
      const n = this.i32[IN_SERVICE];
      if (n < Math.max(1, this.profile.queue_depth)) break;
      this._unlock();
      Atomics.wait(this.i32, IN_SERVICE, n, 1);
    }
    this.i32[IN_SERVICE]++;
    // Latency overlaps with other reads; the transfer serialises on the channel.
    const ready = start + this.profile.latency * 1000;
    const xfer = Math.max(ready, this.f64[0]);
    const done = xfer + (length / this.profile.bandwidth) * 1000;
    this.f64[0] = done;
    this._unlock();
    return done;
  }

  _release(done) {
    this._sleepUntil(done);
    this._lock();
    this.i32[IN_SERVICE]--;
    this._unlock();
    Atomics.notify(this.i32, IN_SERVICE, 1);
  }

  // Run the synchronous read `f` (of `length` bytes) at the device's pace.
  read(length, f) {
    const done = this._admit(length);
    try {
      return f();
    } finally {
      this._release(done);
    }
  }

  async readAsync(length, f) {
    const done = this._admit(length);
    try {
      return await f();
    } finally {
      this._release(done);
    }
  }
}
