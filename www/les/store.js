// Model storage for the LES worker. Everything here runs in a dedicated worker, where reads can be
// synchronous: the engine (wasm) calls `readSync(offset, length)` while it computes.
//
// A model is split into *units* that tile the file. For a `.les` bundle (docs/bundle.md) the units
// are the bundle's own blocks, each with its CRC-32: [header + manifest], [dense GGUF], and one unit
// per (layer, expert) block. For a plain GGUF there are no checksums: fixed 4 MiB units.
//
// Backing stores (first that works): OPFS (`FileSystemSyncAccessHandle`), IndexedDB (one Blob per
// unit, read synchronously with `FileReaderSync`). A unit is marked present only after its bytes
// were verified and written, so an interrupted download resumes where it stopped and never leaves a
// half-written unit marked as good. A unit needed before the download reached it is fetched at once
// with a synchronous HTTP Range request (on-demand / lookahead fetch).

const GGUF_UNIT = 4 << 20;
const MAX_TRIES = 3;
const MAX_AHEAD = 8; // lookahead range fetches in flight
const ROOT_DIR = 'les-models';

export class LesStoreError extends Error {
  constructor(name, message) {
    super(message);
    this.name = name; // 'QuotaExceededError' | 'ChecksumError' | 'RangeNotSupported' | 'NetworkError' | 'NotFound'
  }
}

function hex32(n) {
  return (n >>> 0).toString(16).padStart(8, '0');
}

// FNV-1a of the URL: the model's directory name.
function keyOf(url) {
  let h = 0x811c9dc5;
  for (let i = 0; i < url.length; i++) {
    h ^= url.charCodeAt(i);
    h = Math.imul(h, 0x01000193);
  }
  const base = url.split('?')[0].split('/').pop().replace(/[^A-Za-z0-9._-]/g, '_').slice(0, 80);
  return `${base}-${hex32(h)}`;
}

function u64(dv, off) {
  return Number(dv.getBigUint64(off, true));
}

// Units of a bundle from its first bytes (header + manifest), or null when not a bundle.
export function bundleUnits(head, crc32) {
  const dv = new DataView(head.buffer, head.byteOffset, head.byteLength);
  const magic = new TextDecoder().decode(head.subarray(0, 8));
  if (magic !== 'LESBUNDL') return null;
  if (crc32(head.subarray(0, 124)) !== dv.getUint32(124, true)) throw new LesStoreError('ChecksumError', 'bundle header checksum mismatch');
  const fileLen = u64(dv, 16), manOff = u64(dv, 24), manLen = u64(dv, 32), manCrc = dv.getUint32(40, true);
  const denseOff = u64(dv, 48), denseLen = u64(dv, 56), denseCrc = dv.getUint32(64, true);
  const nLayers = dv.getUint32(68, true), expertsOff = u64(dv, 72), nExpert = dv.getUint32(88, true);
  if (head.byteLength < denseOff) return { needHead: denseOff };
  const man = head.subarray(manOff, manOff + manLen);
  if (crc32(man) !== manCrc) throw new LesStoreError('ChecksumError', 'bundle manifest checksum mismatch');
  const mdv = new DataView(man.buffer, man.byteOffset, man.byteLength);
  const nameLen = mdv.getUint32(24, true);
  const recs = 32 + Math.ceil(nameLen / 8) * 8 + 64 * nLayers;
  const units = [
    { start: 0, end: denseOff, crcLen: 0, crc: null, label: 'header' },
    { start: denseOff, end: expertsOff, crcLen: denseLen, crc: denseCrc, label: 'dense' },
  ];
  const n = nLayers * nExpert;
  for (let i = 0; i < n; i++) {
    const r = recs + 24 * i;
    const off = u64(mdv, r), size = u64(mdv, r + 8), crc = mdv.getUint32(r + 16, true);
    const end = i + 1 < n ? u64(mdv, r + 24) : fileLen;
    units.push({ start: off, end, crcLen: size, crc, label: `L${Math.floor(i / nExpert)} E${i % nExpert}` });
  }
  return { units, fileLen };
}

function ggufUnits(size) {
  const units = [];
  for (let s = 0; s < size; s += GGUF_UNIT) units.push({ start: s, end: Math.min(size, s + GGUF_UNIT), crcLen: 0, crc: null, label: `chunk ${units.length}` });
  return units;
}

// Synchronous and asynchronous HTTP Range reads, counting requests and bytes.
export class RangeClient {
  constructor(url) {
    this.url = url;
    this.requests = 0;
    this.bytes = 0;
  }
  _check(status, len, start, end) {
    if (status === 200 && len !== end - start) throw new LesStoreError('RangeNotSupported', `${this.url}: the server ignored the Range header (HTTP 200); LES needs HTTP range requests`);
    if (status !== 206 && status !== 200) throw new LesStoreError(status === 404 ? 'NotFound' : 'NetworkError', `${this.url}: HTTP ${status} for bytes ${start}-${end - 1}`);
    if (len !== end - start) throw new LesStoreError('NetworkError', `${this.url}: short response (${len} of ${end - start} bytes at ${start})`);
  }
  readSync(start, end) {
    this.requests++;
    const x = new XMLHttpRequest();
    x.open('GET', this.url, false);
    x.responseType = 'arraybuffer';
    x.setRequestHeader('Range', `bytes=${start}-${end - 1}`);
    try {
      x.send();
    } catch (e) {
      throw new LesStoreError('NetworkError', `${this.url}: ${e.message}`);
    }
    const buf = x.response ? new Uint8Array(x.response) : new Uint8Array(0);
    this._check(x.status, buf.byteLength, start, end);
    this.bytes += buf.byteLength;
    return buf;
  }
  async read(start, end, signal) {
    this.requests++;
    let r;
    try {
      r = await fetch(this.url, { headers: { Range: `bytes=${start}-${end - 1}` }, signal, cache: 'no-store' });
    } catch (e) {
      throw new LesStoreError('NetworkError', `${this.url}: ${e.message}`);
    }
    let buf;
    try {
      buf = new Uint8Array(await r.arrayBuffer());
    } catch (e) {
      throw new LesStoreError('NetworkError', `${this.url}: download interrupted at byte ${start} (${e.message})`);
    }
    this._check(r.status, buf.byteLength, start, end);
    this.bytes += buf.byteLength;
    return buf;
  }
  async size() {
    this.requests++;
    const r = await fetch(this.url, { headers: { Range: 'bytes=0-0' }, cache: 'no-store' });
    if (r.status === 404) throw new LesStoreError('NotFound', `${this.url}: HTTP 404`);
    const cr = r.headers.get('Content-Range');
    await r.arrayBuffer();
    if (r.status !== 206 || !cr) throw new LesStoreError('RangeNotSupported', `${this.url}: the server does not answer Range requests (HTTP ${r.status})`);
    return Number(cr.split('/')[1]);
  }
}

// A sync access handle that other tabs (workers) may hold too: writes are whole verified units,
// the same bytes whoever writes them. Browsers without access-handle modes give exclusive ones.
async function syncHandle(fh) {
  try {
    return await fh.createSyncAccessHandle({ mode: 'readwrite-unsafe' });
  } catch (e) {
    if (e.name === 'NoModificationAllowedError') throw new LesStoreError('NoModificationAllowedError', 'this model is open in another tab (and this browser cannot share OPFS files between tabs)');
    return await fh.createSyncAccessHandle();
  }
}

// OPFS backing: `data` (the model bytes, sparse) and `present` (one byte per unit).
class OpfsBacking {
  static async open(dir) {
    const b = new OpfsBacking();
    b.dir = dir;
    b.data = await syncHandle(await dir.getFileHandle('data', { create: true }));
    b.present = await syncHandle(await dir.getFileHandle('present', { create: true }));
    b.kind = 'opfs';
    return b;
  }
  presentBits(n) {
    const bits = new Uint8Array(n);
    const have = Math.min(n, this.present.getSize());
    if (have > 0) this.present.read(bits.subarray(0, have), { at: 0 });
    return bits;
  }
  write(unit, index, bytes) {
    const w = this.data.write(bytes, { at: unit.start });
    if (w !== bytes.byteLength) throw new LesStoreError('QuotaExceededError', `short write to OPFS (${w} of ${bytes.byteLength} bytes)`);
    this.data.flush();
    this.present.write(new Uint8Array([1]), { at: index });
    this.present.flush();
  }
  read(start, out) {
    const n = this.data.read(out, { at: start });
    if (n !== out.byteLength) throw new LesStoreError('NetworkError', `OPFS short read (${n} of ${out.byteLength} bytes at ${start})`);
  }
  close() {
    try { this.data.close(); } catch (_) {}
    try { this.present.close(); } catch (_) {}
  }
}

// IndexedDB backing (where OPFS sync handles are missing): one Blob per unit.
class IdbBacking {
  static async open(key) {
    const b = new IdbBacking();
    b.kind = 'indexeddb';
    b.key = key;
    b.db = await new Promise((res, rej) => {
      const q = indexedDB.open(`${ROOT_DIR}-${key}`, 1);
      q.onupgradeneeded = () => {
        q.result.createObjectStore('units');
        q.result.createObjectStore('meta');
      };
      q.onsuccess = () => res(q.result);
      q.onerror = () => rej(q.error);
    });
    b.blobs = new Map();
    await new Promise((res, rej) => {
      const t = b.db.transaction('units').objectStore('units').openCursor();
      t.onsuccess = () => {
        const c = t.result;
        if (!c) return res();
        b.blobs.set(c.key, c.value);
        c.continue();
      };
      t.onerror = () => rej(t.error);
    });
    b.meta = await new Promise((res, rej) => {
      const q = b.db.transaction('meta').objectStore('meta').get('meta');
      q.onsuccess = () => res(q.result ?? null);
      q.onerror = () => rej(q.error);
    });
    b.pending = [];
    return b;
  }
  putMeta(meta) {
    return new Promise((res, rej) => {
      const t = this.db.transaction('meta', 'readwrite');
      t.objectStore('meta').put(meta, 'meta');
      t.oncomplete = res;
      t.onerror = () => rej(t.error);
    });
  }
  presentBits(n) {
    const bits = new Uint8Array(n);
    for (const k of this.blobs.keys()) if (k < n) bits[k] = 1;
    return bits;
  }
  write(unit, index, bytes) {
    const blob = new Blob([bytes]);
    this.blobs.set(index, blob);
    this.pending.push(new Promise((res, rej) => {
      const t = this.db.transaction('units', 'readwrite');
      t.objectStore('units').put(blob, index);
      t.oncomplete = res;
      t.onerror = () => rej(t.error);
      t.onabort = () => rej(t.error);
    }));
  }
  read(start, out, units, findUnit) {
    let o = 0;
    while (o < out.byteLength) {
      const i = findUnit(start + o);
      const u = units[i];
      const a = start + o - u.start, n = Math.min(out.byteLength - o, u.end - u.start - a);
      const ab = new FileReaderSync().readAsArrayBuffer(this.blobs.get(i).slice(a, a + n));
      out.set(new Uint8Array(ab), o);
      o += n;
    }
  }
  close() {
    this.db.close();
  }
}

async function rootDir() {
  if (!globalThis.navigator?.storage?.getDirectory) return null;
  try {
    const root = await navigator.storage.getDirectory();
    return await root.getDirectoryHandle(ROOT_DIR, { create: true });
  } catch (_) {
    return null;
  }
}

async function readJson(dir, name) {
  try {
    const f = await (await dir.getFileHandle(name)).getFile();
    return JSON.parse(await f.text());
  } catch (_) {
    return null;
  }
}

async function writeJson(dir, name, value) {
  const h = await (await dir.getFileHandle(name, { create: true })).createSyncAccessHandle();
  const bytes = new TextEncoder().encode(JSON.stringify(value));
  h.truncate(0);
  h.write(bytes, { at: 0 });
  h.flush();
  h.close();
}

function isQuota(e) {
  return e && (e.name === 'QuotaExceededError' || /quota/i.test(e.message || ''));
}

// A model behind an URL, cached in OPFS or IndexedDB, downloadable in the background.
export class CachedModel {
  // opts: { crc32, onProgress, backing: 'auto' | 'opfs' | 'indexeddb' }
  static async open(url, opts) {
    const m = new CachedModel();
    m.url = new URL(url, globalThis.location?.href).href;
    m.key = keyOf(m.url);
    m.crc32 = opts.crc32;
    m.onProgress = opts.onProgress || (() => {});
    m.http = new RangeClient(m.url);
    m.stats = { verified: 0, checksumFailures: 0, fetchedOnDemand: 0, fetchedBackground: 0, hinted: 0, fetchedAhead: 0 };
    m.inflight = new Set();
    const root = opts.backing === 'indexeddb' ? null : await rootDir();
    let meta = null, dir = null, idb = null;
    if (root) {
      dir = await root.getDirectoryHandle(m.key, { create: true });
      meta = await readJson(dir, 'meta.json');
    } else if (opts.backing === 'opfs') {
      throw new LesStoreError('NotFound', 'OPFS is not available in this browser');
    } else {
      idb = await IdbBacking.open(m.key);
      meta = idb.meta;
    }
    try {
      if (!meta || meta.url !== m.url) {
        meta = await m._probe();
        await m._checkQuota(meta.size);
        if (dir) await writeJson(dir, 'meta.json', meta);
        if (idb) await idb.putMeta(meta);
      }
      m.meta = meta;
      m.size = meta.size;
      m.backing = dir ? await OpfsBacking.open(dir) : idb;
      m.dir = dir;
      m.root = root;
      if (!m.units) m.units = await m._units();
      m.bits = m.backing.presentBits(m.units.length);
    } catch (e) {
      if (isQuota(e)) await m._discard();
      throw e;
    }
    m._report();
    return m;
  }

  async _probe() {
    const size = await this.http.size();
    const headLen = Math.min(size, 4096);
    const head = await this.http.read(0, headLen);
    let kind = 'gguf';
    if (new TextDecoder().decode(head.subarray(0, 8)) === 'LESBUNDL') kind = 'bundle';
    return { url: this.url, size, kind, name: this.url.split('/').pop(), created: Date.now() };
  }

  async _units() {
    if (this.meta.kind !== 'bundle') return ggufUnits(this.size);
    // The header unit: fetched (and verified) through the normal path, then parsed.
    let probe = bundleUnits(this._headBytes(128), this.crc32);
    if (probe && probe.needHead) probe = bundleUnits(this._headBytes(probe.needHead), this.crc32);
    return probe.units;
  }

  _headBytes(n) {
    // Before the unit list exists, the header region is its own (unverified here, verified by
    // bundleUnits' CRCs) read straight from the backing or the network.
    const out = new Uint8Array(n);
    if (this.backing.kind === 'opfs' && this.backing.present.getSize() > 0 && this.backing.presentBits(1)[0]) {
      this.backing.read(0, out);
      return out;
    }
    if (this.backing.kind === 'indexeddb' && this.backing.blobs.has(0)) {
      return new Uint8Array(new FileReaderSync().readAsArrayBuffer(this.backing.blobs.get(0).slice(0, n)));
    }
    return this.http.readSync(0, n);
  }

  async _checkQuota(size) {
    if (!navigator.storage?.estimate) return;
    const { usage = 0, quota = Infinity } = await navigator.storage.estimate();
    if (size > quota - usage) {
      throw new LesStoreError('QuotaExceededError', `not enough browser storage for this model: it needs ${(size / 1048576).toFixed(1)} MiB, ${(Math.max(0, quota - usage) / 1048576).toFixed(1)} MiB are free (quota ${(quota / 1048576).toFixed(1)} MiB)`);
    }
  }

  // Delete everything stored for this model (after a quota error: nothing half-written stays).
  async _discard() {
    try { this.backing?.close(); } catch (_) {}
    this.backing = null;
    await deleteModelByKey(this.key);
  }

  findUnit(off) {
    let lo = 0, hi = this.units.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (this.units[mid].start <= off) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  presentBytes() {
    let n = 0;
    for (let i = 0; i < this.units.length; i++) if (this.bits[i]) n += this.units[i].end - this.units[i].start;
    return n;
  }

  complete() {
    return this.bits.every((b) => b === 1);
  }

  _report() {
    this.onProgress({ phase: 'download', loaded: this.presentBytes(), total: this.size, complete: this.complete(), backing: this.backing?.kind });
  }

  _verify(u, bytes) {
    if (u.crc === null) return true;
    const c = this.crc32(bytes.subarray(0, u.crcLen));
    if (c !== u.crc) {
      this.stats.checksumFailures++;
      return false;
    }
    this.stats.verified++;
    return true;
  }

  _store(i, bytes) {
    try {
      this.backing.write(this.units[i], i, bytes);
    } catch (e) {
      if (isQuota(e)) {
        const err = new LesStoreError('QuotaExceededError', `browser storage is full (${e.message}); the partial download was removed`);
        this.fatal = err; // the engine reports reads as plain errors: the worker rethrows this one
        this.discarding = this._discard(); // the worker awaits it before reporting the error
        throw err;
      }
      throw e;
    }
    this.bits[i] = 1;
  }

  _fetchUnitSync(i) {
    const u = this.units[i];
    for (let t = 0; t < MAX_TRIES; t++) {
      const bytes = this.http.readSync(u.start, u.end);
      if (this._verify(u, bytes)) {
        this._store(i, bytes);
        this.stats.fetchedOnDemand++;
        return;
      }
    }
    throw new LesStoreError('ChecksumError', `${u.label}: checksum mismatch ${MAX_TRIES} times (bytes ${u.start}-${u.end - 1})`);
  }

  // Synchronous read for the engine: missing units are fetched first.
  readSync(offset, length) {
    return this.readInto(offset, new Uint8Array(length), length);
  }

  // The same into `out` (the engine passes a view of its own memory: a fresh megabyte-sized
  // ArrayBuffer per read made OPFS reads ~10× slower in Chromium, 1.5 vs 15 GB/s). Null when
  // `out` was detached meanwhile (fetching a missing unit checks its CRC in the engine's wasm,
  // which may grow the engine's memory): the caller then reads with `readSync`.
  readInto(offset, out, length = out.byteLength) {
    if (this.fatal) throw this.fatal;
    if (!this.backing) throw new LesStoreError('NotFound', 'model storage was closed');
    const end = offset + length;
    for (let i = this.findUnit(offset); i < this.units.length && this.units[i].start < end; i++) {
      if (!this.bits[i]) this._fetchUnitSync(i);
    }
    if (out.byteLength !== length) return null;
    const read = () => this.backing.read(offset, out, this.units, (o) => this.findUnit(o));
    if (this.device) this.device.read(length, read); else read();
    return out;
  }

  // Lookahead range fetch: the engine predicted that it will need [offset, offset + length) (an
  // expert of a coming layer). Start fetching the missing units asynchronously; they are verified
  // and stored when they arrive, which happens whenever the worker yields (on the WebGPU path,
  // at every layer's readback). A read that comes first fetches the unit itself.
  hint(offset, length) {
    if (!this.backing || this.fatal) return;
    const end = offset + length;
    for (let i = this.findUnit(offset); i < this.units.length && this.units[i].start < end; i++) {
      if (this.bits[i] || this.inflight.has(i) || this.inflight.size >= MAX_AHEAD) continue;
      const u = this.units[i];
      this.inflight.add(i);
      this.stats.hinted++;
      this.http
        .read(u.start, u.end)
        .then((bytes) => {
          if (this.bits[i] || !this.backing || this.fatal || !this._verify(u, bytes)) return;
          this._store(i, bytes);
          this.stats.fetchedAhead++;
        })
        .catch(() => {}) // a failed lookahead fetch costs nothing: the read fetches the unit
        .finally(() => this.inflight.delete(i));
    }
  }

  // Where io.js may read asynchronously (the OPFS file; IndexedDB units are read synchronously
  // only), and whether [offset, offset + length) is stored there already.
  asyncSource() {
    return this.backing?.kind === 'opfs' ? { kind: 'opfs', dir: this.dir } : null;
  }
  canReadAsync(offset, length) {
    if (!this.backing || this.fatal) return false;
    const end = offset + length;
    for (let i = this.findUnit(offset); i < this.units.length && this.units[i].start < end; i++) if (!this.bits[i]) return false;
    return true;
  }

  // Download every missing unit (resumable: units already present are skipped).
  async download(signal) {
    for (let i = 0; i < this.units.length; i++) {
      if (signal?.aborted) return false;
      if (this.bits[i]) continue;
      const u = this.units[i];
      let ok = false;
      for (let t = 0; t < MAX_TRIES && !ok; t++) {
        const bytes = await this.http.read(u.start, u.end, signal);
        if (this.bits[i]) { ok = true; break; } // fetched on demand meanwhile
        if (this._verify(u, bytes)) {
          this._store(i, bytes);
          this.stats.fetchedBackground++;
          ok = true;
        }
      }
      if (!ok) throw new LesStoreError('ChecksumError', `${u.label}: checksum mismatch ${MAX_TRIES} times (bytes ${u.start}-${u.end - 1})`);
      this._report();
    }
    if (this.backing.pending) await Promise.all(this.backing.pending);
    this._report();
    return true;
  }

  close() {
    this.backing?.close();
    this.backing = null;
  }
}

// A local File (or a FileSystemFileHandle's file): read synchronously, nothing stored.
export class FileModel {
  constructor(file) {
    this.file = file;
    this.size = file.size;
    this.stats = {};
  }
  readSync(offset, length) {
    const read = () => new Uint8Array(new FileReaderSync().readAsArrayBuffer(this.file.slice(offset, offset + length)));
    return this.device ? this.device.read(length, read) : read();
  }
  complete() {
    return true;
  }
  asyncSource() {
    return { kind: 'file', file: this.file };
  }
  canReadAsync() {
    return true;
  }
  hint() {}
  async download() {
    return true;
  }
  close() {}
}

export async function listModels() {
  const root = await rootDir();
  const out = [];
  if (root) {
    for await (const [name, h] of root.entries()) {
      if (h.kind !== 'directory') continue;
      const meta = await readJson(h, 'meta.json');
      let bytes = 0;
      try { bytes = (await (await h.getFileHandle('data')).getFile()).size; } catch (_) {}
      out.push({ key: name, url: meta?.url, size: meta?.size, storedBytes: bytes, backing: 'opfs' });
    }
  }
  return out;
}

async function deleteModelByKey(key) {
  const root = await rootDir();
  if (root) {
    try { await root.removeEntry(key, { recursive: true }); } catch (_) {}
  }
  if (globalThis.indexedDB) {
    await new Promise((res) => {
      const q = indexedDB.deleteDatabase(`${ROOT_DIR}-${key}`);
      q.onsuccess = q.onerror = q.onblocked = () => res();
    });
  }
}

export async function deleteModel(url) {
  await deleteModelByKey(keyOf(new URL(url, globalThis.location?.href).href));
}

export async function storageUsage() {
  const e = navigator.storage?.estimate ? await navigator.storage.estimate() : {};
  return { usage: e.usage ?? 0, quota: e.quota ?? 0 };
}
