// The I/O worker of io.js's 'shared' mode: reads pieces of the model file into lanes of a
// SharedArrayBuffer and flags each lane DONE (2) or FAILED (3) with Atomics, waking the engine's
// worker if it blocks on it. Messages: {init: source, sab, ctrl, maxPiece, device, memory,
// stallAfter}, then
// {lane, id, ranges: [offset, length, ...], dest} (read one after the other into the lane, or with
// the engine's shared wasm `memory` and `dest` >= 0 straight into that memory at `dest`). An OPFS model is read through this worker's own sync access handle straight
// into the shared lane (Chromium: `readwrite-unsafe` handles coexist with the engine's); where
// that is refused, through a `File` snapshot.
import { openReader } from './io.js';
import { Device } from './device.js';

const DONE = 2, FAILED = 3;
let read = null, handle = null, sab = null, ctrl = null, maxPiece = 0, device = null, memory = null;
let ready = null, stallAfter = 0, reads = 0;

async function init(m) {
  read = openReader(m.init);
  ({ sab, ctrl, maxPiece, memory } = m);
  stallAfter = m.stallAfter ?? 0;
  // The engine's modelled flash device, shared with its worker (benchmarks).
  device = m.device ? new Device(m.device.profile, m.device.state) : null;
  if (m.init.kind === 'opfs') {
    try {
      handle = await (await m.init.dir.getFileHandle('data')).createSyncAccessHandle({ mode: 'readwrite-unsafe' });
    } catch (_) {
      handle = null;
    }
  }
}

onmessage = async (ev) => {
  const m = ev.data;
  if (m.init) {
    ready = init(m);
    await ready;
    postMessage({ ready: true });
    return;
  }
  await ready;
  const { lane, ranges } = m;
  // Tests: stop answering, as a hung worker would (the lane stays busy).
  if (stallAfter > 0 && ++reads >= stallAfter) return;
  let st = FAILED;
  try {
    // Into the lane, or (`dest` >= 0) straight into the engine's shared wasm memory at `dest`
    // (a fresh view each time: the memory may have grown).
    const direct = memory && m.dest >= 0;
    let at = direct ? m.dest : lane * maxPiece;
    for (let i = 0; i < ranges.length; i += 2) {
      const offset = ranges[i], length = ranges[i + 1];
      const dest = new Uint8Array(direct ? memory.buffer : sab, at, length);
      if (handle) {
        const n = device ? device.read(length, () => handle.read(dest, { at: offset })) : handle.read(dest, { at: offset });
        if (n !== length) throw new Error(`short read (${n} of ${length} bytes at ${offset})`);
      } else {
        dest.set(device ? await device.readAsync(length, () => read(offset, length)) : await read(offset, length));
      }
      at += length;
    }
    st = DONE;
  } catch (e) {
    console.warn(`LES I/O worker: ${e?.message ?? e}`);
  }
  Atomics.store(ctrl, 4 * lane, st);
  Atomics.notify(ctrl, 4 * lane);
};
