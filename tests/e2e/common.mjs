// Shared helpers of the browser tests: paths, the native engine as the reference, and a seeded PRNG.
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
export const LES = path.join(ROOT, process.env.LES_BIN_DIR || 'target/release', 'les');
export const PKG = path.join(ROOT, 'www/les/pkg');

export function need(file, hint) {
  if (!fs.existsSync(file)) throw new Error(`${path.relative(ROOT, file)} is missing: ${hint}`);
}

// Greedy token ids from the native engine (`les run --tokens-out`). `env` e.g. {LES_NO_SIMD: '1'}
// selects the portable kernels, which the wasm build reproduces bit for bit.
export function nativeTokens(model, prompt, n, extra = [], env = {}) {
  const out = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'les-native-')), 'tokens.json');
  execFileSync(LES, ['run', '--model', model, '--prompt', prompt, '-n', String(n), '--temp', '0', '--tokens-out', out, ...extra], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  return JSON.parse(fs.readFileSync(out, 'utf8').trim().split('\n')[0]);
}

// Mulberry32: a small seeded PRNG for reproducible test inputs.
export function prng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
