// Shared helpers of the browser tests: paths, the native engine as the reference, and a seeded PRNG.
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
export const LES = path.join(ROOT, process.env.LES_BIN_DIR || 'target/release', 'les');
export const PKG = path.join(ROOT, 'www/les/pkg');

// The benchmarks' prompt, and the paragraph `--long` puts before it (115 prompt
// tokens with SmolLM2's tokenizer: prompt tokens/s measure the batched kernels).
export const SHORT_PROMPT = 'The three primary colors are';
export const LONG_PROMPT = 'Color theory is the study of how colors mix, match and contrast. Painters learn that mixing pigments subtracts light, so combining many of them gives a dark brown, while mixing beams of light adds them, so combining many gives white. Printers use cyan, magenta, yellow and black inks; screens use tiny red, green and blue lights. Artists also speak of warm and cool colors, of complementary pairs that sit opposite each other on the color wheel, and of tints, shades and tones made by adding white, black or gray. ';

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
