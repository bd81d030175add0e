// Asynchronous expert reads for the engine (the browser's read executor, src/wasm/io.rs). The
// engine decides what to read and when (the native scheduling policy); this file only executes
// reads of prefetches while the engine computes. Interface (synchronous calls from wasm):
//   submit(id, ranges) -> bool           start a read of ranges = [offset, length, ...], one after
//                                         the other into one buffer (false: these bytes cannot be
//                                         read asynchronously here, e.g. not stored yet)
//   poll() -> number[]                    ids finished (or failed) since the last poll
//   take(id, dest: Uint8Array)            copy the bytes into dest (throws the read's error)
//   wait(id) -> bool                      block until finished (false: cannot block here)
//   cancel(id)                            forget a read
//
// Modes:
//   'shared' (self.crossOriginIsolated): an I/O worker (io-worker.js) reads each piece from the
//            model's File into its lane of a SharedArrayBuffer and flags it with Atomics, so
//            pieces arrive while the engine computes without it yielding, and `wait` can block.
//   'local'  (no isolation): `File.slice().arrayBuffer()` promises in this worker; they land
//            whenever the worker awaits (WebGPU readbacks, between tokens). `wait` cannot block.

const FREE = 0, BUSY = 1, DONE = 2, FAILED = 3;

// A reader over a postable source description: {kind: 'opfs', dir} (the model's OPFS folder; its
// `data` file) or {kind: 'file', file}. Returns async (offset, length) => Uint8Array.
export function openReader(src) {
  let file = src.kind === 'file' ? src.file : null;
  const snapshot = async () => (file = await (await src.dir.getFileHandle('data')).getFile());
  return async (offset, length) => {
    for (let attempt = 0; ; attempt++) {
      try {
        if (!file) await snapshot();
        const b = new Uint8Array(await file.slice(offset, offset + length).arrayBuffer());
        if (b.byteLength !== length) throw new Error(`short read (${b.byteLength} of ${length} bytes at ${offset})`);
        return b;
      } catch (e) {
        // An OPFS snapshot goes stale when the file is written (the background download): take
        // a new one once.
        if (src.kind !== 'opfs' || attempt > 0) throw e;
        file = null;
      }
    }
  };
}

export class AsyncReads {
  // model: {asyncSource() -> source description | null, canReadAsync(offset, length) -> bool}.
  // Resolves to null when the model has no source for asynchronous reads. In 'shared' mode it
  // resolves once the I/O worker runs: a worker started by this one is only set up while this
  // one yields, and the engine does not yield while it computes.
  // `maxPiece`: bytes per read (a shared lane's size): a whole expert of most models, so one
  // prefetch is one read.
  // `failEvery` (tests): every n-th read fails when taken.
  // `timeoutMs`: how long the engine blocks on an I/O worker that has not finished a read before
  // it gives the worker up (`stopWorker`); `stallAfter` (tests): the worker stops answering after
  // that many reads, as a hung one would.
  static async create(model, { lanes = 1, maxPiece = 4 << 20, shared = !!globalThis.crossOriginIsolated, failEvery = 0, memory = null, timeoutMs = 60000, stallAfter = 0 } = {}) {
    const src = model.asyncSource?.();
    if (!src) return null;
    const r = new AsyncReads();
    r.model = model;
    r.reported = new Set();
    r.failEvery = failEvery;
    r.takes = 0;
    r.lanes = lanes;
    r.maxPiece = maxPiece;
    r.timeoutMs = timeoutMs;
    // direct: reads that landed in the engine's memory; workerStopped: the I/O worker was given up
    r.stats = { submitted: 0, refused: 0, completed: 0, failed: 0, bytes: 0, blocked: 0, direct: 0, workerStopped: false };
    if (shared && typeof SharedArrayBuffer === 'function' && typeof Atomics?.wait === 'function') {
      r.mode = 'shared';
      r.sab = new SharedArrayBuffer(lanes * maxPiece);
      r.ctrl = new Int32Array(new SharedArrayBuffer(lanes * 4 * 4)); // per lane: state, id, length, -
      r.laneOf = new Map();
      r.cancelled = new Set();
      // The threaded build's wasm memory is shared: the I/O worker then reads each piece straight
      // into its expert slot (the address the engine gives with the read), no copy at `take`.
      r.memory = memory?.buffer instanceof SharedArrayBuffer ? memory : null;
      r.destOf = new Map(); // id -> the wasm address a direct read fills
      r.worker = new Worker(new URL('./io-worker.js', import.meta.url), { type: 'module' });
      const started = new Promise((res) => {
        r.worker.onmessage = (e) => res(e.data?.ready === true);
        r.worker.onerror = () => res(false);
        setTimeout(() => res(false), 10000);
      });
      const device = model.device ? { profile: model.device.profile, state: model.device.state } : null;
      r.worker.postMessage({ init: src, sab: r.sab, ctrl: r.ctrl, maxPiece, device, memory: r.memory, stallAfter });
      if (!(await started)) {
        r.worker.terminate();
        return AsyncReads.create(model, { lanes, maxPiece, shared: false, failEvery, memory, timeoutMs });
      }
    } else {
      r.mode = 'local';
      r.read = openReader(src);
      r.flights = new Map(); // id -> {bytes | error | null}
      r.finished = [];
    }
    return r;
  }

  // Whether reads go straight into the engine's memory (`submit`'s `dest`).
  get direct() {
    return !!this.memory;
  }

  // `dest`: where in the engine's wasm memory the bytes go (direct reads), else -1.
  submit(id, ranges, dest = -1) {
    let length = 0, stored = true;
    for (let i = 0; i < ranges.length; i += 2) {
      length += ranges[i + 1];
      if (!this.model.canReadAsync(ranges[i], ranges[i + 1])) {
        // Not stored yet: the store fetches it by range in the background (lookahead range
        // fetch), and a read that comes first fetches it itself.
        this.model.hint?.(ranges[i], ranges[i + 1]);
        stored = false;
      }
    }
    if (length > this.maxPiece || !stored || this.stats.workerStopped) {
      this.stats.refused++;
      return false;
    }
    if (this.mode === 'shared') {
      let lane = -1;
      for (let l = 0; l < this.lanes; l++) if (Atomics.load(this.ctrl, 4 * l) === FREE) { lane = l; break; }
      if (lane < 0) return false;
      this.ctrl[4 * lane + 1] = id;
      this.ctrl[4 * lane + 2] = length;
      Atomics.store(this.ctrl, 4 * lane, BUSY);
      this.laneOf.set(id, lane);
      const into = this.memory && dest >= 0 ? dest : -1;
      if (into >= 0) this.destOf.set(id, into);
      this.worker.postMessage({ lane, id, ranges: Array.from(ranges), dest: into });
    } else {
      if (this.flights.size >= this.lanes) return false;
      const f = { bytes: null, error: null };
      this.flights.set(id, f);
      const parts = [];
      for (let i = 0; i < ranges.length; i += 2) parts.push(this.read(ranges[i], ranges[i + 1]));
      Promise.all(parts).then((bs) => {
        const b = new Uint8Array(length);
        let at = 0;
        for (const x of bs) { b.set(x, at); at += x.byteLength; }
        f.bytes = b;
      }, (e) => { f.error = e; }).finally(() => {
        if (this.flights.get(id) === f) this.finished.push(id);
      });
    }
    this.stats.submitted++;
    return true;
  }

  poll() {
    if (this.mode === 'local') return this.finished.splice(0);
    const out = [];
    for (let l = 0; l < this.lanes; l++) {
      const st = Atomics.load(this.ctrl, 4 * l);
      if (st !== DONE && st !== FAILED) continue;
      const id = this.ctrl[4 * l + 1];
      if (this.cancelled.delete(id)) {
        this.laneOf.delete(id);
        Atomics.store(this.ctrl, 4 * l, FREE);
      } else if (!this.reported.has(id)) {
        this.reported.add(id);
        out.push(id);
      }
    }
    return out;
  }

  take(id, dest) {
    if (this.failEvery > 0 && ++this.takes % this.failEvery === 0) {
      this.cancel(id);
      this.stats.failed++;
      throw new Error('injected read failure (debugFailReads)');
    }
    if (this.mode === 'local') {
      const f = this.flights.get(id);
      this.flights.delete(id);
      if (!f || f.error || !f.bytes) {
        this.stats.failed++;
        throw f?.error ?? new Error(`read ${id} is not finished`);
      }
      dest.set(f.bytes);
    } else {
      const lane = this.laneOf.get(id);
      if (lane === undefined) throw new Error(`no read ${id}`);
      this.laneOf.delete(id);
      this.reported.delete(id);
      const st = Atomics.load(this.ctrl, 4 * lane);
      try {
        if (st !== DONE) {
          this.stats.failed++;
          throw new Error(st === FAILED ? 'the I/O worker could not read the model file' : `read ${id} is not finished`);
        }
        const into = this.destOf.get(id);
        if (into === undefined) dest.set(new Uint8Array(this.sab, lane * this.maxPiece, this.ctrl[4 * lane + 2]));
        else if (into !== dest.byteOffset || dest.byteLength !== this.ctrl[4 * lane + 2]) throw new Error(`read ${id} went to ${into}, not ${dest.byteOffset}`);
        else this.stats.direct++;
      } finally {
        this.destOf.delete(id);
        if (st === DONE || st === FAILED) Atomics.store(this.ctrl, 4 * lane, FREE);
      }
    }
    this.stats.completed++;
    this.stats.bytes += dest.byteLength;
  }

  wait(id) {
    if (this.mode !== 'shared') return false;
    const lane = this.laneOf.get(id);
    if (lane === undefined) return true;
    this.stats.blocked++;
    // A read that has not finished within `timeoutMs` is given up on with its worker (the engine
    // reads it itself).
    return this._waitIdle(lane);
  }

  cancel(id) {
    if (this.mode === 'local') {
      this.flights.delete(id);
      return;
    }
    const lane = this.laneOf.get(id);
    if (lane === undefined) return;
    this.reported.delete(id);
    // A direct read writes into the engine's memory: wait until the worker is done with it, so
    // the slot can be given to another expert (or freed).
    if (this.destOf.delete(id)) this._waitIdle(lane);
    const st = Atomics.load(this.ctrl, 4 * lane);
    if (st === BUSY) {
      this.cancelled.add(id); // the lane is freed once the worker has finished with it
    } else {
      this.laneOf.delete(id);
      Atomics.store(this.ctrl, 4 * lane, FREE);
    }
  }

  // Block until the I/O worker no longer writes through `lane` (true), or until `timeoutMs` has
  // passed: then the worker is stopped (false).
  _waitIdle(lane) {
    const t0 = performance.now();
    while (Atomics.load(this.ctrl, 4 * lane) === BUSY) {
      const left = this.timeoutMs - (performance.now() - t0);
      if (left <= 0) {
        this.stopWorker();
        return false;
      }
      Atomics.wait(this.ctrl, 4 * lane, BUSY, Math.min(left, 1000));
    }
    return true;
  }

  // Give up on an I/O worker that stopped answering: terminate it, so that nothing writes into the
  // engine's memory once this returns (a slot whose read never finished can then be reused), mark
  // its busy lanes failed (their reads fail when taken: the engine reads those experts itself)
  // and accept no more reads (`submit` refuses: prefetches become nothing, demand reads go on).
  stopWorker() {
    if (this.stats.workerStopped) return;
    this.stats.workerStopped = true;
    this.worker?.terminate();
    console.warn(`LES: the I/O worker did not finish a read within ${this.timeoutMs} ms; prefetching goes on without it`);
    for (let l = 0; l < this.lanes; l++) {
      if (Atomics.load(this.ctrl, 4 * l) === BUSY) Atomics.store(this.ctrl, 4 * l, FAILED);
    }
  }

  close() {
    // Direct reads in flight write into the engine's memory: let them finish first.
    if (this.memory) for (let l = 0; l < this.lanes; l++) this._waitIdle(l);
    this.worker?.terminate();
  }
}
