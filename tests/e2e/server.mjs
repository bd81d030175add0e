// A static file server with HTTP Range support for the browser tests (and `node tests/e2e/server.mjs`
// to try the demo by hand): `/` serves www/, `/models/` serves models/. It counts requests and can
// inject faults into model responses:
//   GET /__stats                  {requests, bytes, ranges: [[path, start, end]...]}
//   GET /__reset                  zero the counters and clear faults
//   GET /__fault?cut=N            cut every model connection after N more body bytes (until cleared)
//   GET /__fault?corrupt=OFFSET   flip the byte at OFFSET in the next model response containing it
import http from 'node:http';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const TYPES = { '.html': 'text/html', '.js': 'text/javascript', '.mjs': 'text/javascript', '.css': 'text/css', '.wasm': 'application/wasm', '.json': 'application/json', '.png': 'image/png', '.svg': 'image/svg+xml' };

// `opts.root`: serve this folder at `/` instead of www/ (the npm package test's scratch app).
// `opts.isolated` (default true): send COOP/COEP, so pages are cross-origin isolated (shared
// memory for the engine's I/O worker, as a host following www/les/README.md does).
export function startServer(port = 0, opts = {}) {
  const isolation = opts.isolated === false ? {} : { 'Cross-Origin-Opener-Policy': 'same-origin', 'Cross-Origin-Embedder-Policy': 'require-corp' };
  const web = path.resolve(opts.root ?? path.join(ROOT, 'www'));
  const models = path.join(ROOT, 'models');
  const st = { requests: 0, bytes: 0, ranges: [], cut: null, corrupt: null };
  const reset = () => Object.assign(st, { requests: 0, bytes: 0, ranges: [], cut: null, corrupt: null });
  const server = http.createServer((req, res) => {
    const url = new URL(req.url, 'http://x');
    if (url.pathname === '/__stats') return json(res, { requests: st.requests, bytes: st.bytes, ranges: st.ranges });
    if (url.pathname === '/__reset') { reset(); return json(res, { ok: true }); }
    if (url.pathname === '/__fault') {
      if (url.searchParams.has('cut')) st.cut = Number(url.searchParams.get('cut')) || null;
      if (url.searchParams.has('corrupt')) st.corrupt = Number(url.searchParams.get('corrupt'));
      return json(res, { cut: st.cut, corrupt: st.corrupt });
    }
    const isModel = url.pathname.startsWith('/models/');
    const dir = isModel ? models : web;
    const rel = isModel ? url.pathname.slice('/models/'.length) : url.pathname === '/' ? 'index.html' : url.pathname;
    const file = path.resolve(dir, '.' + path.sep + decodeURIComponent(rel));
    if (!file.startsWith(dir + path.sep) || !fs.existsSync(file) || !fs.statSync(file).isFile()) {
      res.writeHead(404).end('not found');
      return;
    }
    const size = fs.statSync(file).size;
    const headers = { 'Content-Type': TYPES[path.extname(file)] ?? 'application/octet-stream', 'Accept-Ranges': 'bytes', 'Cache-Control': 'no-store', ...isolation };
    let start = 0, end = size; // [start, end)
    let status = 200;
    const m = /^bytes=(\d+)-(\d*)$/.exec(req.headers.range ?? '');
    if (m) {
      start = Number(m[1]);
      end = m[2] === '' ? size : Math.min(size, Number(m[2]) + 1);
      if (start >= size || end <= start) {
        res.writeHead(416, { 'Content-Range': `bytes */${size}` }).end();
        return;
      }
      status = 206;
      headers['Content-Range'] = `bytes ${start}-${end - 1}/${size}`;
    }
    headers['Content-Length'] = end - start;
    if (isModel) {
      st.requests++;
      st.ranges.push([url.pathname, start, end]);
    }
    res.writeHead(status, headers);
    if (req.method === 'HEAD') return res.end();
    let sent = 0;
    const stream = fs.createReadStream(file, { start, end: end - 1 });
    stream.on('data', (chunk) => {
      if (isModel && st.corrupt !== null && st.corrupt >= start + sent && st.corrupt < start + sent + chunk.length) {
        chunk = Buffer.from(chunk);
        chunk[st.corrupt - start - sent] ^= 0xff;
        st.corrupt = null;
      }
      if (isModel && st.cut !== null) {
        if (chunk.length >= st.cut) {
          res.write(chunk.subarray(0, st.cut));
          st.bytes += st.cut;
          st.cut = 0;
          stream.destroy();
          res.destroy();
          return;
        }
        st.cut -= chunk.length;
      }
      sent += chunk.length;
      if (isModel) st.bytes += chunk.length;
      res.write(chunk);
    });
    stream.on('end', () => res.end());
    stream.on('error', () => res.destroy());
  });
  return new Promise((resolve) => server.listen(port, '127.0.0.1', () => resolve({ server, port: server.address().port, stats: st })));
}

function json(res, v) {
  res.writeHead(200, { 'Content-Type': 'application/json', 'Cache-Control': 'no-store' }).end(JSON.stringify(v));
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const port = Number(process.argv[2] ?? 8080);
  startServer(port).then(({ port }) => console.log(`LES demo on http://127.0.0.1:${port}/ (models from models/)`));
}
